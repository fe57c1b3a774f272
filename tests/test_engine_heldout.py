"Held-out cases of `reuse`/`reforward`: eval-mode attention-bias caches (timm), a forward that branches on the batch size, a shape guard that forces an all-rows backward, a backward whose real strides differ from its fake kernels' (Doge's gate)."
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from capskip.engine import Engine, RowDependenceError
from capskip.engine.check import grad_errors, model_grads
from capskip.engine.probe import RowProbe, cleared_caches, param_caches, unreached_error
from capskip.engine.reuse import cached_traces

TOL = 1e-4   # fp32 engines agree with autograd to ~1e-6 on these models; a missed parameter is 0.03-0.8 off


def reference(model, x, y, w):
    "Plain autograd of (1/B) Σ w_i CE(z_i, y_i) on a copy of `model`, its value caches emptied (computed from the parameters)."
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    with cleared_caches(ref):
        z = ref(x)
        (F.cross_entropy(z, y, reduction='none') * w).sum().div(len(y)).backward()
    return z.detach(), model_grads(ref)


def engine_step(engine, x, y, w):
    engine.model.zero_grad(set_to_none=True)
    fwd = engine.forward(x)
    engine.loss_backward(fwd, y, w)
    return fwd, model_grads(engine.model)


def batch(b, shape, classes, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn((b,) + shape, generator=g), torch.randint(0, classes, (b,), generator=g)
    return x, y, (torch.arange(b) % 3 != 0).float()


# --- 1. eval-mode attention-bias caches -----------------------------------------------------------------------------

TIMM_CACHED = {   # smallest configs that keep each architecture's cached attention biases, at tiny images
    'tiny_vit': ('tiny_vit_5m_224', dict(embed_dims=(8, 16, 16, 16), depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1),
                                        window_sizes=(2, 2, 2, 2)), 64),
    'efficientformerv2': ('efficientformerv2_s0', dict(distillation=False, depths=(1, 1, 1, 1), embed_dims=(8, 16, 24, 32),
                                                      img_size=64), 64),
    'levit': ('levit_128s', dict(distilled=False, img_size=32, embed_dim=(16, 32, 48), key_dim=8, num_heads=(1, 2, 3),
                                 depth=(1, 1, 1)), 32),
}


@pytest.mark.parametrize('name', list(TIMM_CACHED))
@pytest.mark.parametrize('mode', ['reforward', 'reuse'])
def test_eval_mode_attention_bias_cache_is_exact(name, mode):
    "Two steps in eval mode after an inference forward filled the caches: every parameter gets its gradient."
    timm = pytest.importorskip('timm')
    arch, kw, px = TIMM_CACHED[name]
    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, num_classes=4, **kw).eval().double()   # float64: no round-off
    caches = param_caches(model)
    assert caches and all(a == 'attention_bias_cache' for _, a in caches)
    with torch.no_grad():                                 # zero-initialised biases would hide a missing gradient
        for n, p in model.named_parameters():
            if 'attention_biases' in n: p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        model(torch.randn(2, 3, px, px, dtype=torch.float64))   # an inference forward fills the caches
    assert any(getattr(m, a) for m, a in caches)
    plain, engine = Engine(copy.deepcopy(model), 'masked'), Engine(model, mode)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')                   # reuse: the cache stores are extra traced outputs, it falls back
        for step in range(2):                             # the second step starts from caches the first one left
            x, y, w = batch(6, (3, px, px), 4, seed=step)
            x = x.double()
            z, ref = reference(model, x, y, w)
            _, masked = engine_step(plain, x, y, w)       # plain autograd over every row, dropped rows weighted 0
            fwd, got = engine_step(engine, x, y, w)
            torch.testing.assert_close(fwd.logits.detach(), z)
            worst, total = grad_errors(got, masked)
            assert worst <= 1e-9 and total <= 1e-9, f'{name} {mode} step {step}: {worst:.2e} / {total:.2e}'
            assert grad_errors(got, ref)[0] <= 1e-3       # a missed parameter is 1.0 off (here 3e-4: masked is too)
            assert any(float(got[n].abs().max()) > 0 for n in got if 'attention_biases' in n)   # some are 0 in LeViT, in masked too
    assert all(not getattr(m, a) for m, a in caches)      # nothing computed from a stand-in outlives the step
    assert fwd.mode in ('reuse', 'reforward')


class Stale(nn.Module):
    "A cache capskip does not recognise by name: a table indexed from a parameter and kept in a list."
    def __init__(self):
        super().__init__()
        self.table, self.kept = nn.Parameter(torch.randn(5)), []
    def forward(self, x):
        if not self.kept: self.kept.append(self.table[[0, 2, 4]])
        return x + self.kept[0]


