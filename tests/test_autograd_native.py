"""The skip inside autograd (issue: "The skipping happens inside `loss.backward()`"): the loss-shaped API, tensor and
post-accumulate hooks, GradScaler, gradient accumulation, the one host read of a step, and refusals — each checked
against plain autograd of the kept rows with the zero-gradient-safe metric (`capskip.engine.check.grad_errors`)."""
import contextlib
import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import capskip
from capskip.engine.check import grad_errors, model_grads
from capskip.engine.reuse import cached_traces
from capskip.testing import digits_tensors, trained_digits_mlp

MODES = ('masked', 'reforward', 'reuse')
DEVICE = torch.device(os.environ.get('CAPSKIP_TEST_DEVICE', 'cpu'))     # tools/gpu_check.py runs this file on cuda


def gn_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.GroupNorm(2, 8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).to(DEVICE)


def batch(g, n=8):
    "A random [n, 3, 8, 8] batch and labels from the CPU generator `g`, on the test device."
    return torch.randn(n, 3, 8, 8, generator=g).to(DEVICE), torch.randint(0, 5, (n,), generator=g).to(DEVICE)


@pytest.fixture(scope='module')
def digits():
    X, Y, _, _ = digits_tensors()
    return trained_digits_mlp().to(DEVICE), X[:64].to(DEVICE), Y[:64].to(DEVICE)


def reference(model, x, y, applied, hooks=(), scale=1.0, denominator=None):
    "Plain autograd of (scale/den) Σ applied_i CE on a copy of `model`, with `hooks(copy)` installed first."
    twin = copy.deepcopy(model)
    twin.zero_grad(set_to_none=True)
    for hook in hooks: hook(twin)
    losses = F.cross_entropy(twin(x), y, reduction='none') * applied
    (losses.sum() / (len(y) if denominator is None else denominator) * scale).backward()
    return model_grads(twin)


@pytest.mark.parametrize('mode', MODES)
def test_loss_api_is_the_kept_rows_autograd_gradient(digits, mode):
    model, x, y = digits
    model = copy.deepcopy(model)
    skip = capskip.CAPSkip(model, budget=0.3, mode=mode)
    logits = skip(x)
    loss = skip.loss(logits, y)
    loss.backward()
    stats = skip.last
    kept = int(stats.kept)
    assert 0 < kept < len(y), 'the trained model must drop some rows for this test to mean anything'
    worst, overall = grad_errors(model_grads(model), reference(model, x, y, stats.applied))
    assert worst <= 1e-5 and overall <= 1e-5, (mode, worst, overall)
    if mode != 'masked':
        assert type(logits.grad_fn).__name__ == 'SkipBackwardBackward'              # the skipping node, not plain autograd
        assert skip.engine.executor.mode == mode
    if mode == 'reuse': assert {type(t).__name__ for t in cached_traces(model)} == {'Traced'}   # no fallback reason
    assert skip.counters()['rows_backprop'] == kept


@pytest.mark.parametrize('mode', MODES)
def test_a_tensor_hook_on_a_weight_is_honoured_once(mode):
    model, g = gn_cnn(), torch.Generator().manual_seed(1)
    x, y = batch(g)
    w = torch.tensor([0., 1., 0., 1., 1., 0., 1., 1.], device=DEVICE)
    mask = (torch.rand(model[3].weight.shape, generator=g) > 0.5).float().to(DEVICE)   # pruning-style gradient mask
    calls = []
    def install(m):
        m[3].weight.register_hook(lambda grad: calls.append(1) or grad * mask)
        m[0].weight.register_hook(lambda grad: grad * 2.0)                       # not idempotent: a second call shows
    ref = reference(model, x, y, w, hooks=[install])
    calls.clear()
    install(model)
    engine = capskip.Engine(model, mode=mode)
    engine.loss_backward(engine.forward(x), y, row_weights=w)
    worst, overall = grad_errors(model_grads(model), ref)
    assert worst <= 1e-5 and overall <= 1e-5, (mode, worst)
    assert calls == [1]
    assert float(model[3].weight.grad[mask == 0].abs().max()) == 0.0


