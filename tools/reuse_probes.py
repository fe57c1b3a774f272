"""Probes behind the statements about reuse's backward in nbs/01e_aot.ipynb, nbs/08b_bench_step.ipynb and issue 11 (a maintainers' helper).

Usage: python tools/reuse_probes.py PROBE [--model M] [--img N] [--keep K] [--repeats R] [--top N]

  depthwise    oneDNN's depthwise 7x7 convolution backward at [88, 320, 1, 1] with an NCHW- or channels-last-strided input
  strides-ab   reuse backward / kept-only floor with take_rows as it was (is_contiguous() shortcut) and as it is,
               both traced and run interleaved in one process
  pieces       per-step milliseconds of reuse's Python around the backward graph (_bw_args, _aligned)
  fixed-cost   at K (default 2 rows): reuse and floor backward, the floor with its caches evicted before its backward,
               the floor after an extra forward of all B rows, reuse with the frees of its saved values deferred, reuse
               after an extra forward of the kept rows (the weights warm in cache, as in the floor's backward), the floor
               while a reuse forward's saved values of all B rows are alive (their memory held, as in reuse's backward)
  gather-forms a [128, 64, 32, 32] value's 45 kept rows copied by index_select, by copies of runs, by cat of runs and by
               advanced indexing, from a cold source
  op-call      one aten op called through OpOverload, its raw C++ callable, and the torch function
  conv-args    every convolution backward's arguments (shapes, strides, 64-byte alignment, output mask) in reuse's backward
               and in the floor's at K kept rows (default 2), compared as multisets
  gathers-first
               reuse's backward with each kept-row copy right before its value's first use (as built) and with every
               copy moved before the first op (tried, not adopted), interleaved with the floor (median of paired
               ratios to the floor);
               then the take_rows calls timed inside each placement's backward and the same calls timed alone (warm; the
               timed pass holds each copied value until its step ends, in both placements)
  gathers-memory
               peak memory of a step for dense and reuse at --keep and at 0.69, with the copies placed either way, each
               placement in a fresh process running the bench's memory phase (capskip bench step's resident-set
               sampling over every configuration, under its allocator settings)
  ops          reuse and floor backward interleaved, every aten op timed: per op, the median per-step milliseconds in each
               and their difference (the ops that carry reuse's excess), and the median paired ratio of the backward's
               wall time and of its summed op time (timing each op adds the same per-call cost to both)

Timings are medians; run on a quiet machine, run twice, and compare ratios within one run only. The timed commands of the
package set glibc allocator tunables (capskip.core.TIMING_ALLOCATOR); this helper re-executes itself with them too
(gathers-memory: with capskip.core.MEMORY_ALLOCATOR, as the bench's memory phase).
"""
import argparse, copy, os, statistics, sys, time, timeit

import torch

from capskip.core import MEMORY_ALLOCATOR, TIMING_ALLOCATOR


