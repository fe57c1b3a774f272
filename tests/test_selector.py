"""Property tests of `capskip.selector` against the float64 oracle `select_reference` (hypothesis), plus the
engineering checks: no host read (compiled-graph audit and meta device), bf16/fp16 inputs, edge cases, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st
from torch._dynamo.backends.common import aot_autograd

from capskip.selector import (Selection, first_violation, last_layer_grad, magnitude_budget, residuals, select,
                              select_reference)
from capskip.testing.oracles import host_reads, per_row_grads, realised_distortion, roundoff_tol, selector_disagreement
from capskip.testing.oracles import traced_ops as _traced_ops

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- helpers (float64, materialised)
def disagreement(sel, R, H, correct, budget, weights=None, bias=True, eps=1e-12):
    "The shared oracle comparison (capskip.testing): 'equal', 'boundary' (within fp32 round-off), or AssertionError."
    return selector_disagreement(sel, R, H, correct, budget, weights, bias, eps)


def make_batch(kind, B, C, d, seed, scale, p_correct, weighted):
    "A seeded batch of one of four kinds; cancelling/colinear ones have feasible sets that are not downward closed."
    gen = torch.Generator().manual_seed(seed)
    if kind == 'softmax':            # realistic residuals softmax(z) − onehot
        logits = scale * torch.randn(B, C, generator=gen)
        labels = torch.where(torch.rand(B, generator=gen) < p_correct, logits.argmax(1), torch.randint(0, C, (B,), generator=gen))
        R, correct = residuals(logits, labels), logits.argmax(1) == labels
        H = torch.randn(B, d, generator=gen) * scale
    elif kind == 'gaussian':
        R, H = torch.randn(B, C, generator=gen) * scale, torch.randn(B, d, generator=gen)
        correct = torch.rand(B, generator=gen) < p_correct
    elif kind == 'cancelling':       # ± pairs and (+a, −a, +2a) triples along one direction, big non-candidates between
        u, v = torch.randn(C, generator=gen), torch.randn(d, generator=gen)
        rows, feats, cand = [], [], []
        while len(rows) < B:
            a = float(torch.rand(1, generator=gen)) * scale + 0.05
            for s in ([1., -1.] if torch.rand(1, generator=gen) < 0.5 else [1., -1., 2.]):
                rows.append(s * a * u); feats.append(v); cand.append(True)
            if torch.rand(1, generator=gen) < 1 - p_correct:
                rows.append(torch.randn(C, generator=gen) * 5 * scale); feats.append(torch.randn(d, generator=gen)); cand.append(False)
        R, H, correct = torch.stack(rows[:B]), torch.stack(feats[:B]), torch.tensor(cand[:B])
    else:                            # colinear: every g_i = s_i u ṽᵀ with signed random scalars
        u, v = torch.randn(C, generator=gen), torch.randn(d, generator=gen)
        s = torch.randn(B, generator=gen) * scale
        R, H, correct = s[:, None] * u, v.expand(B, d).clone(), torch.rand(B, generator=gen) < p_correct
    w = None
    if weighted:
        w = torch.rand(B, generator=gen) * 3
        w = torch.where(torch.rand(B, generator=gen) < 0.1, torch.zeros_like(w), w)
    return R.float(), H.float(), correct, w


@st.composite
def batches(draw):
    kind = draw(st.sampled_from(['softmax', 'gaussian', 'cancelling', 'colinear']))
    B, C, d = draw(st.integers(1, 24)), draw(st.integers(1, 8)), draw(st.integers(0, 8))
    R, H, correct, w = make_batch(kind, B, C, d, draw(st.integers(0, 2 ** 31 - 1)), draw(st.sampled_from([0.1, 1.0, 3.0, 30.0])),
                                  draw(st.sampled_from([0.0, 0.5, 0.8, 1.0])), draw(st.booleans()))
    budget = draw(st.sampled_from([0.0, 0.01, 0.05, 0.09, 0.3, 0.99, 1.0, 1.5]) | st.floats(0.0, 2.0))
    return R, H, correct, w, budget, draw(st.booleans())


# ---------------------------------------------------------------- the rule against the oracle
@SETTINGS
@given(batches())
def test_select_matches_reference(batch):
    R, H, correct, w, budget, bias = batch
    assert disagreement(select(R, H, correct, budget, w, bias=bias), R, H, correct, budget, w, bias) in ('equal', 'boundary')


@SETTINGS
@given(batches())
def test_variants_match_reference(batch):
    R, H, correct, w, budget, bias = batch
    for fn, rule in ((first_violation, 'first_violation'), (magnitude_budget, 'magnitude')):
        sel, ref = fn(R, H, correct, budget, w, bias=bias), select_reference(R, H, correct, budget, w, bias=bias, rule=rule)
        if int(sel.m) != int(ref.m):   # only a prefix within round-off of the budget may flip
            k = max(int(sel.m), int(ref.m)) if rule == 'magnitude' else min(int(sel.m), int(ref.m)) + 1
            keys = per_row_grads(R, H, w, bias).flatten(1).norm(dim=1)[ref.order]
            value = float(keys[:k].sum()) if rule == 'magnitude' else float(ref.prefix_norms[k])
            tol = roundoff_tol(R, H, w, budget, ref.order[:k], bias=bias)
            assert abs(value ** 2 - float(ref.threshold) ** 2) <= tol, (rule, int(sel.m), int(ref.m))


@SETTINGS
@given(batches())
def test_p1_bound_and_angle_hold_for_the_returned_set(batch):
    R, H, correct, w, budget, bias = batch
    sel = select(R, H, correct, budget, w, bias=bias)
    g = per_row_grads(R, H, w, bias)
    G, D = g.sum(0), g[sel.drop].sum(0)
    slack_sq = roundoff_tol(R, H, w, budget, sel.drop, bias=bias)
    assert float(D.norm()) ** 2 <= budget ** 2 * float(G.norm()) ** 2 + slack_sq
    b_eff_sq = budget ** 2 + slack_sq / max(float(G.norm()) ** 2, 1e-300)
    if b_eff_sq < 0.99 and float(G.norm()) > 0:      # the angle bound, with the round-off folded into the budget
        cos = float((G - D).flatten() @ G.flatten()) / (float((G - D).norm()) * float(G.norm()))
        assert math.acos(max(-1.0, min(1.0, cos))) <= math.asin(math.sqrt(b_eff_sq)) + 1e-6
    assert not bool((sel.drop & ~correct).any()), 'only candidates may be dropped'


@SETTINGS
@given(batches())
def test_m_mag_le_m_fv_le_m_star(batch):
    R, H, correct, w, budget, bias = batch
    ms = [int(select_reference(R, H, correct, budget, w, bias=bias, rule=r).m) for r in ('magnitude', 'first_violation', 'full')]
    assert ms[0] <= ms[1] <= ms[2], ms
    dev = [int(f(R, H, correct, budget, w, bias=bias).m) for f in (magnitude_budget, first_violation, select)]
    assert dev[1] <= dev[2], dev                   # same prefixes, same threshold: exact on the device too
    if dev[0] > dev[1]:                            # only when prefix m_fv + 1 sits on the budget to round-off
        ref = select_reference(R, H, correct, budget, w, bias=bias, order=select(R, H, correct, budget, w, bias=bias).order)
        k = dev[1] + 1
        assert abs(float(ref.prefix_norms[k]) ** 2 - float(ref.threshold) ** 2) <= roundoff_tol(R, H, w, budget, ref.order[:k], bias=bias)


# ---------------------------------------------------------------- the counterexamples, as families
@SETTINGS
@given(st.integers(1, 6), st.integers(0, 6), st.integers(0, 2 ** 31 - 1), st.floats(0.01, 100.0), st.booleans())
def test_first_violation_and_magnitude_strictly_below_m_star(C, d, seed, a, bias):
    "SPEC's 1-D example (+1, −1, +2 | +10) in random directions and scales: m_mag = m_fv = 0 < m* = 2 at b = 0.05."
    gen = torch.Generator().manual_seed(seed)
    u, v = torch.randn(C, generator=gen), torch.randn(d, generator=gen)
    if not bias and d == 0: v = torch.ones(0)
    R = torch.stack([s * a * u for s in (1., -1., 2., 10.)])
    H, correct = v.expand(4, d).clone(), torch.tensor([True, True, True, False])
    if not bias and (d == 0 or float(v.norm()) == 0): return
    ref = select_reference(R, H, correct, 0.05, bias=bias)
    assert (int(ref.m), int(select_reference(R, H, correct, 0.05, bias=bias, rule='first_violation').m),
            int(select_reference(R, H, correct, 0.05, bias=bias, rule='magnitude').m)) == (2, 0, 0)
    assert int(select(R, H, correct, 0.05, bias=bias).m) == 2
    assert int(first_violation(R, H, correct, 0.05, bias=bias).m) == 0
    assert int(magnitude_budget(R, H, correct, 0.05, bias=bias).m) == 0
    assert select(R, H, correct, 0.05, bias=bias).drop.tolist() == [True, True, False, False]


def test_magnitude_strictly_below_first_violation():
    R, H, correct = torch.tensor([[1., 0.], [0., 1.], [10., 0.]]), torch.zeros(3, 0), torch.tensor([True, True, False])
    assert [int(f(R, H, correct, 0.14).m) for f in (magnitude_budget, first_violation, select)] == [1, 2, 2]


@SETTINGS
@given(st.integers(1, 6), st.integers(0, 6), st.integers(0, 2 ** 31 - 1), st.floats(0.01, 100.0))
def test_unweighted_rule_breaks_the_weighted_budget(C, d, seed, a):
    "SPEC §3: g = +1 (w = 2), −1 (w = 1), +10 (w = 1): unweighted drops both (weighted change 1/11 > 0.05); weighted drops none."
    gen = torch.Generator().manual_seed(seed)
    u, v = torch.randn(C, generator=gen), torch.randn(d, generator=gen)
    R, H = torch.stack([a * u, -a * u, 10 * a * u]), v.expand(3, d).clone()
    correct, w = torch.tensor([True, True, False]), torch.tensor([2., 1., 1.])
    unweighted = select(R, H, correct, 0.05)
    assert unweighted.drop.tolist() == [True, True, False]
    g = per_row_grads(R, H, w)
    change = float(g[unweighted.drop].sum(0).norm() / g.sum(0).norm())
    assert abs(change - 1 / 11) < 1e-5 and change > 0.05
    weighted = select(R, H, correct, 0.05, weights=w)
    assert int(weighted.m) == 0 and int(select_reference(R, H, correct, 0.05, weights=w).m) == 0
    assert torch.allclose(weighted.prefix_norms[1:3] / weighted.total_norm, torch.tensor([1 / 11, 1 / 11]), rtol=1e-4)


@SETTINGS
@given(batches())
def test_all_ones_weights_reproduce_unweighted_bitwise(batch):
    R, H, correct, _, budget, bias = batch
    for fn in (select, first_violation, magnitude_budget):
        a, b = fn(R, H, correct, budget, bias=bias), fn(R, H, correct, budget, torch.ones(len(R)), bias=bias)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------- residuals
@SETTINGS
@given(st.integers(1, 16), st.integers(1, 12), st.sampled_from([0.0, 0.05, 0.1, 0.5, 0.9]), st.floats(0.1, 20.0),
       st.integers(0, 2 ** 31 - 1))
def test_residuals_are_the_cross_entropy_gradient(B, C, eps, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    z = (scale * torch.randn(B, C, generator=gen, dtype=torch.float64)).requires_grad_()
    t = torch.randint(0, C, (B,), generator=gen)
    (grad,) = torch.autograd.grad(F.cross_entropy(z, t, label_smoothing=eps, reduction='sum'), z)
    r = residuals(z.detach(), t, label_smoothing=eps)
    assert r.dtype == torch.float32 and r.shape == (B, C)
    # float32 output: each entry is a difference of probabilities in [0, 1], so its round-off is a few ulp of 1
    # (absolute), not of the residual itself (a residual of 5e-4 carries ~1e-7 / 5e-4 relative error).
    assert torch.allclose(r.double(), grad, rtol=1e-5, atol=1e-6), float((r.double() - grad).abs().max())
    assert torch.allclose(r.sum(1), torch.zeros(B), atol=1e-5)          # softmax and y both sum to 1


def test_residuals_bad_input():
    z, t = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    with pytest.raises(ValueError, match=r'must be \[B, C\] = \[4, 3\]'): residuals(z, t.float())
    with pytest.raises(TypeError, match='integer tensor of class labels'): residuals(z, t.bool())
    with pytest.raises(ValueError, match='each row summing to 1'): residuals(z, torch.ones(4, 3))
    with pytest.raises(TypeError, match='floating-point'): residuals(z.long(), t)
    with pytest.raises(ValueError, match=r'must lie in \[0, 3\)'): residuals(z, t + 3)
    with pytest.raises(ValueError, match=r'targets must be \[B\]'): residuals(z, t[:2])
    with pytest.raises(ValueError, match='label_smoothing'): residuals(z, t, label_smoothing=1.0)
    with pytest.raises(ValueError, match='NaN or Inf'): residuals(z.masked_fill(z > 0, float('inf')), t)
    assert residuals(z.bfloat16(), t).dtype == torch.float32


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 16), st.integers(2, 12), st.sampled_from([0.0, 0.1]), st.integers(0, 10_000))
def test_soft_target_residuals_are_the_soft_cross_entropy_gradient(B, C, eps, seed):
    "Mixup/cutmix targets [B, C]: softmax(z) − y equals autograd of the soft cross-entropy (float64)."
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, C, generator=g, dtype=torch.float64, requires_grad=True)
    lam = float(torch.rand(1, generator=g))
    a, b = torch.randint(0, C, (B,), generator=g), torch.randint(0, C, (B,), generator=g)
    y = lam * F.one_hot(a, C).double() + (1 - lam) * F.one_hot(b, C).double()
    grad, = torch.autograd.grad(F.cross_entropy(z, y, reduction='sum', label_smoothing=eps), z)
    assert torch.allclose(residuals(z.detach(), y.float(), eps).double(), grad, atol=1e-6)


# ---------------------------------------------------------------- no host read
def traced_ops(fn, *args):
    "The ops of `fn`'s fullgraph trace (capskip.testing) and `fn`'s eager output."
    return _traced_ops(fn, *args), fn(*args)


def _batch(B=48, C=10, d=12, seed=0):
    R, H, correct, _ = make_batch('softmax', B, C, d, seed, 2.0, 0.8, False)
    return R, H, correct


@pytest.mark.parametrize('fn', [select, first_violation, magnitude_budget])
def test_compiles_fullgraph_without_host_reads(fn):
    R, H, correct = _batch()
    w = torch.rand(len(R), generator=torch.Generator().manual_seed(1))
    ops, out = traced_ops(fn, R, H, correct, 0.09, w)
    assert 'aten.mm.default' in ops and host_reads(ops) == []
    assert all(torch.equal(a, b) for a, b in zip(out, fn(R, H, correct, 0.09, w)))


def test_compiled_aot_eager_matches_eager():
    R, H, correct = _batch(seed=3)
    torch._dynamo.reset()
    compiled = torch.compile(select, fullgraph=True, backend='aot_eager')
    for budget in (0.0, 0.09, 0.5):
        assert all(torch.equal(a, b) for a, b in zip(compiled(R, H, correct, budget), select(R, H, correct, budget)))


def test_host_read_controls_are_caught():
    "The audit is not vacuous: functions that read a value back or index by a mask are flagged, and fail on meta."
    R, H, correct = _batch()
    def reads_m(R, H, correct): return select(R, H, correct, 0.09).m.item()
    def mask_indexing(R, H, correct): return R[select(R, H, correct, 0.09).drop]
    for control in (reads_m, mask_indexing):
        assert host_reads(traced_ops(control, R, H, correct)[0])
        with pytest.raises(Exception): control(R.to('meta'), H.to('meta'), correct.to('meta'))


def test_runs_on_the_meta_device():
    "Tensors without data: any host read (.item(), .cpu(), nonzero, bool(t)) would raise."
    R, H, correct = _batch()
    for fn in (select, first_violation, magnitude_budget):
        sel = fn(R.to('meta'), H.to('meta'), correct.to('meta'), 0.09, torch.ones(len(R), device='meta'))
        assert all(t.device.type == 'meta' for t in sel)
        assert sel.drop.shape == (len(R),) and sel.m.shape == () and sel.prefix_norms.shape == (len(R) + 1,)


# ---------------------------------------------------------------- numerics, determinism, edge cases
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_computed_in_fp32(dtype):
    R, H, correct = _batch(seed=5)
    low, ref = select(R.to(dtype), H.to(dtype), correct, 0.09), select(R.to(dtype).float(), H.to(dtype).float(), correct, 0.09)
    assert all(torch.equal(a, b) for a, b in zip(low, ref))
    assert low.row_norms.dtype == low.prefix_norms.dtype == low.distortion.dtype == torch.float32
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert all(torch.equal(a, b) for a, b in zip(select(R.to(dtype), H.to(dtype), correct, 0.09), ref))


def test_deterministic_and_ties_by_index():
    R, H, correct = _batch(seed=6)
    assert all(torch.equal(a, b) for a, b in zip(select(R, H, correct, 0.09), select(R, H, correct, 0.09)))
    tied = torch.ones(6, 1)
    sel = select(tied, torch.zeros(6, 0), torch.tensor([True, False, True, True, False, True]), 0.0)
    assert sel.order.tolist() == [0, 2, 3, 5, 1, 4]


def test_edge_cases():
    R, H, correct = _batch(B=16)
    none = select(R, H, torch.zeros(16, dtype=torch.bool), 0.5)
    assert int(none.m) == 0 and not none.drop.any() and int(none.n_candidates) == 0 and float(none.distortion) == 0
    every = select(R, H, torch.ones(16, dtype=torch.bool), 1.0)          # the full prefix is G itself
    assert int(every.m) == 16 and bool(every.drop.all()) and abs(float(every.distortion) - 1) < 1e-5
    assert [int(select(R[:1], H[:1], torch.tensor([True]), b).m) for b in (0.0, 0.5, 0.999, 1.0, 3.0)] == [0, 0, 0, 1, 1]
    zero = select(torch.zeros(5, 3), torch.randn(5, 2), torch.tensor([True, True, False, True, True]), 0.1)   # G = 0
    assert int(zero.m) == 4 and float(zero.total_norm) == 0 and float(zero.distortion) == 0
    R0, H0 = torch.tensor([[1.], [-1.], [3.], [10.]]), torch.zeros(4, 0)   # budget 0: only the exactly cancelling pair
    assert select(R0, H0, torch.tensor([True, True, True, False]), 0.0).drop.tolist() == [True, True, False, False]
    R5 = torch.tensor([[1.], [5.], [-4.]])                                  # G = 2, prefix norms 1, 6
    assert int(select(R5, torch.zeros(3, 0), torch.tensor([True, True, False]), 2.0).m) == 1
    empty = select(torch.zeros(0, 3), torch.zeros(0, 2), torch.zeros(0, dtype=torch.bool), 0.1)
    assert int(empty.m) == 0 and empty.drop.shape == (0,)
    nb = select(R, H, correct, 0.09, bias=False)
    assert int(nb.m) == int(select_reference(R, H, correct, 0.09, bias=False).m)
    assert torch.allclose(nb.row_norms, R.norm(dim=1) * H.norm(dim=1), rtol=1e-5)


def test_statistics_are_consistent():
    R, H, correct = _batch(seed=7)
    w = torch.rand(len(R), generator=torch.Generator().manual_seed(2)) * 2
    sel = select(R, H, correct, 0.2, w)
    g = per_row_grads(R, H, w)
    assert int(sel.m) == int(sel.drop.sum()) and int(sel.n_candidates) == int(correct.sum())
    assert abs(float(sel.total_norm) - float(g.sum(0).norm())) <= 1e-4 * float(g.sum(0).norm())
    assert abs(float(sel.dropped_norm) - float(g[sel.drop].sum(0).norm())) <= 1e-4 * float(g.sum(0).norm())
    assert abs(float(sel.distortion) - float(sel.dropped_norm / sel.total_norm)) < 1e-6
    assert torch.allclose(sel.row_norms.double(), per_row_grads(R, H).flatten(1).norm(dim=1), rtol=1e-5)


# ---------------------------------------------------------------- bad input
def test_bad_input_errors():
    R, H, correct = _batch(B=8)
    cases = [
        (ValueError, 'batch sizes differ', lambda: select(R, H[:5], correct, 0.1)),
        (ValueError, r'residuals must be \[B, C\]', lambda: select(R[0], H, correct, 0.1)),
        (ValueError, r'features must be \[B, d\]', lambda: select(R, H[:, None], correct, 0.1)),
        (TypeError, 'correct must be a bool tensor', lambda: select(R, H, correct.long(), 0.1)),
        (ValueError, r'correct must be \[B\]', lambda: select(R, H, correct[:3], 0.1)),
        (ValueError, 'budget must be a finite number', lambda: select(R, H, correct, -0.1)),
        (ValueError, 'budget must be a finite number', lambda: select(R, H, correct, float('nan'))),
        (TypeError, 'budget must be a float', lambda: select(R, H, correct, '0.1')),
        (ValueError, r'weights must be \[B\]', lambda: select(R, H, correct, 0.1, torch.ones(8, 1))),
        (ValueError, 'weights must be ≥ 0', lambda: select(R, H, correct, 0.1, -torch.ones(8))),
        (ValueError, 'weights must be detached', lambda: select(R, H, correct, 0.1, torch.ones(8, requires_grad=True))),
        (ValueError, 'NaN or Inf', lambda: select(R.masked_fill(R > 0, float('nan')), H, correct, 0.1)),
        (ValueError, 'NaN or Inf', lambda: select(R, H.masked_fill(H > 0, float('inf')), correct, 0.1)),
        (ValueError, 'NaN or Inf', lambda: select(R, H, correct, 0.1, torch.full((8,), float('nan')))),
        (TypeError, 'floating-point', lambda: select(R.long(), H, correct, 0.1)),
        (TypeError, 'must be a torch.Tensor', lambda: select(R.tolist(), H, correct, 0.1)),
        (ValueError, 'eps must be', lambda: select(R, H, correct, 0.1, eps=-1.0)),
        (ValueError, "rule must be", lambda: select_reference(R, H, correct, 0.1, rule='greedy')),
        (ValueError, 'must share B', lambda: last_layer_grad(R, H[:3])),
    ]
    for exc, message, call in cases:
        with pytest.raises(exc, match=message): call()
    for fn in (first_violation, magnitude_budget, select_reference):
        with pytest.raises(ValueError, match='batch sizes differ'): fn(R, H[:5], correct, 0.1)


def test_value_checks_switch():
    R, H, correct = _batch(B=8)
    bad = R.masked_fill(R > 0, float('nan'))
    with pytest.raises(ValueError, match='NaN or Inf'): select(bad, H, correct, 0.1, check_values=True)
    select(bad, H, correct, 0.1, check_values=False)    # skipped on request (what accelerators do by default)


# ---------------------------------------------------------------- last-layer gradient, demo
@pytest.mark.parametrize('bias', [True, False])
def test_last_layer_grad_matches_autograd(bias):
    gen = torch.Generator().manual_seed(8)
    head = torch.nn.Linear(12, 7, bias=bias)
    x, y, w = torch.randn(20, 12, generator=gen), torch.randint(0, 7, (20,), generator=gen), torch.rand(20, generator=gen)
    F.cross_entropy(head(x), y, reduction='none', label_smoothing=0.1).mul(w).sum().backward()
    gW, gb = last_layer_grad(residuals(head(x).detach(), y, 0.1), x, w, bias=bias)
    assert float((gW - head.weight.grad).norm() / head.weight.grad.norm()) < 1e-5
    if bias: assert float((gb - head.bias.grad).norm() / head.bias.grad.norm()) < 1e-5
    else: assert gb is None


# ---------------------------------------------------------------- the checks themselves can fail
def test_disagreement_check_rejects_a_real_mismatch():
    "Shifting m by one row away from any boundary must be caught by the oracle comparison used above."
    R, H, correct = _batch(seed=11)
    sel = select(R, H, correct, 0.3)
    assert disagreement(sel, R, H, correct, 0.3) == 'equal' and 0 < int(sel.m) < int(sel.n_candidates)
    wrong_m = sel.m + 1
    wrong = sel._replace(m=wrong_m, drop=torch.zeros_like(sel.drop).scatter(0, sel.order, torch.arange(len(R)) < wrong_m))
    with pytest.raises(AssertionError): disagreement(wrong, R, H, correct, 0.3)


def test_tensor_budget_matches_float_budget():
    R, H, correct = _batch(seed=12)
    for b in (0.0, 0.09, 0.4):
        assert torch.equal(select(R, H, correct, torch.tensor(b)).drop, select(R, H, correct, b).drop)
    with pytest.raises(ValueError, match='budget must be a finite number'): select(R, H, correct, torch.tensor(-1.0))
    with pytest.raises(ValueError, match='0-d tensor'): select(R, H, correct, torch.tensor([0.1]))


DEVICES = ['cpu'] + (['cuda'] if torch.cuda.is_available() else [])


@pytest.mark.parametrize('device', DEVICES)
def test_same_selection_on_every_device_without_sync(device):
    "On CUDA the selector must not synchronise (sync debug mode 'error'); results match the CPU's."
    R, H, correct = _batch(seed=13)
    w = torch.rand(len(R), generator=torch.Generator().manual_seed(3))
    cpu = select(R, H, correct, 0.09, w)
    args = [t.to(device) for t in (R, H, correct)]
    if device.startswith('cuda'):
        select(*args, 0.09, w.to(device))                      # warm-up (lazy CUDA init may synchronise)
        torch.cuda.set_sync_debug_mode('error')
        try: sel = select(*args, 0.09, w.to(device))
        finally: torch.cuda.set_sync_debug_mode(0)
    else: sel = select(*args, 0.09, w.to(device))
    assert all(t.device.type == torch.device(device).type for t in sel)
    assert int(sel.m) == int(cpu.m) and torch.equal(sel.drop.cpu(), cpu.drop)


# ---------------------------------------------------------------- the bound in the realised gradient (issue 9)
def cancelling_pairs(n_pairs, C, d, seed, delta=1e-3, n_other=4, weighted=False):
    "Candidate pairs (r, −r + δ) sharing a feature h of scale 10^U(−3, 3); fp32 inputs (exactly representable)."
    g = torch.Generator().manual_seed(seed)
    scale = lambda: 10 ** float(torch.empty(1).uniform_(-3, 3, generator=g))
    R, H = [], []
    for _ in range(n_pairs):
        r, h = torch.randn(C, generator=g), torch.randn(d, generator=g) * scale()
        R += [r, -r + delta * r * torch.randn(C, generator=g)]; H += [h, h]
    for _ in range(n_other): R.append(torch.randn(C, generator=g)); H.append(torch.randn(d, generator=g) * scale())
    correct = torch.arange(2 * n_pairs + n_other) < 2 * n_pairs
    w = torch.rand(len(R), generator=g) * 2 if weighted else None
    return torch.stack(R), torch.stack(H), correct, w


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 24), st.integers(2, 12), st.integers(1, 10), st.integers(0, 10_000),
       st.sampled_from([1e-4, 1e-3, 1e-2]), st.sampled_from([0.0, 0.01, 0.09, 0.3]), st.booleans())
def test_realised_distortion_within_budget_under_cancellation(n_pairs, C, d, seed, delta, budget, weighted):
    "The returned set's ‖D‖/‖G‖, summed from the dropped rows in float64, stays ≤ b(1 + 1e-3); the reported value is it."
    R, H, A, w = cancelling_pairs(n_pairs, C, d, seed, delta, weighted=weighted)
    sel = select(R, H, A, budget, w)
    real = realised_distortion(sel.drop, R, H, w)
    assert real <= budget * (1 + 1e-3) + 1e-9, (real, budget)
    assert abs(float(sel.distortion) - real) <= 1e-4 * max(budget, 1e-6) + 1e-6
    assert disagreement(sel, R, H, A, budget, w) in ('equal', 'boundary')