@pytest.mark.parametrize('mode', ['reforward', 'reuse'])
def test_unrecognised_cache_is_refused_in_one_line(mode):
    torch.manual_seed(0)
    model = nn.Sequential(Stale(), nn.Linear(3, 2))
    with torch.no_grad(): model(torch.randn(2, 3))
    engine = Engine(model, mode)
    x, y, w = batch(6, (3,), 2, seed=0)
    with pytest.raises(ValueError) as info, warnings.catch_warnings():
        warnings.simplefilter('ignore')
        engine_step(engine, x, y, w)
    msg = str(info.value)
    assert '\n' not in msg and '0.table' in msg and '0.kept' in msg and 'mode="masked"' in msg
    assert unreached_error(model, [], mode, {}) is None


# --- 2. a forward that branches on the batch size ---------------------------------------------------------------------

class BatchBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 3)
    def forward(self, x):
        h = torch.tanh(self.a(x)) if x.shape[0] > 16 else torch.relu(self.b(x)) * 2
        return self.head(h)


@pytest.mark.parametrize('mode', ['reforward', 'reuse'])
def test_batch_size_branch_exact_or_refused_at_every_batch_size(mode):
    torch.manual_seed(0)
    model = BatchBranch()
    engine = Engine(model, mode)
    for step, b in enumerate((16, 24, 16)):
        x, y, w = batch(b, (6,), 3, seed=step)
        z, ref = reference(model, x, y, w)
        if b == 24:                                       # 12 rows or 2 rows run alone take the other branch
            with pytest.raises(RowDependenceError) as info: engine_step(engine, x, y, w)
            assert info.value.cause == 'batch_size' and 'whole batch of 24' in str(info.value)
            assert '\n' not in str(info.value)
            continue
        fwd, got = engine_step(engine, x, y, w)
        torch.testing.assert_close(fwd.logits.detach(), z)
        worst, total = grad_errors(got, ref)
        assert worst <= TOL and total <= TOL, f'{mode} B={b}: {worst:.2e}'
    if mode == 'reuse':
        traced = [t for t in cached_traces(model) if not isinstance(t, str)]
        assert len(traced) == 1 and [str(g) for g in traced[0].guards] == [f'{traced[0].batch} <= 16']


def test_probe_verdict_is_keyed_by_batch_size():
    torch.manual_seed(0)
    probe = RowProbe(BatchBranch())
    probe.check(torch.randn(16, 6))
    with pytest.raises(RowDependenceError): probe.check(torch.randn(24, 6))
    with pytest.raises(RowDependenceError, match='rows 14-15 run alone'):  # a threshold below B/2: two rows alone cross it
        RowProbe(Threshold(5)).check(torch.randn(16, 6))
    assert len(probe.passed) == 1


class Threshold(BatchBranch):
    def __init__(self, t):
        super().__init__(); self.t = t
    def forward(self, x):
        return self.head(torch.tanh(self.a(x)) if x.shape[0] > self.t else torch.relu(self.b(x)))


# --- 3. a shape guard that forces an all-rows backward ----------------------------------------------------------------

class Strided(nn.Module):
    "A convolution whose output is viewed through `as_strided`: the graph bakes strides, so convolution's layout guard is kept."
    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3), nn.Linear(4 * 6 * 6, 3)
    def forward(self, x):
        h = self.conv(x)
        return self.head(torch.relu(h.as_strided(h.shape, h.stride())).flatten(1))


