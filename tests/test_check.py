"The gradient check (`capskip.engine.check`): every mode exact on a small model, refusals, the error metric, the shared reference."
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from capskip.engine import RowDependenceError
from capskip.engine.check import (autograd_grads, format_rows, grad_errors, gradient_check, model_grads, relative_errors,
                                  without_stochastic_layers, worst_error)


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
    rows = gradient_check(model, x, y, ('dense', 'masked', 'reforward', 'reuse'), keep=2)
    assert [(r.mode, r.case, r.kept) for r in rows[:4]] == [('dense', 'keep 2', 2), ('dense', 'keep 2 weighted', 2),
                                                           ('dense', 'keep all', 6), ('dense', 'keep 0', 0)]
    assert len(rows) == 16 and max(r.max_rel_err for r in rows) <= 1e-5
    assert {r.note for r in rows if r.mode == 'reforward'} == {'dropout/drop-path off'}
    assert all(p.grad is None for p in model.parameters())           # the check leaves the model's .grad alone
    table = format_rows(rows).splitlines()
    assert len(table) == 17 and table[0].split()[:4] == ['mode', 'selection', 'kept', 'max_rel_err']


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
    with pytest.raises(ValueError, match='keep must be in'):
        gradient_check(model, torch.randn(3, 4), torch.zeros(3, dtype=torch.long), keep=5)
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
