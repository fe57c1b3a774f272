"""The causal LM's user path, `loss = skip.loss(skip(x), y); loss.backward()`, with the loss as `SequenceCE` (since
999c4db) and as F.cross_entropy's graph (before it), against a plain dense step: time and peak memory (a maintainers'
benchmark).

Usage: python tools/loss_path.py [--layers N] [--batch B] [--seq L] [--keep K,K] [--repeats R] [--phase time|memory]

On the benchmark's LM (`capskip bench step --model width_lm`: GPT-2-small width, V = 50257, random ids), each step
forwards every row and back-propagates; `CAPSkip(model, mode='reuse', gram='topk')` selects (the selector runs in both
reuse paths), and seeded random rows are kept by giving the others weight 0 (`weights=`), as `capskip bench step` keeps
them whatever the rule decides. `dense` is `F.cross_entropy(model(x)...).backward()` with no engine. `reuse, CE graph` is
the code before 999c4db: the same selection, then `F.cross_entropy` of every row weighted by `skip.last.applied`
(autograd saves its [B, L, V] log-softmax, builds every row's gradient, and reuse's node copies the kept rows').
`reuse, SequenceCE` is `skip.loss(...)` now. Time: the configurations interleaved, repetition by repetition, medians,
under `capskip.core.TIMING_ALLOCATOR`; memory: a separate process under `MEMORY_ALLOCATOR` (allocations over 256 KiB
mmapped), the largest resident-set rise during a step (1 ms sampling) plus the parameters' and gradients' bytes, as
`capskip bench step` measures it. No optimizer step.
"""
import argparse, copy, json, os, statistics, subprocess, sys, time


def build(ns):
    "The model, the CAPSkip door, the batch and the kept masks."
    import torch
    from capskip import CAPSkip
    from capskip.bench.sequence import WidthLM, token_batch
    torch.manual_seed(0)
    model = WidthLM(ns.layers, 768, 50257, 12, max(1024, ns.seq), features=False).train()
    x, y = token_batch(ns.batch, ns.seq, 50257, 0, 'cpu')
    gen = torch.Generator().manual_seed(0)
    masks = {k: torch.zeros(ns.batch).index_fill_(0, torch.randperm(ns.batch, generator=gen)[:max(1, round(k * ns.batch))], 1.0)
             for k in ns.keeps}
    plain = copy.deepcopy(model)                                           # dense: the same weights, no engine on it
    return model, plain, CAPSkip(model, mode='reuse', gram='topk'), x, y, masks


def steps(model, plain, skip, x, y, masks):
    "Each configuration's step as a function that leaves the parameters' gradients."
    import torch, torch.nn.functional as F
    B, L = y.shape
    def dense():
        F.cross_entropy(plain(x).flatten(0, 1), y.flatten()).backward()
    def ce_graph(w):
        logits = skip(x)
        with torch.no_grad(): skip.loss(logits, y, weights=w)             # the selection, as the loss made it
        tok = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction='none').view(B, L)
        ((tok.sum(1) * skip.last.applied).sum() / (B * L)).backward()
    def sequence_ce(w):
        skip.loss(skip(x), y, weights=w).backward()
    out = {('dense', 1.0): dense}
    for k, w in masks.items():
        out[('reuse, CE graph', k)] = lambda w=w: ce_graph(w)
        out[('reuse, SequenceCE', k)] = lambda w=w: sequence_ce(w)
    return out


