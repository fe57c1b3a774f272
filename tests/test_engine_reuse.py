"`reuse` mode: exact against plain autograd on ResNet-18-GN and a timm ViT with dropout/drop-path, bf16, refusals, fallbacks."
import warnings

import pytest
import torch
import torch.nn as nn

from capskip.engine import Engine, HeadCapture, RowDependenceError
from capskip.engine import _aot, reuse
from capskip.engine.check import autograd_grads, grad_errors
from test_engine import engine_grads, tiny_cnn

B = 8


def resnet18_gn():
    from capskip.runs.models import create_model
    torch.manual_seed(0)
    return create_model('resnet18_gn', num_classes=10)


def vit_tiny_dropout():
    "timm ViT-tiny width at 32 px (patch 4), 2 blocks to keep tracing short; every dropout and drop-path on."
    import timm
    torch.manual_seed(0)
    return timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32, patch_size=4, depth=2, num_classes=10,
                             drop_rate=0.1, drop_path_rate=0.2, attn_drop_rate=0.1, proj_drop_rate=0.1)


def cases():
    rows = torch.arange(B)
    w = torch.rand(B, generator=torch.Generator().manual_seed(5)) + 0.5
    return {'k=B': None, 'k=B weighted': w, 'k=5 weighted': w * (rows >= 3), 'k=2': (rows % 4 == 1).float(),
            'k=1': (rows == 6).float(), 'k=0': torch.zeros(B)}


@pytest.fixture(scope='module', params=['resnet18_gn', 'vit_tiny_dropout'])
def setup(request):
    model = {'resnet18_gn': resnet18_gn, 'vit_tiny_dropout': vit_tiny_dropout}[request.param]()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(B, 3, 32, 32, generator=g), torch.randint(0, 10, (B,), generator=g)
    return request.param, model, Engine(model, 'reuse'), x, y


def test_reuse_matches_autograd_for_every_k(setup):
    name, model, engine, x, y = setup
    for case, w in cases().items():
        ref = autograd_grads(model, x, y, w, label_smoothing=0.1, seed=7)
        kept, got = engine_grads(engine, x, y, w, ls=0.1, seed=7)     # same seed: same dropout / drop-path masks
        assert kept == (B if w is None else int((w > 0).sum())), case
        err = grad_errors(got, ref)[0]
        assert err <= 1e-5, f'{name} {case}: max rel err {err:.2e}'


def test_reuse_other_batch_sizes_with_the_same_engine(setup):
    name, model, engine, x, y = setup
    # B = 1 runs as two copies of the row (the trace assumes B >= 2): with dropout the masks differ from an eager
    # B = 1 forward, so B = 1 is compared on the deterministic model only.
    for b in ((5, 1) if name == 'resnet18_gn' else (5,)):
        w = torch.ones(b); w[0] = 0 if b > 1 else 1
        ref = autograd_grads(model, x[:b], y[:b], w, seed=2)
        kept, got = engine_grads(engine, x[:b], y[:b], w, seed=2)
        assert kept == int((w > 0).sum())
        assert grad_errors(got, ref)[0] <= 1e-5, f'{name} B={b}'


def test_reuse_releases_saved_activations(setup):
    _, model, engine, x, y = setup
    fwd = engine.forward(x)
    assert fwd.mode == 'reuse' and len(fwd.state.saved) > 0
    engine.loss_backward(fwd, y)
    assert fwd.state.saved == [] and fwd.node.state is None           # every saved activation is released
    model.zero_grad(set_to_none=True)


def test_bf16_autocast():
    "bf16 reuse is as close to the fp32 reference as bf16 masked is (selector inputs stay fp32)."
    model = vit_tiny_dropout()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, 3, 32, 32, generator=g), torch.randint(0, 10, (B,), generator=g)
    w = (torch.arange(B) >= 3).float()
    ref = autograd_grads(model, x, y, w, seed=4)
    errs = {}
    for mode in ('masked', 'reuse'):
        engine = Engine(model, mode)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(4)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            fwd = engine.forward(x)
        assert fwd.logits.dtype == torch.bfloat16
        engine.loss_backward(fwd, y, w)
        errs[mode] = grad_errors({n: p.grad for n, p in model.named_parameters()}, ref)[0]
    assert errs['masked'] < 0.1
    assert errs['reuse'] <= 2 * errs['masked'] + 1e-3, errs


class Branchy(nn.Module):
    "Data-dependent control flow (on a parameter, so rows stay independent): a graph break under fullgraph=True."
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.body(x)
        if self.body.weight.sum() > 0: h = h * 2
        return self.head(torch.tanh(h))


