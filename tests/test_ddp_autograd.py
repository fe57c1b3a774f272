"""Reuse under torch's DistributedDataParallel, 2 real gloo processes (issue: "The skipping happens inside
`loss.backward()`", item 3): `CAPSkip(DDP(model))` and a DDP-wrapped module holding a `CAPSkip` run `reuse` with no
fallback, leave identical gradients on every rank equal to the average of the ranks' plain-autograd gradients of their
kept rows, accumulate under `no_sync`, and a forward that bypasses the wrapper is refused."""
import textwrap

import pytest
import torch

from test_ddp import rank_results

WORKER = textwrap.dedent('''
    import copy, sys, warnings
    import torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import capskip
    from capskip.engine.reuse import cached_traces
    from capskip.runs.distributed import init_distributed
    from capskip.testing import digits_tensors, trained_digits_mlp

    warnings.simplefilter('error', RuntimeWarning)            # a fallback to reforward warns: make it fail
    out = sys.argv[1]
    dist = init_distributed('cpu')
    r, W = dist.rank, dist.world_size
    X, Y, _, _ = digits_tensors()
    base = trained_digits_mlp()
    x, y = X[64 * r: 64 * (r + 1)], Y[64 * r: 64 * (r + 1)]
    grads = lambda m: {n: p.grad.detach().clone() for n, p in m.named_parameters()}

    def reference(parts):
        "Mean over ranks of plain autograd of Σ_parts (1/64) Σ applied_i CE on this rank's rows."
        twin = copy.deepcopy(base)
        for xs, ys, applied in parts:
            (F.cross_entropy(twin(xs), ys, reduction='none') * applied).sum().div(64).backward()
        ref = grads(twin)
        for g in ref.values(): tdist.all_reduce(g); g /= W
        return ref

    res = {}
    def graph_nodes(t):
        "The type names of the autograd nodes behind `t`."
        seen, stack = [], [t.grad_fn]
        while stack:
            fn = stack.pop()
            if fn is not None and fn not in seen: seen.append(fn); stack.extend(n for n, _ in fn.next_functions)
        return [type(fn).__name__ for fn in seen]
    # 1) CAPSkip on the DDP-wrapped model, its gradients in several buckets (dynamo would split the trace at them)
    model = copy.deepcopy(base)
    skip = capskip.CAPSkip(DDP(model, bucket_cap_mb=0.005), budget=0.3, mode='reuse')
    skip.loss(skip(x), y).backward()
    res['wrapped'] = (grads(model), reference([(x, y, skip.last.applied)]), int(skip.last.kept),
                      [type(t).__name__ for t in cached_traces(model)])

    # 2) a module that holds a CAPSkip, wrapped by DDP
    class Holder(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net, self.skip = net, capskip.CAPSkip(net, budget=0.3, mode='reuse')
        def forward(self, x): return self.skip(x)
    holder = Holder(copy.deepcopy(base))
    wrapped = DDP(holder)
    holder.skip.loss(wrapped(x), y).backward()
    res['holder'] = (grads(holder.net), reference([(x, y, holder.skip.last.applied)]), int(holder.skip.last.kept),
                     [type(t).__name__ for t in cached_traces(holder.net)])

    # 3) accumulation: the first micro-batch under no_sync, the second synchronises both
    model = copy.deepcopy(base)
    ddp = DDP(model)
    skip = capskip.CAPSkip(ddp, budget=0.3, mode='reuse')
    parts = []
    with ddp.no_sync():
        skip.loss(skip(x[:32]), y[:32], denominator=64).backward()
        parts.append((x[:32], y[:32], skip.last.applied))
    skip.loss(skip(x[32:]), y[32:], denominator=64).backward()
    parts.append((x[32:], y[32:], skip.last.applied))
    res['accumulated'] = (grads(model), reference(parts), 0, [])

    # 4) a CAPSkip built on a module that is later wrapped, then called around the wrapper
    bypassed = copy.deepcopy(base)
    skip = capskip.CAPSkip(bypassed, budget=0.3)
    DDP(bypassed)
    try:
        skip(x); res['bypass'] = 'no error'
    except RuntimeError as err:
        res['bypass'] = str(err)
    # 5) the staged node (its gradients handed over in stages) under DDP's options, at the second step (DDP rebuilds
    #    its buckets after the first; static_graph's first step only counts the hooks)
    for name, options in (('find_unused', dict(find_unused_parameters=True)), ('static_graph', dict(static_graph=True)),
                          ('bucket_view', dict(gradient_as_bucket_view=True))):
        model = copy.deepcopy(base)
        ddp = DDP(model, bucket_cap_mb=0.005, **options)
        skip = capskip.CAPSkip(ddp, budget=0.3, mode='reuse')
        for _ in range(2):
            ddp.zero_grad(set_to_none=True)
            logits = skip(x)
            skip.loss(logits, y).backward()
        res[name] = (grads(model), reference([(x, y, skip.last.applied)]), int(skip.last.kept),
                     [type(t).__name__ for t in cached_traces(model)], graph_nodes(logits))

    # 6) overlap: the share of the gradient still to be produced when DDP launches its first bucket
    import capskip.engine.reuse as reuse_module
    from capskip.bench.ddp import FirstBucket
    stages, left = reuse_module.STAGES, {}
    for case, mode, n in (('dense', 'dense', stages), ('reuse', 'reuse', stages), ('one stage', 'reuse', 1)):
        reuse_module.STAGES = n                                   # 1: every gradient returned at once (the control)
        ddp = DDP(copy.deepcopy(base), bucket_cap_mb=0.005)
        first, skip = FirstBucket(ddp), capskip.CAPSkip(ddp, budget=0.3, mode=mode)
        for _ in range(2):
            logits = skip(x)
            first.arm(logits)
            skip.loss(logits, y).backward()
            ddp.zero_grad(set_to_none=True)
        left[case] = first.left
    reuse_module.STAGES = stages
    res['left'] = left
    torch.save(res, f'{out}/rank{r}.pt')
    dist.close()
''')


