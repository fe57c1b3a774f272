"The gradient check (`capskip.engine.check`): every mode exact on a small model, refusals, the error metric, the shared reference."
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from capskip.engine import RowDependenceError
from capskip.engine.check import (TOLERANCE, autograd_grads, format_rows, grad_errors, gradient_check, kept_rows,
                                  model_grads, randomness_left, relative_errors, verdict, without_stochastic_layers,
                                  worst_error)


def small_cnn(p: float = 0.3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.GELU(), nn.Dropout(p),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def batch(B: int = 6):
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, 3, 8, 8, generator=g), torch.randint(0, 5, (B,), generator=g)


def test_every_mode_is_exact_on_every_selection():
    model = small_cnn()
    x, y = batch()
    rows = gradient_check(model, x, y, ('dense', 'masked', 'reforward', 'reuse'), keep=0.35)
    assert [(r.mode, r.case, r.kept) for r in rows[:4]] == [('dense', 'keep 2', 2), ('dense', 'keep 2 weighted', 2),
                                                           ('dense', 'keep all', 6), ('dense', 'keep 0', 0)]
    assert len(rows) == 16 and max(r.max_rel_err for r in rows) <= 1e-5
    assert {r.note for r in rows if r.mode == 'reforward'} == {'stochastic layers off'}
    assert all(r.compared and r.global_err <= 1e-5 for r in rows)
    assert [verdict(rows, m)[0] for m in ('dense', 'masked', 'reforward', 'reuse')] == ['exact'] * 4
    assert all(p.grad is None for p in model.parameters())           # the check leaves the model's .grad alone
    table = format_rows(rows).splitlines()
    assert len(table) == 17 and table[0].split()[:5] == ['mode', 'selection', 'kept', 'max_rel_err', 'global_err']


def test_batchnorm_is_refused():
    bn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    x, y = batch()
    with pytest.raises(RowDependenceError, match='BatchNorm2d'):
        gradient_check(bn, x, y)


def test_stochastic_layers_are_switched_off_in_a_copy():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    copy, changed = without_stochastic_layers(model)
    assert changed == 1 and copy[1].p == 0.0 and model[1].p == 0.5


def test_bad_keep_and_modes_are_clear_errors():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    for keep in (5, 0.0, 1.5):
        with pytest.raises(ValueError, match=r'fraction in \(0, 1\]'):
            gradient_check(model, torch.randn(3, 4), torch.zeros(3, dtype=torch.long), keep=keep)
    with pytest.raises(ValueError, match='unknown modes'):
        gradient_check(model, torch.randn(3, 4), torch.zeros(3, dtype=torch.long), modes=('fast',))


def test_error_metric():
    ref = {'w': torch.tensor([3.0, 4.0]), 'b': torch.tensor([1.0])}
    assert relative_errors(ref, ref) == (0.0, '') and grad_errors(ref, ref) == (0.0, 0.0)
    got = {'w': torch.tensor([3.0, 4.5]), 'b': torch.tensor([1.0])}
    assert relative_errors(got, ref) == (pytest.approx(0.1), 'w')
    assert grad_errors(got, ref) == (pytest.approx(0.1), pytest.approx(0.5 / 26 ** 0.5))
    assert relative_errors({'b': torch.tensor([0.5])}, {'b': torch.tensor([0.0])}) == (0.5, 'b')   # absolute where ref = 0
    worst, name = relative_errors({'w': torch.tensor([float('nan'), 0.0]), 'b': torch.tensor([1.0])}, ref)
    assert name == 'w' and math.isnan(worst)                      # a NaN stays the worst, also before a finite error
    assert math.isnan(worst_error([0.0, math.nan, 1e-7])) and worst_error([1e-7, 2e-7]) == 2e-7


def test_reference_is_plain_autograd_on_a_copy():
    model = small_cnn(p=0.0)
    x, y = batch()
    w = torch.rand(6, generator=torch.Generator().manual_seed(2))
    ref = autograd_grads(model, x, y, w, label_smoothing=0.1, denominator=4.0)
    assert all(p.grad is None for p in model.parameters())
    (F.cross_entropy(model(x), y, reduction='none', label_smoothing=0.1) * w).sum().div(4.0).backward()
    assert grad_errors(model_grads(model), ref)[0] <= 1e-6


def test_keep_is_a_fraction_as_in_bench_step():
    "round(keep·B) rows, at least 1 (capskip.bench.step.StepRunner.keep_mask)."
    assert [kept_rows(k, 10) for k in (0.01, 0.35, 0.69, 1.0)] == [1, 4, 7, 10]
    rows = gradient_check(small_cnn(), *batch(9), ('reforward',), keep=0.69)
    assert rows[0].kept == 6


class AttentionPool(nn.Module):
    "Attention pooling over tokens: the score layer's bias shifts every token's score alike, so its gradient is 0."
    def __init__(self):
        super().__init__()
        self.proj, self.score, self.head = nn.Linear(8, 8), nn.Linear(8, 1), nn.Linear(8, 5)

    def forward(self, x):
        h = torch.tanh(self.proj(x.reshape(x.shape[0], -1, 8)))
        return self.head((self.score(h).softmax(1) * h).sum(1))