def test_graph_break_falls_back_to_reforward_with_a_warning():
    torch.manual_seed(0)
    model = Branchy()
    x, y = torch.randn(6, 6), torch.randint(0, 3, (6,))
    w = (torch.arange(6) > 1).float()
    ref = autograd_grads(model, x, y, w, seed=1)
    engine = Engine(model, 'reuse')
    with pytest.warns(RuntimeWarning, match='falling back to mode="reforward"'):
        kept, got = engine_grads(engine, x, y, w)
    assert kept == 4 and grad_errors(got, ref)[0] <= 1e-5
    assert engine.forward(x).mode == 'reforward'                     # remembered, no retrace


def test_private_torch_apis_are_as_expected():
    "Fails loudly when a torch upgrade moves what capskip.engine._aot relies on."
    _aot.check_private_apis()
    assert _aot.torch_version_ok(torch.__version__)
    model = tiny_cnn(p=0.2)
    x = torch.randn(4, 3, 8, 8)
    traced = _aot.trace(model, HeadCapture(model[-1]), x)
    layouts = [s[2][0] for s in traced.bw_inputs if s[0] == 'saved']
    assert 'batch' in layouts and 'static' in layouts and 'sym' in layouts
    assert traced.fallback_reason is None
    assert [s[0] for s in traced.bw_inputs].count('tangent') == 1
    assert 'take_rows' in traced.bw.code and 'args_list.clear()' in traced.bw.code
    assert sum(n is not None for n in traced.grad_names) == len(list(model.parameters()))


def test_kept_counts_across_the_conv_backend_threshold(caplog):
    "Convolution's fake kernel guards on batch >= 16 (memory format only): k < 16 after B = 20 still skips rows, exactly."
    from capskip.runs.models import create_model
    torch.manual_seed(0)
    model = create_model('digits_cnn', num_classes=10)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 1, 16, 16, generator=g), torch.randint(0, 10, (20,), generator=g)
    w = (torch.arange(20) % 3 == 0).float()
    ref = autograd_grads(model, x, y, w, seed=1)
    with caplog.at_level('WARNING', logger='capskip.engine'):
        kept, got = engine_grads(Engine(model, 'reuse'), x, y, w)
    assert kept == 7 and grad_errors(got, ref)[0] <= 1e-5
    assert not [r for r in caplog.records if 'over all' in r.getMessage()]


def digits_batch(B: int, seed: int = 0):
    from capskip.runs.models import create_model
    torch.manual_seed(0)
    model = create_model('digits_cnn', num_classes=10)
    g = torch.Generator().manual_seed(seed)
    return model, torch.randn(B, 1, 16, 16, generator=g), torch.randint(0, 10, (B,), generator=g)


def test_unsliceable_backward_runs_over_all_rows_exactly(monkeypatch, caplog):
    "When slicing is impossible (here: a seed-regenerated mask, simulated) the backward runs at full B: exact, logged."
    monkeypatch.setattr(_aot, 'seeded_backward_ops', lambda bw: ['aten.fake_attention_backward'])
    model, x, y = digits_batch(10)
    w = (torch.arange(10) < 4).float()
    ref = autograd_grads(model, x, y, w, seed=1)
    with caplog.at_level('WARNING', logger='capskip.engine'):
        kept, got = engine_grads(Engine(model, 'reuse'), x, y, w)
    assert kept == 4 and grad_errors(got, ref)[0] <= 1e-5
    assert any('cannot be sliced' in r.getMessage() for r in caplog.records)


def test_enforced_guards_retrace_forward_and_widen_backward(monkeypatch, caplog):
    "Where a graph bakes strides, guards are enforced: conv's `batch >= 16` guard then forces full-B backward / a retrace."
    monkeypatch.setattr(_aot, '_STRIDE_BAKED', {torch.ops.aten.convolution.default})
    model, x, y = digits_batch(20)
    w = (torch.arange(20) % 3 == 0).float()
    engine = Engine(model, 'reuse')
    ref = autograd_grads(model, x, y, w, seed=1)
    with caplog.at_level('WARNING', logger='capskip.engine'):
        kept, got = engine_grads(engine, x, y, w)
    assert kept == 7 and grad_errors(got, ref)[0] <= 1e-5
    assert any('runs over all rows' in r.getMessage() and '7 kept rows' in r.getMessage() for r in caplog.records)
    ref8 = autograd_grads(model, x[:8], y[:8], w[:8], seed=1)
    kept8, got8 = engine_grads(engine, x[:8], y[:8], w[:8])                 # breaks `s >= 16`: retraced
    assert kept8 == 3 and grad_errors(got8, ref8)[0] <= 1e-5
    assert len(reuse.cached_traces(model)) == 2                        # one signature, traced at B = 20 and 8
    reuse.clear_traces(model)
    assert reuse.cached_traces(model) == []


