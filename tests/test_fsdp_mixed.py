"""FSDP2 beyond float32 and one micro-batch, on 2 real gloo CPU processes, one launch: `CAPSkip` on a model sharded
with a bf16 `MixedPrecisionPolicy` (parameters gathered in bf16, gradients reduced in float32) gives the gradient plain
FSDP2 autograd gives on the kept rows, to bf16's own distance from the float64 gradient; gradient accumulation with
`set_requires_gradient_sync(False)` on all but the last micro-batch gives, in float64, the ranks' mean of the
micro-batches' summed kept-row gradients, as plain FSDP2 accumulates them (controls: the last micro-batch alone,
every row kept). The fused step missed this by 3e-8 while it rounded a float64 model's residuals and weights to float32."""
import textwrap

import pytest

from test_ddp import rank_results

WORKER = textwrap.dedent('''
    import copy, sys
    import torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import capskip
    from capskip.engine.check import grad_errors
    from capskip.runs.distributed import init_distributed

    out = sys.argv[1]
    dist = init_distributed('cpu')
    r, W = dist.rank, dist.world_size
    mesh = init_device_mesh('cpu', (W,))

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        def forward(self, h): return h + self.fc2(F.gelu(self.fc1(self.norm(h))))
    class Net(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.embed, self.blocks, self.head = nn.Linear(6, d), nn.Sequential(Block(d), Block(d)), nn.Linear(d, 4)
        def forward(self, x): return self.head(self.blocks(self.embed(x)))
    torch.manual_seed(0)
    net, B = Net(), 16
    g = torch.Generator().manual_seed(r)                     # each rank its own micro-batches
    batches = []
    for _ in range(2):
        xs = torch.randn(B, 6, generator=g)
        with torch.no_grad(): ys = net(xs).argmax(1)         # rows the model gets right: candidates to drop ...
        ys[:4] = torch.randint(0, 4, (4,), generator=g)      # ... and four that may not be
        batches.append((xs, ys))

    def sharded(base, **kw):
        "As users shard: each block, then the model."
        m = copy.deepcopy(base)
        for block in m.blocks: fully_shard(block, mesh=mesh, **kw)
        fully_shard(m, mesh=mesh, **kw)
        return m

    def exact(base, xs, ys, w, reduce=True):
        "float64 plain autograd of (1/B) Σ w_i CE on this rank's rows; with reduce, the ranks' mean."
        twin = copy.deepcopy(base).double()
        (F.cross_entropy(twin(xs.double()), ys, reduction='none') * w.double()).sum().div(B).backward()
        ref = {n: p.grad.detach().clone() for n, p in twin.named_parameters()}
        for v in ref.values():
            if reduce: tdist.all_reduce(v); v /= W
        return ref

    res = {}
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    xs, ys = batches[0]
    for mode in ('reuse', 'masked', 'reforward'):
        m, plain = sharded(net, mp_policy=mp), sharded(net, mp_policy=mp)
        skip = capskip.CAPSkip(m, budget=0.3, mode=mode)
        skip.loss(skip(xs), ys).backward()
        w = skip.last.applied.float()
        got = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        (F.cross_entropy(plain(xs).float(), ys, reduction='none') * w).sum().div(B).backward()   # plain FSDP2, same policy
        ref = {n: p.grad.full_tensor() for n, p in plain.named_parameters()}
        res[f'mp {mode}'] = dict(kept=int(skip.last.kept), err=grad_errors(got, ref),
                                 bf16=grad_errors(ref, exact(net, xs, ys, w)),
                                 every_row=grad_errors(got, exact(net, xs, ys, torch.ones(B))),
                                 dtypes=sorted({str(p.grad.dtype) for p in m.parameters()}))
    net64 = copy.deepcopy(net).double()
    for mode in ('reuse', 'masked'):
        m = sharded(net64)
        skip = capskip.CAPSkip(m, budget=0.3, mode=mode)
        ws = []
        for i, (xs, ys) in enumerate(batches):             # no sync on the first micro-batch, as with accumulation
            m.set_requires_gradient_sync(i == len(batches) - 1)
            if i == 0: skip.loss(skip(xs.double()), ys).backward()
            else: skip.step(xs.double(), ys)
            ws.append(skip.last.applied.double())
        got = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        refs = [exact(net64, xs, ys, w) for (xs, ys), w in zip(batches, ws)]
        plain = sharded(net64)
        for i, ((xs, ys), w) in enumerate(zip(batches, ws)):  # plain FSDP2 autograd, the same accumulation
            plain.set_requires_gradient_sync(i == len(batches) - 1)
            (F.cross_entropy(plain(xs.double()), ys, reduction='none') * w).sum().div(B).backward()
        fsdp = {n: p.grad.full_tensor() for n, p in plain.named_parameters()}
        res[f'accum {mode}'] = dict(kept=[int((w > 0).sum()) for w in ws], err=grad_errors(got, {n: refs[0][n] + refs[1][n] for n in refs[0]}),
                                    plain=grad_errors(got, fsdp), plain_vs_exact=grad_errors(fsdp, {n: refs[0][n] + refs[1][n] for n in refs[0]}),
                                    last_only=grad_errors(got, refs[1]),
                                    every_row=grad_errors(got, exact(net64, *batches[1], torch.ones(B))))
    torch.save(res, f'{out}/rank{r}.pt')
    dist.close()
''')


@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    return rank_results(tmp_path_factory.mktemp('fsdp_mixed'), WORKER)


@pytest.mark.parametrize('mode', ['reuse', 'masked', 'reforward'])
def test_bf16_mixed_precision_matches_plain_fsdp2_to_bf16_rounding(ranks, mode):
    for rank in ranks:
        case = rank[f'mp {mode}']
        assert 0 < case['kept'] < 16, case                       # some rows dropped, some kept
        assert case['dtypes'] == ['torch.float32'], case          # the sharded gradient stays in the parameters' dtype
        bf16 = max(case['bf16'])                                  # plain bf16 FSDP2 against the float64 gradient
        assert 1e-4 < bf16 < 0.1, case                            # bf16 rounds: a visible, bounded error
        assert max(case['err']) <= 2 * bf16, case                 # capskip is no further from plain FSDP2 than bf16 itself
        assert min(case['every_row']) > 10 * bf16, case           # the control: every row kept is far off


@pytest.mark.parametrize('mode', ['reuse', 'masked'])
def test_accumulation_without_sync_sums_the_micro_batches(ranks, mode):
    for rank in ranks:
        case = rank[f'accum {mode}']
        assert all(0 < k < 16 for k in case['kept']), case
        assert max(case['err']) <= 1e-12 and max(case['plain']) <= 1e-12, case   # the float64 sum, and plain FSDP2's accumulation
        assert max(case['plain_vs_exact']) <= 1e-12, case                       # the reference is FSDP2's own result
        assert min(case['last_only']) > 1e-3 and min(case['every_row']) > 1e-3, case   # the controls differ
