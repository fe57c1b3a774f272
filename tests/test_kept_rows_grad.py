"""The kept rows' upstream gradient alone ([kept, L, V]): `Engine.backward` takes it, `Engine.loss_backward` builds it for
sequence rows, and reuse's backward then creates no tensor of the logits' full [B, L, V] shape. Gradients equal those
from every row's gradient in every mode; a hook on the logits still sees every row's gradient; a second gradient added
to the logits' on the way is placed, not lost."""
import pytest
import torch

from capskip.bench.sequence import WidthLM, token_batch
from capskip.engine import Engine
from capskip.engine.facade import sequence_grad_logits
from capskip.testing import grad_errors, model_grads
from capskip.testing.oracles import LargestMade   # the largest tensor an op allocates (views do not count)

B, L, V = 4, 8, 300
KEEP = torch.tensor([True, False, True, False])
ROWS = KEEP.nonzero().squeeze(1)


def lm():
    torch.manual_seed(0)
    return WidthLM(layers=1, d=16, vocab=V, heads=2, max_len=L, features=False)


def grads_after(mode, backward):
    "The model's gradients after `backward(engine, fwd, x, y)` on a fresh engine of `mode`."
    model = lm()
    engine = Engine(model, mode)
    x, y = token_batch(B, L, V, seed=3)
    backward(engine, engine.forward(x), y)
    got = model_grads(model)
    engine.close()
    return got


def every_row(engine, fwd, y): engine.backward(fwd, sequence_grad_logits(fwd.logits, y, KEEP.float()), KEEP)
def kept_alone(engine, fwd, y): engine.backward(fwd, sequence_grad_logits(fwd.logits, y, KEEP.float(), rows=ROWS), KEEP)


@pytest.mark.parametrize('mode', ['dense', 'masked', 'reforward', 'reuse'])
def test_the_kept_rows_gradient_alone_gives_every_rows_result(mode):
    ref = grads_after(mode, every_row)
    for backward in (kept_alone, lambda e, f, y: e.loss_backward(f, y, KEEP.float())):
        top, rel = grad_errors(grads_after(mode, backward), ref)
        assert top < 1e-6 and rel < 1e-6, (mode, top, rel)
    assert max(float(g.abs().max()) for g in ref.values()) > 0


def test_reuse_backward_builds_no_tensor_of_every_rows_logits():
    model = lm()
    engine = Engine(model, 'reuse')
    x, y = token_batch(B, L, V, seed=3)
    fwd = engine.forward(x)
    grad = sequence_grad_logits(fwd.logits, y, KEEP.float(), rows=ROWS)
    with LargestMade() as seen: engine.backward(fwd, grad, KEEP)
    assert 2 * L * V <= seen.largest < B * L * V   # the largest tensor made is the kept rows' [2, L, V] size
    fwd = engine.forward(x)                                             # the control: a hook on the logits
    hooked = []
    fwd.logits.register_hook(lambda g: hooked.append(g.clone()))
    grad = sequence_grad_logits(fwd.logits, y, KEEP.float(), rows=ROWS)
    with LargestMade() as seen: engine.backward(fwd, grad, KEEP)
    assert seen.largest >= B * L * V                                    # the hook was given every row's gradient
    torch.testing.assert_close(hooked[0][ROWS], grad, rtol=0, atol=0)
    assert float(hooked[0][~KEEP].abs().max()) == 0.0
    engine.close()


def test_a_gradient_added_on_the_way_is_placed_not_lost():
    extra = torch.zeros(B, L, V)
    extra[1, 2, 5] = 0.25                                               # a second loss on a dropped row's logits
    keep_all = KEEP.clone(); keep_all[1] = True
    def with_extra(engine, fwd, y):
        engine.backward(fwd, sequence_grad_logits(fwd.logits, y, KEEP.float(), rows=ROWS), KEEP, extra=((fwd.logits, extra),))
    def reference(engine, fwd, y):
        engine.backward(fwd, sequence_grad_logits(fwd.logits, y, KEEP.float()) + extra, keep_all)
    top, rel = grad_errors(grads_after('reuse', with_extra), grads_after('dense', reference))
    assert top < 1e-6 and rel < 1e-6, (top, rel)
    top, _ = grad_errors(grads_after('reuse', kept_alone), grads_after('dense', reference))
    assert top > 1e-3                                                   # the control: without the extra the gradients differ


