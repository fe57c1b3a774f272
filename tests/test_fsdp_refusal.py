"""FSDP on 2 real gloo CPU processes, one launch (capskip.engine.facade: `fsdp_refusal`, `Engine._fsdp2_forward`).
FSDP2 (`fully_shard` on each block and on the model) runs: `CAPSkip(model)` in `reuse`, `masked` and `reforward`
leaves on every rank the sharded (`DTensor`) gradient whose full tensor is, in float64, the ranks' average of each
rank's plain-autograd gradient of its kept rows (DDP's reference, tests/test_ddp_autograd.py), reduce-scattered by
FSDP2's own post-backward; controls (each rank's unreduced gradient, every row kept) differ. Sequence rows too (a
float64 `tiny_gpt`, -100 on padding, `reuse`): each rank normalises by its own labelled tokens N_r (`sequence_loss`'s
default), so the gradient is (1/W) Σ_r (1/N_r) Σ_kept Σ_t ∇CE, not the global-N one (Σ_r Σ_kept / Σ_r N_r). Refused by name, whatever
`ddp_check` says: FSDP1 (`FullyShardedDataParallel`) as the wrapper passed in or applied afterwards, `fully_shard` on
a submodule only, and a model sharded after `CAPSkip`/`Engine` was built (refused at its first forward). Two more ways users shard: under a
bf16 `MixedPrecisionPolicy` (parameters gathered in bf16, gradients reduced in float32) every mode gives plain FSDP2's
gradient of the kept rows, to bf16's own distance from the float64 gradient; under accumulation with
`set_requires_gradient_sync(False)` on the first micro-batch, the float64 sum of the micro-batches' gradients, as plain
FSDP2 accumulates them (the fused step missed this by 3e-8 while it rounded a float64 model's residuals and weights to
float32)."""
import textwrap

import pytest

from test_ddp import rank_results