def test_an_analytically_zero_gradient_is_not_a_false_alarm():
    "The old per-parameter relative error compared round-off with round-off and reported FAILED (issue 9 §4)."
    torch.manual_seed(0)
    model = AttentionPool()
    x, y = batch()
    rows = gradient_check(model, x, y, ('reuse', 'reforward'), keep=0.5)
    assert max(r.max_rel_err for r in rows) <= TOLERANCE and all(verdict(rows, m)[0] == 'exact' for m in ('reuse', 'reforward'))
    ref = autograd_grads(model, x, y)
    top = max(float(r.norm()) for r in ref.values())
    assert float(ref['score.bias'].norm()) < 1e-6 * top                      # round-off only
    got = {n: r.clone() for n, r in ref.items()}
    got['score.bias'] += 1e-7 * top                                          # round-off-sized difference
    old = float((got['score.bias'] - ref['score.bias']).norm() / ref['score.bias'].norm())
    assert old > 1e-2 and relative_errors(got, ref)[0] < 1e-3
    got['score.bias'] += 1e-2 * top                                          # a real error still fails
    assert relative_errors(got, ref) == (pytest.approx(10.0, rel=1e-3), 'score.bias')


def test_stochastic_depth_is_switched_off_for_reforward_and_replayed_for_reuse():
    "torchvision's StochasticDepth (ConvNeXt): the old check left it on and reported re-forward wrong (issue 9 §4)."
    from torchvision.ops import StochasticDepth
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), StochasticDepth(0.5, 'row'),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    quiet, changed = without_stochastic_layers(model)
    assert changed == 1 and quiet[2].p == 0.0 and model[2].p == 0.5
    x, y = batch()
    assert randomness_left(model, x) and not randomness_left(quiet, x)
    rows = gradient_check(model, x, y, ('reuse', 'reforward'))
    assert max(r.max_rel_err for r in rows) <= 1e-5 and all(r.compared for r in rows)


def test_randomness_that_cannot_be_switched_off_is_not_compared():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__(); self.fc = nn.Linear(4, 3)
        def forward(self, x): return self.fc(x + 0.1 * torch.randn_like(x))
    torch.manual_seed(0)
    rows = gradient_check(Noisy(), torch.randn(6, 4), torch.randint(0, 3, (6,)), ('reuse', 'reforward'))
    assert verdict(rows, 'reforward')[0] == 'not compared' and not any(r.compared for r in rows if r.mode == 'reforward')
    assert verdict(rows, 'reuse')[0] == 'exact'                              # one forward: the noise is replayed


def test_soft_targets_in_the_reference():
    model = small_cnn(p=0.0)
    x, y = batch()
    soft = torch.softmax(torch.randn(6, 5, generator=torch.Generator().manual_seed(1)), 1)
    ref = autograd_grads(model, x, soft, label_smoothing=0.1)
    F.cross_entropy(model(x), soft, label_smoothing=0.1).backward()
    assert grad_errors(model_grads(model), ref)[0] <= 1e-6


def test_float64_weights_are_not_rounded_in_the_reference():
    "autograd_grads on a float64 model with weights not representable in float32 (1/3, 1e-9 + 1): the float64 closed form to 1e-15."
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    w = torch.tensor([1 / 3, 1 + 1e-9, 0.1, 2 / 7, 0.0], dtype=torch.float64)
    got = autograd_grads(lin, x, y, weights=w)
    r = (torch.softmax(lin(x), 1) - F.one_hot(y, 3).double()) * (w / 5)[:, None]        # d/dz of (1/B) Σ w_i CE_i
    torch.testing.assert_close(got['weight'], (r.T @ x).detach(), rtol=1e-15, atol=1e-17)
    rounded = (torch.softmax(lin(x), 1) - F.one_hot(y, 3).double()) * (w.float().double() / 5)[:, None]
    assert float((got['weight'] - (rounded.T @ x).detach()).abs().max()) > 1e-12      # the control: float32 weights differ


def test_a_float64_models_step_gradient_is_float64():
    "The fused step (`CAPSkip.step`, one label per row) and `ce_grad_logits` on float64 logits: plain float64 autograd to 1e-14, not float32's 1e-8; float64 row weights stay float64."
    import capskip
    from capskip.engine.facade import ce_grad_logits
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.GELU(), nn.Linear(8, 3)).double()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)
    z = net(x).detach()
    want = (torch.softmax(z, 1) - F.one_hot(y, 3).double()) / 12
    got = ce_grad_logits(z, y)
    assert got.dtype == torch.float64 and float((got - want).abs().max()) <= 1e-17
    for smoothing in (0.0, 0.1):
        m = copy.deepcopy(net)
        stats = capskip.CAPSkip(m, budget=0.3, mode='reuse', label_smoothing=smoothing).step(x, y)
        ref = autograd_grads(net, x, y, weights=stats.applied.double(), label_smoothing=smoothing)
        assert 0 < int(stats.kept) < 12
        assert max(grad_errors(model_grads(m), ref)) <= 1e-14
    w = torch.full((12,), 1 / 3, dtype=torch.float64)                  # the user's float64 row weights, not float32's 1/3
    stats = capskip.CAPSkip(copy.deepcopy(net), budget=0.3, mode='reuse').step(x, y, weights=w)
    kept = stats.applied > 0
    assert 0 < int(kept.sum()) < 12 and stats.applied.dtype == torch.float64 and bool((stats.applied[kept] == 1 / 3).all())