def test_graph_level_probe_refuses_without_the_eager_probe():
    "The traced-graph checks alone catch attention across the batch; a BatchNorm's buffer updates stop the trace (the eager probe, which runs first, refuses it as row-dependent)."
    from test_engine import SeqFirst, bn_cnn
    torch.manual_seed(0)
    seq, xs = SeqFirst(), torch.randn(4, 6, 16)
    traced = _aot.trace(seq, HeadCapture(seq.head), xs)
    with pytest.raises(RowDependenceError, match='self_attn'):
        _aot.probe_traced(traced, seq, xs)
    bn = bn_cnn()                           # its buffers: the eager probe refuses it first, as row-dependent
    with pytest.raises(RuntimeError, match='updates 3 buffer'):            # the trace alone: not replayable
        _aot.trace(bn, HeadCapture(bn[-1]), torch.randn(4, 3, 8, 8))


@pytest.mark.parametrize('mode', ['reforward', 'reuse'])
def test_eval_mode_batchnorm_buffers_and_a_shared_layer(mode):
    "Buffers (BatchNorm running statistics in eval mode) are graph inputs; a layer used twice gets both gradients, and keeps its own Parameters (reforward's swap to stand-ins left them in the model: gradient error 1.0, the optimizer's parameters gone)."
    from test_engine import bn_cnn
    model = bn_cnn()
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5); model[1].running_var.uniform_(0.5, 2.0)
    model[1].eval()                                                   # fixed statistics: rows independent
    shared = nn.Linear(5, 5)
    full = nn.Sequential(model, shared, nn.Tanh(), shared, nn.Linear(5, 3))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
    w = (torch.arange(6) % 2 == 0).float()
    ref = autograd_grads(full, x, y, w, seed=1)
    owned = [id(p) for p in full.parameters()]
    kept, got = engine_grads(Engine(full, mode), x, y, w)
    assert kept == 3 and grad_errors(got, ref)[0] <= 1e-5
    assert [id(p) for p in full.parameters()] == owned


def test_views_of_one_storage_are_gathered_once_and_exactly():
    "A ViT saves q, k, v (views of one projection) and its attention output twice: each storage's kept rows are copied once."
    import timm
    from capskip.engine.gathers import rows_view
    torch.manual_seed(0)
    model = timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=10,
                              drop_path_rate=0.1, proj_drop_rate=0.1)          # no attention dropout: the backward is sliced
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, 3, 32, 32, generator=g), torch.randint(0, 10, (B,), generator=g)
    engine = Engine(model, 'reuse')
    for w in ((torch.arange(B) % 3 == 0).float(), (torch.arange(B) >= 2).float()):
        ref = autograd_grads(model, x, y, w, seed=3)
        kept, got = engine_grads(engine, x, y, w, seed=3)
        assert kept == int(w.sum()) and grad_errors(got, ref)[0] <= 1e-5
    plans = [p for p in engine.executor.grouped.values() if p]
    assert len(plans) == 1
    traced, graph, groups = plans[0]
    assert len(groups) == 2 * 2                                      # per block: q/k/v, and the attention output pair
    assert sum(n.target is rows_view for n in graph.graph.nodes) == 2 * (3 + 2)
    fwd = engine.forward(x)
    total, once = reuse.saved_bytes(fwd.state, 4)
    _, per_view = reuse.saved_bytes(fwd.state, 4, grouped=False)
    assert 0 < once <= total / 2 < per_view     # per view, the duplicated attention output was copied twice
    fwd.state = None


@pytest.mark.parametrize('make', [
    lambda: torch.randn(8, 4, 3, 3),
    lambda: torch.randn(8, 4, 3, 3).contiguous(memory_format=torch.channels_last),
    lambda: torch.randn(8, 1, 1, 6).permute(0, 3, 1, 2),      # [B, C, 1, 1] with channels-last strides: is_contiguous() too
    lambda: torch.randn(8, 1, 6).transpose(1, 2),              # [B, C, 1] from a transpose
    lambda: torch.randn(8, 5, 6)])
def test_take_rows_keeps_the_saved_values_strides(make):
    "Kernels pick their path from strides (oneDNN's depthwise backward ran 9x slower on an NCHW copy of a channels-last [B, C, 1, 1] value)."
    t, idx = make(), torch.tensor([6, 1, 3])
    got = _aot.take_rows(t, 0, idx)
    assert got.stride() == t.stride(), (t.stride(), got.stride())
    assert torch.equal(got, t.index_select(0, idx))