def test_a_wrong_shape_names_both_accepted_shapes():
    model = lm()
    engine = Engine(model, 'reuse')
    x, y = token_batch(B, L, V, seed=3)
    fwd = engine.forward(x)
    with pytest.raises(ValueError, match=r'grad_logits must have the logits shape \(4, 8, 300\) \(every row\) or \(2, 8, 300\)'):
        engine.backward(fwd, torch.zeros(3, L, V), KEEP)
    engine.close()


def test_capskip_step_on_sequences_builds_the_kept_rows_gradient_only(monkeypatch):
    "CAPSkip.step on a causal LM: the same gradients as skip.loss(skip(x), y).backward(), through Engine.loss_backward's kept rows."
    import capskip.engine.executors as executors
    from capskip import CAPSkip
    handed = []
    real = executors.hand_over
    monkeypatch.setattr(executors, 'hand_over', lambda node, logits, g, keep, kept: handed.append(tuple(g.shape)) or real(node, logits, g, keep, kept))
    x, y = token_batch(B, L, V, seed=3)
    w = KEEP.float()                                                    # rows 1 and 3 weigh 0: not kept
    got = {}
    for path in ('step', 'loss'):
        model = lm()
        skip = CAPSkip(model, mode='reuse', budget=0.0)
        if path == 'step': stats = skip.step(x, y, weights=w)
        else: skip.loss(skip(x), y, weights=w).backward()
        got[path] = model_grads(model)
        skip.close()
    assert stats.kept == 2 and handed == [(2, L, V)]
    top, rel = grad_errors(got['step'], got['loss'])
    assert top < 1e-6 and rel < 1e-6, (top, rel)


@pytest.mark.parametrize('pass_elements', [1 << 21, 3 * 50 + 7])   # one chunk; chunks of 3 tokens that end inside rows
def test_sequence_grad_logits_is_float64_autograds_on_wide_logits_without_subnormals(monkeypatch, pass_elements):
    """The softmax runs in place, chunk by chunk, with exponents clamped at `exp_floor`: on float32 logits spread like an
    initialised LM's (std 28, most of each row's far tail under e^-87) the result is float64 autograd's gradient of the
    same loss (relative to its largest entry), no entry is subnormal, and the caller's logits are left as they were,
    also when they are a non-contiguous slice (a causal LM's shifted logits)."""
    import capskip.engine.facade as facade
    monkeypatch.setattr(facade, '_PASS_ELEMENTS', pass_elements)
    g = torch.Generator().manual_seed(7)
    full = torch.randn(3, 6, 50, generator=g) * 28.0
    z = full[:, :-1]                                                       # [3, 5, 50], not contiguous
    y = torch.randint(0, 50, (3, 5), generator=g); y[0, :2] = -100; y[2] = -100
    w = torch.tensor([1.0, 0.5, 2.0])
    before = full.clone()
    for rows in (None, torch.tensor([0, 1])):
        got = sequence_grad_logits(z, y, w, rows=rows)
        z64 = z.detach().double().requires_grad_(True)
        tok = torch.nn.functional.cross_entropy(z64.reshape(-1, 50), y.reshape(-1), reduction='none').view(3, 5)
        ((tok.sum(1) * w.double()).sum() / (y != -100).sum()).backward()
        ref = z64.grad if rows is None else z64.grad.index_select(0, rows)
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-6
        nonzero = got[got != 0].abs()
        assert float(nonzero.min()) >= torch.finfo(torch.float32).tiny     # no subnormal entry
        assert (ref.abs() < 1e-40).any()                                   # the reference's far tail is (sub)normal-small: the clamp was needed
    assert torch.equal(full, before)


def plain_grads(loss_of):
    "The model's gradients from plain autograd of `loss_of(logits, y)` (the reference: no engine, F.cross_entropy)."
    model = lm()
    x, y = token_batch(B, L, V, seed=3)
    loss_of(model(x), y).backward()
    return model_grads(model)


def weighted_ce(logits, y, w=KEEP.float()):
    "(1/N) Σ_i w_i Σ_t CE(z_it, y_it), N the batch's labelled tokens: what skip.loss returns at budget 0."
    tok = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction='none', ignore_index=-100).view(B, L)
    return (tok.sum(1) * w).sum() / (y != -100).sum()