@pytest.mark.parametrize('mode', ('reforward', 'reuse'))
def test_post_accumulate_hooks_see_the_skipped_backwards_gradient(digits, mode):
    model, x, y = digits
    model = copy.deepcopy(model)
    seen = {}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: seen.__setitem__(n, p.grad.clone()))
    skip = capskip.CAPSkip(model, budget=0.3, mode=mode)
    skip.loss(skip(x), y).backward()
    assert set(seen) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters(): torch.testing.assert_close(seen[n], p.grad)


@pytest.mark.parametrize('mode', ('reforward', 'reuse'))
def test_grad_scaler_with_fp16_autocast_steps_like_plain_autograd(mode):
    model = gn_cnn()
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    x, y = batch(g)
    w = torch.tensor([1., 0., 1., 0., 1., 1., 0., 1.], device=DEVICE)
    outs = []
    for net, skipping in ((model, True), (twin, False)):
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0 ** 10)
        engine = capskip.Engine(net, mode=mode if skipping else 'masked')
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            fwd = engine.forward(x)
            loss = (F.cross_entropy(fwd.logits.float(), y, reduction='none') * w).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        outs.append(model_grads(net))
        scaler.step(opt); scaler.update()
        assert scaler.get_scale() > 0
    worst, _ = grad_errors(outs[0], outs[1])
    assert worst <= 1e-3, worst                                           # fp16 forward on both sides
    for a, b in zip(model.parameters(), twin.parameters()): torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize('mode', ('reforward', 'reuse'))
def test_gradient_accumulation_by_loss_division(digits, mode):
    model, x, y = digits
    model = copy.deepcopy(model)
    skip = capskip.CAPSkip(model, budget=0.3, mode=mode)
    applied = []
    for part in (slice(0, 32), slice(32, 64)):
        (skip.loss(skip(x[part]), y[part]) / 2).backward()
        applied.append(skip.last.applied)
    ref = reference(model, x, y, torch.cat(applied), denominator=32 * 2)      # each micro-batch normalised by 32
    worst, overall = grad_errors(model_grads(model), ref)
    assert worst <= 1e-5 and overall <= 1e-5


class HostReads(TorchDispatchMode):
    "Counts the ops that read a device value back to the host."
    def __init__(self): super().__init__(); self.reads = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ('_local_scalar_dense', 'item', 'nonzero', 'is_nonzero', 'equal'): self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('mode', ('reforward', 'reuse'))
def test_the_backward_reads_the_kept_count_once(digits, mode):
    model, x, y = digits
    model = copy.deepcopy(model)
    skip = capskip.CAPSkip(model, budget=0.3, mode=mode)
    skip.loss(skip(x), y).backward()                                       # first step: trace and probe
    loss = skip.loss(skip(x), y)
    with HostReads() as counted: loss.backward()
    assert counted.reads == ['_local_scalar_dense'], counted.reads
    engine = skip.engine                                                   # the engine's own step: its read is the only one
    fwd = engine.forward(x)
    with HostReads() as counted: engine.loss_backward(fwd, y, row_weights=(torch.arange(64, device=DEVICE) % 3 > 0).float())
    assert counted.reads == ['_local_scalar_dense'], counted.reads


def test_a_det_lastfix_gradient_goes_through_autograd(digits):
    model, x, y = digits
    model = copy.deepcopy(model)
    seen = []
    head = model[-1] if isinstance(model, nn.Sequential) else capskip.Engine(model).head
    head.weight.register_hook(lambda g: seen.append(g.clone()))
    skip = capskip.CAPSkip(model, budget=0.3, reweight='det_lastfix')
    skip.loss(skip(x), y).backward()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], head.weight.grad)
    dense_head = reference(model, x, y, torch.ones(64, device=DEVICE))                   # det_lastfix: the head gets the dense gradient
    name = next(n for n, p in model.named_parameters() if p is head.weight)
    torch.testing.assert_close(head.weight.grad, dense_head[name], atol=1e-6, rtol=1e-4)


