"""The top-k selector at another revision against this checkout's, timed interleaved in one process (a maintainers' helper).

Usage: python tools/ab_selector.py REV [--layers N] [--batch B] [--seq L] [--repeats R] [--allocator timing|default]

Loads `capskip/sequence_bounds.py` as it was at git revision REV (its imports resolve to this checkout's other modules,
but its row-chunk size is REV's `capskip.sequence.PASS_ELEMENTS`) and
times `select_sequences_topk` from it and from this checkout on one batch of the benchmark's LM (`capskip bench step
--model width_lm`: GPT-2-small width, V = 50257, random ids), round by round, so a machine whose speed drifts shares
both columns. Checks first that both give the same Gram bounds. `--allocator timing` re-executes this script under
`capskip.core.TIMING_ALLOCATOR` (the malloc settings `capskip bench step` times under: no mmap, so a large temporary
does not fault its pages in again on every call); `default` keeps glibc's (allocations over 32 MB are mmapped and
faulted in on each call, as in a plain training process).
"""
import argparse, os, re, statistics, subprocess, sys, time, types


def load_at(rev: str) -> types.ModuleType:
    "capskip.sequence_bounds as it was at `rev`, as a module of the capskip package (relative imports resolve here)."
    got = subprocess.run(['git', 'show', f'{rev}:capskip/sequence_bounds.py'], capture_output=True, text=True)
    if got.returncode != 0:
        raise SystemExit(f'ab_selector: no capskip/sequence_bounds.py at revision {rev!r} in this checkout '
                         f'(git: {got.stderr.strip().splitlines()[-1] if got.stderr.strip() else "failed"}); name a commit that has it, e.g. b719e38')
    src = got.stdout
    mod = types.ModuleType('capskip._sequence_bounds_at_rev')
    mod.__package__ = 'capskip'
    exec(compile(src, f'{rev}:capskip/sequence_bounds.py', 'exec'), mod.__dict__)
    seq = subprocess.run(['git', 'show', f'{rev}:capskip/sequence.py'], capture_output=True, text=True).stdout
    chunk = re.search(r'^PASS_ELEMENTS = 1 << (\d+)', seq, re.M)       # the row-chunk size it imported, as it was at `rev`
    if chunk and '_PASS_ELEMENTS = PASS_ELEMENTS' in src: mod._PASS_ELEMENTS = 1 << int(chunk.group(1))
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('rev'); ap.add_argument('--layers', type=int, default=2); ap.add_argument('--batch', type=int, default=8)
    ap.add_argument('--seq', type=int, default=128); ap.add_argument('--repeats', type=int, default=15)
    ap.add_argument('--allocator', choices=('timing', 'default'), default='timing')
    ns = ap.parse_args()
    import torch
    from capskip.core import TIMING_ALLOCATOR
    if ns.allocator == 'timing' and any(os.environ.get(k) != v for k, v in TIMING_ALLOCATOR.items()):
        os.execvpe(sys.executable, [sys.executable, *sys.argv], {**os.environ, **TIMING_ALLOCATOR})
    import capskip.sequence_bounds as here
    from capskip.bench.step import StepBench, build_lm_runner, machine_name
    old = load_at(ns.rev)
    head = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip() or 'this'
    if subprocess.run(['git', 'diff', '--quiet', 'HEAD', '--', 'capskip/sequence_bounds.py']).returncode != 0:
        head += '+changes'                                         # this checkout's file differs from its commit
    if head == ns.rev: head += ' (this)'
    runner = build_lm_runner(StepBench(model='width_lm', seq=ns.seq, batch=ns.batch, keeps=[1.0], layers=ns.layers, gram='topk'))
    with torch.no_grad(): fwd = runner.engines['dense'].forward(runner.x)
    z, h, y = fwd.logits.detach(), fwd.features.detach(), runner.y
    a, b = old.topk_gram_bounds(z, y, h), here.topk_gram_bounds(z, y, h)
    diff = max(float((p - q).abs().max() / p.abs().max().clamp_min(1e-300)) for p, q in zip(a, b))
    fns = {ns.rev: lambda: old.select_sequences_topk(z, y, h, 0.09), head: lambda: here.select_sequences_topk(z, y, h, 0.09)}
    for fn in fns.values(): fn()                                   # warm-up
    times = {k: [] for k in fns}
    for _ in range(ns.repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter(); fn(); times[k].append(1e3 * (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = sorted(n / o for o, n in zip(times[ns.rev], times[head]))
    print(f'{machine_name("cpu")}, torch {torch.__version__}, allocator {ns.allocator}; WidthLM {ns.layers} blocks, '
          f'B={ns.batch}, L={ns.seq}, V=50257; select_sequences_topk (top-16), {ns.repeats} interleaved rounds')
    print(f'bounds at {ns.rev} and {head}: largest difference {diff:.1e} of the largest entry; row chunks of '
          f'{old._PASS_ELEMENTS} and {here._PASS_ELEMENTS} logits')
    for k in fns: print(f'{k:>10}: median {med[k]:7.1f} ms (min {min(times[k]):.1f}, max {max(times[k]):.1f})')
    print(f'{head} / {ns.rev}: median of the per-round ratios {statistics.median(ratios):.3f} '
          f'(middle half {ratios[len(ratios) // 4]:.3f}-{ratios[(3 * len(ratios)) // 4]:.3f})')
    return 0


if __name__ == '__main__':
    sys.exit(main())