def run_phase(ns) -> dict:
    "This process's measurements: median milliseconds per configuration (time) or peak bytes (memory)."
    from capskip.bench.step import RSSSampler
    model, plain, skip, x, y, masks = build(ns)
    fns = steps(model, plain, skip, x, y, masks)
    def zero():
        model.zero_grad(set_to_none=True); plain.zero_grad(set_to_none=True)
    def once(fn):
        zero(); fn()
    for fn in fns.values(): once(fn)                                       # warm-up (reuse traces the model once)
    if ns.phase == 'time':
        times = {c: [] for c in fns}
        for _ in range(ns.repeats):
            for c, fn in fns.items():
                zero()
                t0 = time.perf_counter(); fn(); times[c].append(1e3 * (time.perf_counter() - t0))
        return {json.dumps(c): statistics.median(v) for c, v in times.items()}
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    peaks = {}
    for c, fn in fns.items():
        best = 0
        for _ in range(2):
            zero()
            with RSSSampler() as s: fn()
            best = max(best, 2 * params + s.peak - s.start)                  # parameters and their gradients
        peaks[json.dumps(c)] = best
    return peaks


def launch(ns, phase: str, env: dict) -> dict:
    "`run_phase` in a fresh process with allocator settings `env`."
    args = [sys.executable, __file__, '--phase', phase, '--layers', str(ns.layers), '--batch', str(ns.batch),
            '--seq', str(ns.seq), '--keep', ','.join(f'{k:g}' for k in ns.keeps), '--repeats', str(ns.repeats)]
    got = subprocess.run(args, env={**os.environ, **env}, capture_output=True, text=True)
    lines = [l for l in got.stdout.splitlines() if l.startswith('RESULT ')]
    if got.returncode != 0 or not lines: raise SystemExit(f'loss_path: the {phase} process failed:\n{got.stderr[-2000:]}')
    return {tuple(json.loads(k)): v for k, v in json.loads(lines[-1][7:]).items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--layers', type=int, default=2); ap.add_argument('--batch', type=int, default=8)
    ap.add_argument('--seq', type=int, default=128); ap.add_argument('--keep', default='0.375,0.75')
    ap.add_argument('--repeats', type=int, default=5); ap.add_argument('--phase', choices=('time', 'memory'))
    ns = ap.parse_args()
    try: ns.keeps = [float(k) for k in ns.keep.split(',')]
    except ValueError: raise SystemExit(f'loss_path: --keep takes kept fractions separated by commas, e.g. 0.375,0.75; got {ns.keep!r}')
    if not all(0 < k <= 1 for k in ns.keeps): raise SystemExit(f'loss_path: each kept fraction must lie in (0, 1], got {ns.keep!r}')
    if ns.phase is not None:
        print('RESULT ' + json.dumps(run_phase(ns)), flush=True)
        return 0
    import torch
    from capskip.bench.step import machine_name
    from capskip.core import MEMORY_ALLOCATOR, TIMING_ALLOCATOR
    print(f'loss_path: timing {1 + 2 * len(ns.keeps)} configurations x {ns.repeats} repetitions (2 blocks: about a minute; '
          '12 blocks: several) ...', file=sys.stderr, flush=True)
    ms = launch(ns, 'time', TIMING_ALLOCATOR)
    print('loss_path: peak memory, in a fresh process ...', file=sys.stderr, flush=True)
    peak = launch(ns, 'memory', MEMORY_ALLOCATOR)
    head = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()
    print(f'$ python tools/loss_path.py --layers {ns.layers} --batch {ns.batch} --seq {ns.seq} --keep {ns.keep} --repeats {ns.repeats}')
    print(f'{machine_name("cpu")}, torch {torch.__version__}, at {head or "?"}, {time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}; '
          f'WidthLM {ns.layers} blocks, B={ns.batch}, L={ns.seq}, V=50257; forward + backward, no optimizer step')
    d_ms, d_peak = ms[('dense', 1.0)], peak[('dense', 1.0)]
    print(f'{"path":18s} {"k":>6s} {"step ms":>9s} {"/ dense":>8s} {"peak MiB":>9s} {"/ dense":>8s}')
    for c in ms:
        print(f'{c[0]:18s} {c[1]:6.3f} {ms[c]:9.1f} {ms[c] / d_ms:8.3f} {peak[c] / 2**20:9.1f} {peak[c] / d_peak:8.3f}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