WORKER = textwrap.dedent('''
    import copy, sys, warnings
    import torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1, fully_shard
    from torch.distributed.tensor import DTensor
    import capskip
    from capskip.engine import Engine
    from capskip.engine.check import grad_errors
    from capskip.engine.reuse import cached_traces
    from capskip.runs.distributed import init_distributed
    from capskip.runs.models import tiny_gpt
    from capskip.testing import sequence_grads

    out = sys.argv[1]
    dist = init_distributed('cpu')
    r, W = dist.rank, dist.world_size
    mesh = init_device_mesh('cpu', (W,))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(r))
    fsdp1 = lambda m, **kw: FSDP1(m, device_id=torch.device('cpu'), **kw)

    def refusal(build, call=False):
        "The message of the error building (and, with call, calling) a CAPSkip/Engine; 'no error' if there is none."
        try:
            skip = build()
            if call: skip(x) if isinstance(skip, capskip.CAPSkip) else skip.forward(x)
            return 'no error'
        except Exception as err:
            return f'{type(err).__name__}: {err}'

    res = {}
    def fsdp2(root=True):
        m = copy.deepcopy(base); fully_shard(m[0], mesh=mesh)
        if root: fully_shard(m, mesh=mesh)
        return m
    for check in (True, False):                              # the user's door, CAPSkip, with and without ddp_check
        res[f'fsdp2 capskip ddp_check={check}'] = refusal(lambda: capskip.CAPSkip(fsdp2(), ddp_check=check), call=check)
        res[f'fsdp1 capskip ddp_check={check}'] = refusal(lambda: capskip.CAPSkip(fsdp1(copy.deepcopy(base)), ddp_check=check))
        def later(shard, check=check):
            m = copy.deepcopy(base); skip = capskip.CAPSkip(m, ddp_check=check); shard(m); return skip
        res[f'fsdp2 later ddp_check={check}'] = refusal(lambda: later(lambda m: fully_shard(m, mesh=mesh)), call=True)
        res[f'fsdp1 later use_orig_params={check} ddp_check={check}'] = refusal(   # both FSDP1 parameter layouts
            lambda: later(lambda m: fsdp1(m, use_orig_params=check)), call=True)
    res['fsdp2 submodule ddp_check=False'] = refusal(lambda: capskip.CAPSkip(fsdp2(root=False), ddp_check=False))
    res['fsdp2 engine ddp_check=False'] = refusal(lambda: Engine(fsdp2(), 'masked', ddp_check=False), call=True)
    res['fsdp1 engine ddp_check=False'] = refusal(lambda: Engine(fsdp1(copy.deepcopy(base)), 'reforward', ddp_check=False))
    # control: with FSDP imported and a process group up, an unsharded model is not taken for FSDP
    res['plain ddp_check=False'] = refusal(lambda: capskip.CAPSkip(copy.deepcopy(base), ddp_check=False), call=True)

    # FSDP2 gradients: residual LayerNorm-MLP blocks, each block sharded, then the model (float64)
    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        def forward(self, h): return h + self.fc2(F.gelu(self.fc1(self.norm(h))))
    class Net(nn.Module):
        def __init__(self, d=8):
            super().__init__()
            self.embed, self.blocks, self.head = nn.Linear(6, d), nn.Sequential(Block(d), Block(d)), nn.Linear(d, 4)
        def forward(self, x): return self.head(self.blocks(self.embed(x)))
    torch.manual_seed(0)
    net, B = Net().double(), 16
    g = torch.Generator().manual_seed(r)                     # each rank its own batch
    xs = torch.randn(B, 6, generator=g, dtype=torch.float64)
    with torch.no_grad(): ys = net(xs).argmax(1)             # rows the model gets right: candidates to drop ...
    ys[:4] = torch.randint(0, 4, (4,), generator=g)          # ... and four that may not be

    def reference(twin, w, reduce=True):
        "Plain autograd of (1/B) Σ w_i CE on this rank's rows; with reduce, its mean over the ranks (DDP's all-reduce)."
        twin.zero_grad(set_to_none=True)
        (F.cross_entropy(twin(xs), ys, reduction='none') * w).sum().div(B).backward()
        ref = {n: p.grad.detach().clone() for n, p in twin.named_parameters()}
        for v in ref.values():
            if reduce: tdist.all_reduce(v); v /= W
        return ref

    def sharded():
        "As users shard: each block, then the model (the root: its own group holds embed and head)."
        m = copy.deepcopy(net)
        for block in m.blocks: fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter('always')
        for mode in ('reuse', 'masked', 'reforward'):
            m, twin = sharded(), copy.deepcopy(net)
            opt, opt_ref = torch.optim.SGD(m.parameters(), lr=0.5), torch.optim.SGD(twin.parameters(), lr=0.5)
            skip = capskip.CAPSkip(m, budget=0.3, mode=mode)
            for step in range(2 if mode == 'reuse' else 1):  # the second step after an optimizer step on the shards
                opt.zero_grad(set_to_none=True)
                if step == 0: skip.step(xs, ys)
                else: skip.loss(skip(xs), ys).backward()
                w = skip.last.applied.double()
                got = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
                ref = reference(twin, w)
                res[f'{mode} step {step}'] = dict(
                    kept=int(skip.last.kept), err=grad_errors(got, ref),
                    unreduced=grad_errors(got, reference(twin, w, reduce=False)),
                    every_row=grad_errors(got, reference(twin, torch.ones(B))),
                    dtensor=all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in m.parameters()),
                    traces=[type(t).__name__ for t in cached_traces(m)])
                for n, p in twin.named_parameters(): p.grad = ref[n]
                opt.step(); opt_ref.step()

        # sequence rows: a float64 causal LM (tiny_gpt: each block, then the model, sharded), -100 on right padding
        torch.manual_seed(0)
        lm, V, L = tiny_gpt(num_classes=32, dim=16, depth=1, heads=2, max_len=8, dtype='float64'), 32, 8
        ids = torch.randint(1, V, (B, L), generator=g)                 # each rank its own sequences and lengths
        lengths = torch.randint(2, L + 1, (B,), generator=g)
        toks = torch.where(torch.arange(L)[None] < lengths[:, None], ids, -100)
        toks = torch.cat([toks[:, 1:], torch.full_like(toks[:, :1], -100)], 1)   # aligned: position t labelled t + 1
        def lm_reference(w, reduce=True, global_n=False):
            "Plain autograd of (1/N_r) Σ_i w_i Σ_t CE (N_r: this rank's labelled tokens); reduce: the ranks' mean; global_n: Σ_r ... / Σ_r N_r instead."
            count = (toks != -100).sum().double()
            if global_n: tdist.all_reduce(count)             # with the ranks' mean below: Σ_r Σ_i w_i Σ_t CE / Σ_r N_r
            ref = sequence_grads(lm, {'input_ids': ids}, toks, w, denominator=float(count) / W if global_n else None)
            for v in ref.values():
                if reduce: tdist.all_reduce(v); v /= W
            return ref
        m = copy.deepcopy(lm)
        for block in m.blocks: fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
        skip = capskip.CAPSkip(m, budget=0.5, mode='reuse')
        for step in range(2):                                    # skip.step, then skip(...) + skip.loss(...).backward()
            m.zero_grad(set_to_none=True)
            if step == 0: skip.step(ids, toks)
            else: skip.loss(skip(ids), toks).backward()
            w = skip.last.applied.double()
            got = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
            res[f'lm step {step}'] = dict(
                kept=int(skip.last.kept), err=grad_errors(got, lm_reference(w)),
                unreduced=grad_errors(got, lm_reference(w, reduce=False)),
                every_row=grad_errors(got, lm_reference(torch.ones(B, dtype=torch.float64))),
                global_n=grad_errors(got, lm_reference(w, global_n=True)),
                dtensor=all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in m.parameters()),
                traces=[type(t).__name__ for t in cached_traces(m)])
            ids = torch.roll(ids, 1, 1)                          # a second batch: the ids rolled, the same labels
    # bf16 mixed precision (float32 parameters gathered in bf16, gradients reduced in float32), then accumulation
    # without sync on the first micro-batch (float64), on the residual blocks above
    from torch.distributed.fsdp import MixedPrecisionPolicy
    def sharded_from(base, **kw):
        m = copy.deepcopy(base)
        for block in m.blocks: fully_shard(block, mesh=mesh, **kw)
        fully_shard(m, mesh=mesh, **kw)
        return m
    def exact(x, y, w, reduce=True):
        "float64 plain autograd of (1/B) Σ w_i CE on this rank's rows x, y; with reduce, the ranks' mean."
        twin = copy.deepcopy(net)
        (F.cross_entropy(twin(x.double()), y, reduction='none') * w.double()).sum().div(B).backward()
        ref = {n: p.grad.detach().clone() for n, p in twin.named_parameters()}
        for v in ref.values():
            if reduce: tdist.all_reduce(v); v /= W
        return ref
    net32, mp = copy.deepcopy(net).float(), MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for mode in ('reuse', 'masked', 'reforward'):
        m, plain = sharded_from(net32, mp_policy=mp), sharded_from(net32, mp_policy=mp)
        skip = capskip.CAPSkip(m, budget=0.3, mode=mode)
        skip.loss(skip(xs.float()), ys).backward()
        w = skip.last.applied.float()
        got = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        (F.cross_entropy(plain(xs.float()).float(), ys, reduction='none') * w).sum().div(B).backward()   # plain FSDP2
        ref = {n: p.grad.full_tensor() for n, p in plain.named_parameters()}
        res[f'mp {mode}'] = dict(kept=int(skip.last.kept), err=grad_errors(got, ref), bf16=grad_errors(ref, exact(xs, ys, w)),
                                 every_row=grad_errors(got, exact(xs, ys, torch.ones(B))),
                                 dtypes=sorted({str(p.grad.dtype) for p in m.parameters()}))
    xs2 = torch.randn(B, 6, generator=g, dtype=torch.float64)
    with torch.no_grad(): ys2 = net(xs2).argmax(1)
    ys2[:4] = torch.randint(0, 4, (4,), generator=g)
    batches = [(xs, ys), (xs2, ys2)]
    for mode in ('reuse', 'masked'):
        m, plain = sharded_from(net), sharded_from(net)
        skip, ws = capskip.CAPSkip(m, budget=0.3, mode=mode), []
        for i, (x, y) in enumerate(batches):             # no sync on the first micro-batch, as with accumulation
            m.set_requires_gradient_sync(i == 1); plain.set_requires_gradient_sync(i == 1)
            if i == 0: skip.loss(skip(x), y).backward()
            else: skip.step(x, y)
            ws.append(skip.last.applied.double())
            (F.cross_entropy(plain(x), y, reduction='none') * ws[-1]).sum().div(B).backward()   # plain FSDP2, the same
        got = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        fsdp = {n: p.grad.full_tensor() for n, p in plain.named_parameters()}
        refs = [exact(x, y, w) for (x, y), w in zip(batches, ws)]
        both = {n: refs[0][n] + refs[1][n] for n in refs[0]}
        res[f'accum {mode}'] = dict(kept=[int((w > 0).sum()) for w in ws], err=grad_errors(got, both), plain=grad_errors(got, fsdp),
                                    plain_vs_exact=grad_errors(fsdp, both), last_only=grad_errors(got, refs[1]),
                                    every_row=grad_errors(got, exact(xs2, ys2, torch.ones(B))))
    res['warnings'] = [f'{w.category.__name__}: {w.message}' for w in seen
                       if issubclass(w.category, RuntimeWarning) or 'FSDP2' in str(w.message)]
    torch.save(res, f'{out}/rank{r}.pt')
    dist.close()
''')