def test_refusals_name_the_problem(digits):
    model, x, y = digits
    skip = capskip.CAPSkip(copy.deepcopy(model), budget=0.3)
    with pytest.raises(ValueError, match='logits that skip\\(x\\) returned'):
        skip.loss(skip.model(x), y)
    logits = skip(x)
    loss = skip.loss(logits.float(), y)                                   # a cast of the logits is fine
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match='already back-propagated'):
        loss.backward()
    with pytest.raises(ValueError, match='computes no gradient for the input'):
        skip(x.clone().requires_grad_())


def test_int32_labels_and_a_compiled_module_object(digits):
    model, x, y = digits
    grads = []
    for labels in (y, y.int(), y.to(torch.uint8)):
        net = copy.deepcopy(model)
        skip = capskip.CAPSkip(net, budget=0.3, mode='reforward')
        skip.loss(skip(x), labels).backward()
        grads.append(model_grads(net))
    for other in grads[1:]:
        for name in grads[0]: assert torch.equal(other[name], grads[0][name]), name   # same step whatever the label dtype
    compiled = torch.compile(copy.deepcopy(model))
    engine = capskip.Engine(compiled, mode='masked')
    assert engine.model is compiled._orig_mod and engine.compile


@pytest.mark.parametrize('path', ('loss', 'step'))
def test_ignored_labels_and_a_temperature_follow_cross_entropy(digits, path):
    "Rows labelled -100 are never kept and leave the denominator (as in F.cross_entropy); the loss is CE(z / T)."
    model, x, y = digits
    model = copy.deepcopy(model)
    y = y.clone(); y[::5] = -100
    skip = capskip.CAPSkip(model, budget=0.3, mode='reuse', temperature=2.0)
    if path == 'loss': skip.loss(skip(x), y).backward()
    else: skip.step(x, y)
    applied = skip.last.applied
    assert float(applied[::5].abs().max()) == 0.0 and int((applied > 0).sum()) < int((y != -100).sum())
    twin = copy.deepcopy(model); twin.zero_grad(set_to_none=True)
    per_row = F.cross_entropy(twin(x) / 2.0, y, reduction='none')            # -100 rows give 0 here
    (per_row * applied).sum().div(int((y != -100).sum())).backward()
    worst, overall = grad_errors(model_grads(model), model_grads(twin))
    assert worst <= 1e-5 and overall <= 1e-5, (path, worst)
    with pytest.raises(ValueError, match='temperature must be a number > 0'):
        capskip.CAPSkip(model, temperature=0)


def hook_calls(model, x, y, applied, where, run) -> list:
    "The modules (by position in `model.modules()`) whose full backward hook ran during `run()`, a hook on the head or a global one."
    order = {id(m): i for i, m in enumerate(model.modules())}
    calls = []
    head = capskip.Engine(model).head
    hook = (head.register_full_backward_hook(lambda m, gi, go: calls.append(order[id(m)])) if where == 'head' else
            nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: calls.append(order.get(id(m)))))
    try: run()
    finally: hook.remove()
    return sorted(calls)


@pytest.mark.parametrize('where', ['head', 'every module'])
@pytest.mark.parametrize('mode', MODES)
def test_a_module_full_backward_hook_runs_as_in_autograd(digits, mode, where):
    "A full backward hook on the head (or a global one on every module) wraps the head's output in BackwardHookFunction: the head check refused it in every mode ('followed by backwardhookfunction'); now it is the identity it is. The probe's backwards set module hooks aside: each hook runs as often as in plain autograd."
    model, x, y = digits
    model, twin = copy.deepcopy(model), copy.deepcopy(model)
    skip = capskip.CAPSkip(model, budget=0.3, mode=mode)
    def step():
        with pytest.warns() if mode == 'reuse' else contextlib.nullcontext():   # reuse: dynamo does not trace the hook, reforward runs
            skip.loss(skip(x), y).backward()
    got = hook_calls(model, x, y, None, where, step)
    stats = skip.last
    assert 0 < int(stats.kept) < len(y)
    def plain(): (F.cross_entropy(twin(x), y, reduction='none') * stats.applied).sum().div(len(y)).backward()
    want = hook_calls(twin, x, y, None, where, plain)
    assert got == want and want, (got, want)
    worst, overall = grad_errors(model_grads(model), model_grads(twin))
    assert worst <= 1e-5 and overall <= 1e-5, (mode, where, worst, overall)