def aux_loss(logits):
    "A second term on every row's logits (a z-loss), so dropped rows get a gradient from it."
    return 1e-3 * torch.logsumexp(logits, -1).square().mean()


SKIP_LOSSES = {                                  # (skip.loss → what is back-propagated, the same on plain logits)
    'loss': (lambda loss, z: loss, lambda z, y: weighted_ce(z, y)),
    'scaled': (lambda loss, z: loss * 3.0, lambda z, y: 3.0 * weighted_ce(z, y)),       # GradScaler, accumulation
    'plus a z-loss': (lambda loss, z: loss + aux_loss(z), lambda z, y: weighted_ce(z, y) + aux_loss(z)),
}


@pytest.mark.parametrize('name', list(SKIP_LOSSES))
@pytest.mark.parametrize('mode', ['reuse', 'reforward', 'masked'])
def test_skip_loss_backward_on_sequences_is_plain_autograds_gradient(mode, name):
    "`skip.loss(skip(x), y)` then `.backward()` (sequence_loss's SequenceCE node): the gradient of plain autograd's loss."
    from capskip import CAPSkip
    of_loss, reference = SKIP_LOSSES[name]
    model = lm()
    skip = CAPSkip(model, mode=mode, budget=0.0)
    x, y = token_batch(B, L, V, seed=3)
    logits = skip(x)
    of_loss(skip.loss(logits, y, weights=KEEP.float()), logits).backward()
    ref = plain_grads(reference)
    top, rel = grad_errors(model_grads(model), ref)
    assert top < 1e-5 and rel < 1e-5, (mode, name, top, rel)
    top, _ = grad_errors(model_grads(model), plain_grads(lambda z, y: weighted_ce(z, y, torch.ones(B))))
    assert top > 1e-3                                                   # the control: every row's gradient differs
    skip.close()


def test_skip_loss_backward_on_sequences_builds_no_tensor_of_every_rows_logits():
    "In reuse, `skip.loss(...).backward()` hands the node the kept rows' [2, L, V] gradient alone; a hook on the logits still sees every row's."
    from capskip import CAPSkip
    x, y = token_batch(B, L, V, seed=3)
    skip = CAPSkip(lm(), mode='reuse', budget=0.0)
    logits = skip(x)
    loss = skip.loss(logits, y, weights=KEEP.float())
    with LargestMade() as seen: loss.backward()
    assert 2 * L * V <= seen.largest < B * L * V
    logits, hooked = skip(x), []
    logits.register_hook(lambda g: hooked.append(g.clone()))
    loss = skip.loss(logits, y, weights=KEEP.float())
    with LargestMade() as seen: loss.backward()
    assert seen.largest >= B * L * V and hooked[0].shape == (B, L, V)  # the hook was given every row's gradient
    assert float(hooked[0][~KEEP].abs().max()) == 0.0 and float(hooked[0][KEEP].abs().max()) > 0
    dense = CAPSkip(lm(), mode='dense', budget=0.0)                     # the control: dense back-propagates every row
    logits = dense(x)
    loss = dense.loss(logits, y, weights=KEEP.float())
    with LargestMade() as seen: loss.backward()
    assert seen.largest >= B * L * V
    skip.close(); dense.close()


@pytest.mark.parametrize('mode', ['reuse', 'reforward', 'masked'])
def test_skip_loss_backward_on_bf16_logits_hands_the_node_a_gradient_of_their_dtype(mode):
    "A bf16 model's logits: `skip.loss(...).backward()` hands reuse's and reforward's node bf16 kept rows (float32 crashed its matmuls; masked has no node: every row) and gives `skip.step`'s gradients."
    import capskip.steps as steps
    from capskip import CAPSkip
    x, y = token_batch(B, L, V, seed=3)
    handed, real = [], steps.hand_over
    got = {}
    for path in ('step', 'loss', 'every row'):
        model = lm().to(torch.bfloat16)
        skip = CAPSkip(model, mode=mode, budget=0.0)
        w = torch.ones(B) if path == 'every row' else KEEP.float()
        if path == 'step': skip.step(x, y, weights=w)
        else:
            steps.hand_over = lambda node, logits, g, keep, kept: handed.append((tuple(g.shape), g.dtype)) or real(node, logits, g, keep, kept)
            try: skip.loss(skip(x), y, weights=w).backward()
            finally: steps.hand_over = real
        got[path] = {k: g.double() for k, g in model_grads(model).items()}
        skip.close()
    assert handed == ([] if mode == 'masked' else [((2, L, V), torch.bfloat16)])   # the kept rows, in the logits' dtype; every row: no hand-over
    top, rel = grad_errors(got['loss'], got['step'])
    assert top < 2e-2 and rel < 2e-2, (mode, top, rel)                  # bf16 round-off at most
    assert grad_errors(got['every row'], got['step'])[0] > 0.1          # the control: every row's gradient differs