def median_ms(f, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def depthwise(a):
    w = torch.randn(320, 1, 7, 7)
    for x_cl in (False, True):
        x = torch.randn(88, 1, 1, 320).permute(0, 3, 1, 2) if x_cl else torch.randn(88, 320, 1, 1)
        g = torch.randn(88, 320, 1, 1)
        f = lambda: torch.ops.aten.convolution_backward(g, x, w, [320], [1, 1], [3, 3], [1, 1], False, [0, 0], 320, [True] * 3)
        f(); f()
        print(f'input strides {tuple(x.stride())} ({"channels-last" if x_cl else "NCHW"}): {median_ms(f, a.repeats):.2f} ms')


def old_take_rows(t, d, index):
    "take_rows before the fix: the is_contiguous() shortcut loses channels-last strides where dims have size 1."
    if t.is_contiguous(): return t.index_select(d, index)
    order = sorted(range(t.ndim), key=lambda i: (-t.stride(i), i))
    out = t.permute(order).index_select(order.index(d), index)
    return out.permute([order.index(i) for i in range(t.ndim)])


def runner(a):
    from capskip.bench.step import StepBench, build_runner
    return build_runner(StepBench(model=a.model, img=a.img, batch=128))


def strides_ab(a):
    import capskip.engine._aot as A
    new, runners, keeps = A.take_rows, {}, [0.35, 0.69]
    for name, fn in (('before', old_take_rows), ('now', new)):
        A.take_rows = fn                                      # _rewrite_backward inserts the function it finds at trace time
        r = runners[name] = runner(a)
        for k in keeps:
            for _ in range(2): r.step('reuse', k); r.step('kept_only', k)
    A.take_rows = new
    t = {(n, m, k): [] for n in runners for m in ('reuse', 'kept_only') for k in keeps}
    for _ in range(a.repeats):
        for k in keeps:
            for n, r in runners.items():
                for m in ('reuse', 'kept_only'): t[(n, m, k)].append(r.step(m, k)['backward'])
    for k in keeps:
        for n in runners:
            ru, fl = t[(n, 'reuse', k)], t[(n, 'kept_only', k)]
            print(f'k={k} take_rows {n:6s}: reuse backward {statistics.median(ru) * 1e3:7.1f} ms, floor '
                  f'{statistics.median(fl) * 1e3:7.1f} ms, ratio of medians {statistics.median(ru) / statistics.median(fl):.3f}, '
                  f'median of paired ratios {statistics.median([x / y for x, y in zip(ru, fl)]):.3f}')


def pieces(a):
    from capskip.engine import reuse as R
    spent = {}
    def timed(name):
        f = getattr(R, name)
        def w(*args, **kw):
            t0 = time.perf_counter(); out = f(*args, **kw); spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            return out
        setattr(R, name, w)
    for name in ('_bw_args', '_aligned', 'guards_hold'): timed(name)
    r = runner(a)
    for _ in range(3): r.step('reuse', a.keep)
    spent.clear()
    for _ in range(a.repeats): r.step('reuse', a.keep)
    for name, s in spent.items(): print(f'{name:12s} {s / a.repeats * 1e3:.3f} ms per step')


def fixed_cost(a):
    r = runner(a)
    k, buf, hold = a.keep, torch.empty(96 << 18), []          # 96 MiB: larger than the 32 MiB L3 of the machines used
    floor, reuse = r.engines['kept_only'], r.engines['reuse']
    def with_forward(engine, after):
        f = engine.forward
        def run():
            def fwd(*args, **kw):
                out = f(*args, **kw); after(out); return out
            engine.forward = fwd
            try: return r.step('kept_only' if engine is floor else 'reuse', k)['backward']
            finally: engine.forward = f
        return run
    def all_rows(_):
        with torch.no_grad(): r.model(r.x)
    def held(_):                                            # reuse's saved values of all B rows alive during the floor's backward
        hold.append(reuse.forward(r.x))
    def kept_rows(_):
        with torch.no_grad(): r.model(r.x[:max(1, round(k * r.x.shape[0]))])
    cases = {'reuse': lambda: r.step('reuse', k)['backward'],
             'reuse, frees deferred': with_forward(reuse, lambda out: hold.append(list(out.state.saved))),
             'floor': lambda: r.step('kept_only', k)['backward'],
             'floor, caches evicted': with_forward(floor, lambda _: buf.fill_(1.0)),
             'floor, after a B-row forward': with_forward(floor, all_rows),
             'reuse, after a kept-row forward': with_forward(reuse, kept_rows),
             'floor, holding a reuse forward': with_forward(floor, held)}
    for f in cases.values(): f(); f(); hold.clear()
    t = {c: [] for c in cases}
    for _ in range(a.repeats):
        for c, f in cases.items(): t[c].append(f() * 1e3); hold.clear()
    print(f'{a.model} at {round(k * 128)} kept rows of 128: backward medians')
    for c, v in t.items(): print(f'  {c:30s} {statistics.median(v):7.2f} ms')


def gather_forms(a):
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(128, 64, 32, 32) for _ in range(12)]    # 384 MiB, cycled: each source is cold when read
    idx = torch.randperm(128, generator=g)[:45].sort().values
    runs = []
    for i in idx.tolist():
        if runs and runs[-1][0] + runs[-1][1] == i: runs[-1][1] += 1
        else: runs.append([i, 1])
    def run_copies(t):
        out, o = torch.empty((45,) + t.shape[1:]), 0
        for s, n in runs: out[o:o + n].copy_(t[s:s + n]); o += n
        return out
    forms = {'index_select': lambda t: t.index_select(0, idx), 'copies of runs': run_copies,
             'cat of runs': lambda t: torch.cat([t.narrow(0, s, n) for s, n in runs]), 'advanced indexing': lambda t: t[idx],
             'contiguous 45 rows (reference)': lambda t: t[:45].clone()}
    nbytes = 2 * 45 * srcs[0][0].numel() * 4
    for name, f in forms.items():
        it = iter(range(10 ** 9))
        ms = median_ms(lambda: f(srcs[next(it) % len(srcs)]), 3 * len(srcs))
        print(f'{name:32s} {ms:6.2f} ms  {nbytes / ms / 1e6:5.1f} GB/s read+write ({len(runs)} runs)')