GRADIENT_CASES = ('reuse step 0', 'reuse step 1', 'masked step 0', 'reforward step 0', 'lm step 0', 'lm step 1')


@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    return rank_results(tmp_path_factory.mktemp('fsdp'), WORKER)


def test_fsdp1_is_refused_by_name_whatever_ddp_check_says(ranks):
    for rank in ranks:
        refused = {k: v for k, v in rank.items() if k.startswith('fsdp1')}
        assert len(refused) == 5
        for case, message in refused.items():
            assert message.startswith('ValueError: capskip does not support FSDP1'), (case, message)
            assert 'fully_shard' in message and '\n' not in message, (case, message)
            assert 'ddp_check=False does not lift this' in message, (case, message)
        assert '(FullyShardedDataParallel)' not in rank['fsdp1 capskip ddp_check=False']
        assert 'the model is wrapped by FullyShardedDataParallel' in rank['fsdp1 capskip ddp_check=False']


def test_fsdp2_misuse_is_refused_with_its_fix(ranks):
    for rank in ranks:
        sub = rank['fsdp2 submodule ddp_check=False']             # names the sharded submodule and the fix
        assert sub.startswith('ValueError: capskip: module `0` is sharded by fully_shard (FSDPLinear) but the model is not')
        assert 'fully_shard(model)' in sub and '\n' not in sub
        for check in (True, False):                               # the class fully_shard swapped in, after the build
            later = rank[f'fsdp2 later ddp_check={check}']
            assert 'the model was sharded by fully_shard (FSDPSequential) after CAPSkip/Engine was built' in later, later
            assert 'ddp_check=False does not lift this' in later and '\n' not in later