def test_two_skip_losses_on_the_same_logits_add_up():
    "`skip.loss(z, y, w1) + skip.loss(z, y, w2)`: the node takes one hand-over, the second loss gives every row's gradient (a second hand-over replaced the first: a wrong gradient)."
    from capskip import CAPSkip
    x, y = token_batch(B, L, V, seed=3)
    other = torch.tensor([1.0, 1.0, 0.0, 0.0])
    model = lm()
    skip = CAPSkip(model, mode='reuse', budget=0.0)
    logits = skip(x)
    (skip.loss(logits, y, weights=KEEP.float()) + skip.loss(logits, y, weights=other)).backward()
    top, rel = grad_errors(model_grads(model), plain_grads(lambda z, y: weighted_ce(z, y) + weighted_ce(z, y, other)))
    assert top < 1e-5 and rel < 1e-5, (top, rel)
    skip.close()


@pytest.mark.parametrize('mode', ['reuse', 'reforward', 'masked'])
def test_autograd_grad_of_skip_loss_gives_the_logits_gradient_not_the_nodes_stand_in(mode):
    "`torch.autograd.grad(skip.loss(z, y), ...)` captures the logits' gradient: every row's (the node's stand-in, a zero of their shape, was returned before), and the parameters' with it; a plain backward of the same loss afterwards gets no rows left over from it (they were added twice)."
    from capskip import CAPSkip
    x, y = token_batch(B, L, V, seed=3)
    ref = plain_grads(weighted_ce)
    model = lm()
    skip = CAPSkip(model, mode=mode, budget=0.0)
    logits = skip(x)
    zr = logits.detach().clone().requires_grad_()
    want, = torch.autograd.grad(weighted_ce(zr, y), zr)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    got = torch.autograd.grad(skip.loss(logits, y, weights=KEEP.float()), [logits] + [p for _, p in named])
    assert float((got[0] - want).abs().max()) <= 1e-6 * float(want.abs().max()), mode
    top, rel = grad_errors({n: g for (n, _), g in zip(named, got[1:])}, ref)
    assert top < 1e-5 and rel < 1e-5, (mode, top, rel)
    logits = skip(x)
    loss = skip.loss(logits, y, weights=KEEP.float())
    alone, = torch.autograd.grad(loss, logits, retain_graph=True)      # the node does not run: the logits' gradient only
    assert float((alone - want).abs().max()) <= 1e-6 * float(want.abs().max()), mode
    loss.backward()
    top, rel = grad_errors(model_grads(model), ref)
    assert top < 1e-5 and rel < 1e-5, (mode, top, rel)
    skip.close()


def test_skip_loss_backward_with_inputs_gets_every_parameters_gradient():
    "`loss.backward(inputs=params)` (the backward need not accumulate into every leaf): every row's gradient, no hand-over, plain autograd's result."
    import capskip.steps as steps
    from capskip import CAPSkip
    x, y = token_batch(B, L, V, seed=3)
    model = lm()
    skip = CAPSkip(model, mode='reuse', budget=0.0)
    handed, real = [], steps.hand_over
    steps.hand_over = lambda *a: handed.append(1) or real(*a)
    try:
        skip.loss(skip(x), y, weights=KEEP.float()).backward(inputs=[p for p in model.parameters() if p.requires_grad])
        assert handed == []
        top, rel = grad_errors(model_grads(model), plain_grads(weighted_ce))
        assert top < 1e-5 and rel < 1e-5, (top, rel)
        model.zero_grad(set_to_none=True)
        skip.loss(skip(x), y, weights=KEEP.float()).backward()           # the control: a plain backward hands over
        assert handed == [1]
    finally: steps.hand_over = real
    skip.close()