@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    return rank_results(tmp_path_factory.mktemp('ddp_autograd'), WORKER)


def relative(got: dict, ref: dict) -> float:
    top = max(float(r.norm()) for r in ref.values())
    return max(float((got[n] - r).norm()) / max(float(r.norm()), 1e-3 * top) for n, r in ref.items())


@pytest.mark.parametrize('case', ('wrapped', 'holder', 'accumulated', 'find_unused', 'static_graph', 'bucket_view'))
def test_reuse_under_ddp_equals_the_ranks_average_of_autograd(ranks, case):
    (g0, ref0, kept0, traces0), (g1, ref1, kept1, _) = ranks[0][case][:4], ranks[1][case][:4]
    for name in g0: assert torch.equal(g0[name], g1[name]), name           # identical on every rank
    assert relative(g0, ref0) <= 1e-5, relative(g0, ref0)
    if case != 'accumulated':
        assert 0 < kept0 < 64 and 0 < kept1 < 64, 'rows must be skipped for the check to mean anything'
        assert traces0 and set(traces0) == {'Traced'}                      # reuse traced, no fallback reason


def test_a_forward_around_the_wrapper_is_refused(ranks):
    for rank in ranks:
        assert 'not inside DistributedDataParallel' in rank['bypass'] and 'CAPSkip(DDP(model))' in rank['bypass']


def test_the_staged_backward_lets_the_first_bucket_leave_early(ranks):
    """DDP launches its first bucket while most of reuse's gradient is still to be produced, as with plain autograd;
    the same node in one stage (every gradient returned at once: the control) leaves nothing to overlap."""
    for rank in ranks:
        left = rank['left']
        assert left['one stage'] == 0.0, left
        assert left['reuse'] >= 0.5 and left['dense'] >= 0.5, left
    for case in ('find_unused', 'static_graph', 'bucket_view'):           # the options above ran several stages
        assert ranks[0][case][4].count('SkipStageBackward') >= 2, ranks[0][case][4]