def op_call(a):
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    op = torch.ops.aten.mm.default
    env = dict(op=op, raw=op._op, x=x, y=y, torch=torch)
    for stmt in ('op(x, y)', 'raw(x, y)', 'torch.mm(x, y)'):
        timeit.timeit(stmt, globals=env, number=2000)
        print(f'{stmt:16s} {timeit.timeit(stmt, globals=env, number=20000) / 20000 * 1e6:.2f} us')


def ops(a):
    from collections import defaultdict
    from torch.utils._python_dispatch import TorchDispatchMode
    class OpTimer(TorchDispatchMode):
        def __init__(self): super().__init__(); self.spent, self.on = defaultdict(float), False
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter(); out = func(*args, **(kwargs or {}))
            if self.on: self.spent[func.overloadpacket.__name__] += time.perf_counter() - t0
            return out
    r, modes = runner(a), ('reuse', 'kept_only')
    for _ in range(2):
        for m in modes: r.step(m, a.keep)                   # traced and warm before any op is timed
    timers = {m: OpTimer() for m in modes}
    for m, tm in timers.items():
        engine = r.engines[m]
        def backward(*args, _f=engine.backward, _tm=tm, **kw):
            _tm.on, t0 = True, time.perf_counter()
            try: return _f(*args, **kw)
            finally: _tm.on = False; _tm.spent['(wall)'] += time.perf_counter() - t0
        engine.backward = backward
    per = {m: [] for m in modes}
    for _ in range(a.repeats):
        for m, tm in timers.items():
            tm.spent = defaultdict(float)
            with tm: r.step(m, a.keep)
            tm.spent['(sum of ops)'] = sum(v for k, v in tm.spent.items() if k != '(wall)')
            per[m].append(dict(tm.spent))
    names = set().union(*(d for m in modes for d in per[m]))
    med = {m: {n: statistics.median(d.get(n, 0.0) for d in per[m]) * 1e3 for n in names} for m in modes}
    paired = lambda n: statistics.median(x[n] / y[n] for x, y in zip(per['reuse'], per['kept_only']))
    print(f'{a.model} at {a.img} px, {round(a.keep * 128)} kept rows of 128, {a.repeats} interleaved steps: backward ms per step')
    print(f'{"op":44s} {"reuse":>8s} {"floor":>8s} {"reuse-floor":>12s}')
    for n in sorted(names, key=lambda n: -abs(med['reuse'][n] - med['kept_only'][n]))[:a.top]:
        print(f'{n[:44]:44s} {med["reuse"][n]:8.2f} {med["kept_only"][n]:8.2f} {med["reuse"][n] - med["kept_only"][n]:+12.2f}')
    print(f'reuse / floor, median of paired ratios: wall {paired("(wall)"):.3f}, sum of ops {paired("(sum of ops)"):.3f}')