def test_take_rows_where_the_rows_are_not_outermost():
    t = torch.randn(6, 8).t()                                  # rows innermost
    idx = torch.tensor([0, 7, 2])
    got = _aot.take_rows(t, 0, idx)
    assert got.stride() == (1, 3) and torch.equal(got, t.index_select(0, idx))
    u = torch.randn(4, 8, 3).transpose(0, 1)                   # rows in dim 0, dim 1 outermost in memory
    got = _aot.take_rows(u, 0, idx)
    assert got.stride() == (3, 9, 1) and torch.equal(got, u.index_select(0, idx))   # still dim 1 outermost


def test_reuse_backward_accumulates_into_existing_grads_without_aliasing():
    "Two sliced backwards add up in .grad (the first sets it, the second adds in place), and no .grad is shared."
    model = tiny_cnn()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(B, 3, 8, 8, generator=g), torch.randint(0, 5, (B,), generator=g)
    w = (torch.arange(B) % 3 != 0).float()                       # k = 5 of 8: the sliced graph
    ref = autograd_grads(model, x, y, w, denominator=B)
    engine = Engine(model, 'reuse')
    model.zero_grad(set_to_none=True)
    for _ in range(2): engine.loss_backward(engine.forward(x), y, w)
    got = {n: p.grad / 2 for n, p in model.named_parameters()}
    errs = grad_errors(got, ref)
    assert errs[0] <= 1e-5, errs
    ptrs = [p.grad.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(ptrs)) == len(ptrs)


def test_reuse_on_a_channels_last_model_matches_autograd():
    "A channels-last model's saved values are gathered into their own stride order (take_rows' out= copy) and give autograd's gradient."
    model = tiny_cnn().to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 5, (B,), generator=g)
    w = (torch.arange(B) % 3 != 1).float()
    ref = autograd_grads(model, x, y, w, denominator=B)
    engine = Engine(model, 'reuse')
    fwd = engine.forward(x)
    strided = [t for t in fwd.state.saved if isinstance(t, torch.Tensor) and t.ndim == 4 and not t.is_contiguous()]
    assert strided                                               # the gathers below take the strided path
    model.zero_grad(set_to_none=True)
    engine.loss_backward(fwd, y, w)
    errs = grad_errors({n: p.grad for n, p in model.named_parameters()}, ref)
    assert errs[0] <= 1e-5, errs
    assert all(p.grad.stride() == p.stride() for p in model.parameters())   # autograd's layout contract: .grad as the parameter


def test_take_rows_of_a_value_that_requires_grad():
    "Outside the no-grad backward (a user's own call), a value that requires grad is copied without out= (autograd refuses it) and stays differentiable."
    t = torch.randn(8, 1, 1, 6, requires_grad=True)
    v = t.permute(0, 3, 1, 2)                                  # channels-last [B, C, 1, 1]: the strided path
    got = _aot.take_rows(v, 0, torch.tensor([6, 1, 3]))
    assert got.stride() == v.stride() and torch.equal(got, v.index_select(0, torch.tensor([6, 1, 3])))
    got.sum().backward()
    assert t.grad.sum() == 3 * 6



@pytest.mark.parametrize('stages', [8, 1])
def test_reuse_hands_its_gradients_to_autograd_without_a_copy(monkeypatch, stages):
    "AccumulateGrad takes a gradient as .grad without cloning it only when nothing else holds it: no frame of the staged backward may keep one (they did: most were cloned, +1 gradient-sized copy per stage)."
    model = tiny_cnn()
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(B, 3, 8, 8, generator=g), torch.randint(0, 5, (B,), generator=g)
    w = (torch.arange(B) % 3 != 0).float()                       # k = 5 of 8: the sliced graph
    produced = set()
    def spy(fn):
        def run(*args):
            grads = fn(*args)
            produced.update(t.data_ptr() for t in grads if t is not None)   # addresses only: no reference kept
            return grads
        return run
    monkeypatch.setattr(reuse, 'STAGES', stages)
    monkeypatch.setattr(reuse, '_stage_aligned', spy(reuse._stage_aligned))
    monkeypatch.setattr(reuse, '_aligned', spy(reuse._aligned))
    engine = Engine(model, 'reuse')
    model.zero_grad(set_to_none=True)
    engine.loss_backward(engine.forward(x), y, w)
    staged = [key for key in engine.executor.staged if len(key[2]) > 1]
    assert bool(staged) == (stages > 1)                          # 8: the backward ran in stages (its plan is cached)
    params = [p for p in model.parameters()]
    assert all(p.grad is not None for p in params)
    assert all(p.grad.data_ptr() in produced for p in params), sum(p.grad.data_ptr() in produced for p in params)
    ref = autograd_grads(model, x, y, w, denominator=B)
    assert grad_errors({n: p.grad for n, p in model.named_parameters()}, ref)[0] <= 1e-5