def test_fsdp2_and_an_unsharded_model_are_not_refused(ranks):
    for rank in ranks:
        for case in ('fsdp2 capskip ddp_check=True', 'fsdp2 capskip ddp_check=False', 'fsdp2 engine ddp_check=False',
                     'plain ddp_check=False'):
            assert rank[case] == 'no error', (case, rank[case])


@pytest.mark.parametrize('case', GRADIENT_CASES)
def test_fsdp2_gradient_is_the_ranks_average_of_the_kept_rows_gradient(ranks, case):
    for rank in ranks:
        row = rank[case]
        assert 0 < row['kept'] < 16, 'rows must be skipped for the check to mean anything'
        assert row['dtensor'], 'the parameters and their gradients are FSDP2 shards (DTensor)'
        assert max(row['err']) <= 1e-12, row['err']              # float64 throughout: exact
        assert row['unreduced'][1] > 0.05 and row['every_row'][1] > 0.05, row   # controls that must differ
        if case.startswith(('reuse', 'lm')): assert row['traces'] == ['Traced'], row['traces']   # reuse, no fallback


@pytest.mark.parametrize('case', ['lm step 0', 'lm step 1'])
def test_fsdp2_sequence_rows_are_the_ranks_average_of_each_ranks_per_token_loss(ranks, case):
    "Sequence rows: each rank normalises by its own labelled tokens N_r (sequence_loss's default), FSDP2 averages the ranks."
    assert any(rank[case]['kept'] < 16 for rank in ranks)
    for rank in ranks:
        row = rank[case]
        assert max(row['err']) <= 1e-12, row['err']              # float64 throughout: exact
        assert row['global_n'][1] > 1e-3, row['global_n']        # control: Σ_r Σ_kept / Σ_r N_r is another gradient


def test_fsdp2_runs_without_fallback_or_view_warnings(ranks):
    assert [rank['warnings'] for rank in ranks] == [[], []]


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