def conv_args(a):
    from torch.utils._python_dispatch import TorchDispatchMode
    class Args(TorchDispatchMode):
        def __init__(self): super().__init__(); self.calls, self.on = [], False
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.on and func is torch.ops.aten.convolution_backward.default:
                self.calls.append(tuple((tuple(t.shape), t.stride(), t.data_ptr() % 64) for t in args[:3]) + tuple(map(str, args[3:])))
            return func(*args, **(kwargs or {}))
    r, got = runner(a), {}
    for m in ('reuse', 'kept_only'):
        for _ in range(2): r.step(m, a.keep)
        engine, mode = r.engines[m], Args()
        def backward(*args, _f=engine.backward, _m=mode, **kw):
            _m.on = True
            try: return _f(*args, **kw)
            finally: _m.on = False
        engine.backward = backward
        with mode: r.step(m, a.keep)
        got[m] = sorted(mode.calls)
    same = got['reuse'] == got['kept_only']
    print(f'{a.model} at {round(a.keep * 128)} kept rows of 128: {len(got["reuse"])} convolution backwards in reuse, '
          f'{len(got["kept_only"])} in the floor; arguments {"identical" if same else "differ"}')
    for x, y in zip(got['reuse'], got['kept_only']):
        if x != y: print('  reuse', x, '\n  floor', y)


def _gathers_first(gm):
    "A copy of a sliced backward graph with every kept-row copy (take_rows; a shared storage's block gather and its members' views) moved before the first op, in graph order (tried 2026-12-02, not adopted)."
    from capskip.engine._aot import merged_rows, take_rows
    from capskip.engine.gathers import rows_view
    gm = copy.deepcopy(gm)
    g = gm.graph
    block = lambda n: (n.target is torch.ops.aten.index_select.default and n.args[0].op == 'placeholder'
                       and n.args[0].name.startswith('capskip_block'))
    moves = [n for n in g.nodes if n.op == 'call_function' and (n.target in (take_rows, rows_view) or block(n))]
    anchor = next(n for n in g.nodes if n.op not in ('placeholder',) and n not in moves and n.target is not merged_rows)
    for n in moves: anchor.prepend(n)
    g.lint(); gm.recompile()
    return gm


def gathers_first(a):
    from capskip.engine import reuse as R
    import capskip.engine._aot as A
    r, orig, made = runner(a), R.Reuse.sliced_backward, {}
    def use(place):
        def sliced(self, traced, saved, B):
            g, blocks = orig(self, traced, saved, B)
            if (id(g), place) not in made: made[(id(g), place)] = (g, g if place == 'at first use' else _gathers_first(g))
            return made[(id(g), place)][1], blocks
        R.Reuse.sliced_backward = sliced
    t = {n: [] for n in ('at first use', 'gathers first', 'floor')}
    for rep in range(a.repeats + 2):
        for n in list(t)[rep % len(t):] + list(t)[:rep % len(t)]:   # rotated: no variant always follows the same one
            if n == 'floor': ms = r.step('kept_only', a.keep)['backward']
            else: use(n); ms = r.step('reuse', a.keep)['backward']
            if rep >= 2: t[n].append(ms * 1e3)
    print(f'{a.model} at {round(a.keep * 128)} kept rows of 128: backward medians, and the median of paired ratios to the floor')
    for n, v in t.items():
        ratio = '' if n == 'floor' else f'  {statistics.median([x / y for x, y in zip(v, t["floor"])]):.3f}'
        print(f'  {n if n != "floor" else "floor (autograd, kept rows)":28s} {statistics.median(v):7.2f} ms{ratio}')
    calls, spent, take = [], [0.0], A.take_rows
    def timed(x, d, index):
        t0 = time.perf_counter(); out = take(x, d, index); spent[0] += time.perf_counter() - t0
        calls.append((x, d, index)); return out
    for place in ('at first use', 'gathers first'):
        use(place)
        for key, (g, gm) in list(made.items()):       # the same graphs, with take_rows timed
            if key[1] != place: continue
            gm = copy.deepcopy(gm)
            for n in gm.graph.nodes:
                if n.target is take: n.target = timed
            gm.recompile()
            made[key] = (g, gm)
        inside, alone, n_calls = [], [], 0
        for _ in range(a.repeats):
            calls.clear(); spent[0] = 0.0
            r.step('reuse', a.keep)
            inside.append(spent[0] * 1e3)
            alone.append(sum(min(timeit.repeat(lambda: take(*c), number=1, repeat=5)) for c in calls) * 1e3)
            n_calls = len(calls); calls.clear()
        print(f'  take_rows, {place}: {n_calls} calls, {statistics.median(inside):.2f} ms per step inside the backward, '
              f'{statistics.median(alone):.2f} ms timed alone (warm)')
    R.Reuse.sliced_backward = orig