def test_guard_all_rows_backward_is_warned_and_recorded():
    "Traced at 16 rows, the graph carries convolution's CPU layout guard s >= 16: 6 kept rows run all rows, said once and recorded."
    from capskip.policies import create_policy
    torch.manual_seed(0)
    model = Strided()
    engine = Engine(model, 'reuse')
    x, y, _ = batch(16, (3, 8, 8), 3, seed=0)
    w = torch.zeros(16); w[:6] = 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        fwd, got = engine_step(engine, x, y, w)
        fwd2, _ = engine_step(engine, x, y, w)
    traced = [t for t in cached_traces(model) if not isinstance(t, str)]
    assert fwd.mode == 'reuse' and len(traced) == 1
    assert [str(g) for g in traced[0].guards] == [f'{traced[0].batch} >= 16']
    said = [str(c.message) for c in caught if 'runs over all rows' in str(c.message)]
    assert len(said) == 1 and '>= 16' in said[0] and '6 kept rows' in said[0] and '\n' not in said[0]
    assert fwd.all_rows and fwd2.all_rows
    _, ref = reference(model, x, y, w)
    worst, total = grad_errors(got, ref)
    assert worst <= TOL and total <= TOL
    fwd3, _ = engine_step(engine, x, y, torch.ones(16))   # every row kept: nothing skipped, nothing lost
    assert not fwd3.all_rows
    policy = create_policy('capskip', model, mode='reuse', budget=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        stats = policy.step(x, y, torch.arange(16))
    assert stats.all_rows == (0 < int(stats.kept) < 16)


class DtGate(nn.Module):
    "Doge's dynamic gate (transformers' DogeForCausalLM): exp(A·softplus(dt(x))) per token and head, used transposed. The CPU kernel of softplus_backward lays its output out like the transposed gradient, its fake kernel contiguously, so the traced backward's next view failed on the real strides."
    def __init__(self, d=8, heads=2, L=6, C=5):
        super().__init__()
        self.dt, self.A, self.v, self.fc = nn.Linear(d, heads), nn.Parameter(torch.randn(heads)), nn.Linear(d, heads), nn.Linear(heads * L, C)

    def forward(self, x):
        gate = torch.exp(self.A * F.softplus(self.dt(x))).transpose(-1, -2)
        return self.fc((gate * self.v(x).transpose(-1, -2)).flatten(1))


def gate_case(w=(1, 1, 1, 0, 1, 0)):
    "A float64 DtGate, a batch of 6 rows, the row weights `w`, and float64 autograd's gradients of (1/B) Σ w_i CE."
    torch.manual_seed(0)
    model = DtGate().double()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 6, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (6,), generator=g)
    w = torch.tensor(w, dtype=torch.float64)
    return model, x, y, w, reference(model, x, y, w)[1]


@pytest.mark.parametrize('keep', ['some', 'all', 'one'])
@pytest.mark.parametrize('mode', ['reuse', 'reforward'])
def test_a_backward_whose_real_strides_differ_from_the_trace_is_exact(mode, keep):
    model, x, y, w, ref = gate_case({'some': [1, 1, 1, 0, 1, 0], 'all': [1] * 6, 'one': [0, 0, 1, 0, 0, 0]}[keep])
    engine = Engine(model, mode)
    _, got = engine_step(engine, x, y, w)
    top, rel = grad_errors(got, ref)
    assert top < 1e-12 and rel < 1e-12, (top, rel)
    engine.close()


def test_a_traced_backward_that_fails_at_run_time_says_so_in_one_line_and_the_repeated_step_is_exact(monkeypatch):
    "The safety net under the fix above: with views_as_reshapes undone, DtGate's traced backward fails again; the error says what to do, and the repeated step runs reforward, exactly."
    import capskip.engine._aot as aot
    monkeypatch.setattr(aot, 'views_as_reshapes', lambda gm: 0)
    model, x, y, w, ref = gate_case()
    engine = Engine(model, 'reuse')
    with pytest.raises(RuntimeError) as err:
        engine_step(engine, x, y, w)
    msg = str(err.value)
    assert '\n' not in msg and 'traced backward failed at run time' in msg and 'view size is not compatible' in msg
    assert 'zero them and repeat the step' in msg and 'mode="reforward"' in msg
    fwd, got = engine_step(engine, x, y, w)                              # repeated: reforward, exact
    assert fwd.mode == 'reforward'
    top, rel = grad_errors(got, ref)
    assert top < 1e-12 and rel < 1e-12, (top, rel)
    assert isinstance(cached_traces(model)[0], str)
    engine.close()


def test_a_traced_forward_that_fails_at_run_time_runs_the_fallback_with_a_warning(monkeypatch):
    import capskip.engine.reuse as reuse
    def boom(*args): raise RuntimeError('a kernel the trace did not foresee')
    monkeypatch.setattr(reuse, 'run_forward', boom)
    model, x, y, w, ref = gate_case()
    engine = Engine(model, 'reuse')
    with pytest.warns(RuntimeWarning, match=r'traced forward failed at run time \(RuntimeError: a kernel the trace did not foresee\)'):
        fwd, got = engine_step(engine, x, y, w)
    assert fwd.mode == 'reforward'
    top, rel = grad_errors(got, ref)
    assert top < 1e-12 and rel < 1e-12, (top, rel)
    with warnings.catch_warnings():
        warnings.simplefilter('error')                                   # said once: the next step falls back quietly
        assert engine_step(engine, x, y, w)[0].mode == 'reforward'
    engine.close()