def _placement_peaks(a):
    "In this process: the bench's memory phase (every configuration) with the copies placed as --place says; JSON on stdout."
    import json
    from capskip.bench.step import measure_cpu_memory
    from capskip.engine import reuse as R
    r, orig, made = runner(a), R.Reuse.sliced_backward, {}
    def first(self, traced, saved, B):
        g, blocks = orig(self, traced, saved, B)
        if id(g) not in made: made[id(g)] = _gathers_first(g)
        return made[id(g)], blocks
    if a.place == 'gathers first': R.Reuse.sliced_backward = first
    peaks = measure_cpu_memory(r, sorted({a.keep, 0.69}), steps=3)
    print(json.dumps({f'{m}@{k}': v for (m, k), v in peaks.items()}))


def gathers_memory(a):
    import json, subprocess
    got = {}
    for place in ('at first use', 'gathers first'):       # each in a fresh process, as the bench's memory phase runs
        cmd = [sys.executable, __file__, 'gathers-memory', '--model', a.model, '--img', str(a.img), '--keep', str(a.keep),
               '--place', place]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        got[place] = json.loads(out.strip().splitlines()[-1])
    for k in sorted({a.keep, 0.69}):
        dense = {n: p['dense@1.0'] for n, p in got.items()}
        reuse = {n: p[f'reuse@{k}'] for n, p in got.items()}
        print(f'{a.model} {a.img} px, k = {k}: peak MiB ' + ', '.join(f'{n}: reuse {reuse[n] / 2**20:.1f}, dense {dense[n] / 2**20:.1f}'
                                                                     for n in got)
              + ' (reuse ÷ dense: ' + ', '.join(f'{n} {reuse[n] / dense[n]:.2f}' for n in got) + ')')


PROBES = {'depthwise': depthwise, 'strides-ab': strides_ab, 'pieces': pieces, 'fixed-cost': fixed_cost,
          'gather-forms': gather_forms, 'op-call': op_call, 'ops': ops, 'conv-args': conv_args,
          'gathers-first': gathers_first, 'gathers-memory': gathers_memory}

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('probe', choices=sorted(PROBES))
    p.add_argument('--model', default='timm:convnext_atto')
    p.add_argument('--img', type=int, default=32)
    p.add_argument('--keep', type=float, default=None, help='kept fraction (default: 2/128 for fixed-cost and conv-args, 0.35 otherwise)')
    p.add_argument('--repeats', type=int, default=11)
    p.add_argument('--top', type=int, default=12, help='ops: how many ops to list (largest differences first)')
    p.add_argument('--place', choices=('at first use', 'gathers first'), help=argparse.SUPPRESS)   # gathers-memory's child processes
    a = p.parse_args()
    if a.keep is None: a.keep = 2 / 128 if a.probe in ('fixed-cost', 'conv-args') else 0.35
    env = MEMORY_ALLOCATOR if a.probe == 'gathers-memory' else TIMING_ALLOCATOR
    if any(os.environ.get(k) != v for k, v in env.items()):
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **env})
    (_placement_peaks if a.place else PROBES[a.probe])(a)
