"""The backward's part of the row-independence probe (`capskip.engine.backward_probe`, nbs/01ca_backward_probe.ipynb):
a model whose forward keeps rows apart but whose backward reads the batch size (a custom autograd.Function dividing
its gradient by the rows it sees) is refused by `reforward` and `reuse` in one line naming the backward (before, both
gave a gradient off by a factor with no word), `masked` stays plain autograd's; ordinary models pass."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from capskip import CAPSkip
from capskip.engine.check import model_grads
from capskip.engine.types import RowDependenceError
from capskip.testing import grad_errors

B = 8


class PerRowMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h): return h.view_as(h)
    @staticmethod
    def backward(ctx, g): return g * (float(B) / g.shape[0])


class Averaged(nn.Module):
    def __init__(self, per_row_mean=True):
        super().__init__()
        self.a, self.head, self.mean = nn.Linear(10, 16), nn.Linear(16, 5), per_row_mean
    def forward(self, x):
        h = self.a(x)
        return self.head(torch.tanh(PerRowMean.apply(h) if self.mean else h))


def batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(B, 10, generator=g, dtype=torch.float64), torch.randint(0, 5, (B,), generator=g)


def reference(model, x, y, keep):
    z = model(x)
    ((F.cross_entropy(z, y, reduction='none') * keep.double()).sum() / len(y)).backward()
    return model_grads(model)


def step_error(model, mode, x, y) -> float:
    "One CAPSkip step of `model` in `mode` (some rows kept, some dropped): the worst zero-gradient-safe error against plain autograd of the kept rows."
    ref = copy.deepcopy(model)
    skip = CAPSkip(model, budget=0.5, mode=mode)
    skip.loss(skip(x), y).backward()
    keep = ~skip.last.drop
    assert 0 < int(keep.sum()) < B
    return max(grad_errors(model_grads(model), reference(ref, x, y, keep)))


@pytest.mark.parametrize('mode', ['reforward', 'reuse'])
def test_a_backward_that_reads_the_batch_size_is_refused_in_one_line(mode):
    torch.manual_seed(0)
    model, (x, y) = Averaged().double(), batch()
    skip = CAPSkip(model, budget=0.5, mode=mode)
    with pytest.raises(RowDependenceError) as err:
        skip.loss(skip(x), y).backward()
    text = str(err.value)
    assert '\n' not in text and 'the backward of Averaged' in text and 'mode="masked"' in text, text
    assert err.value.cause == 'backward'


def test_masked_runs_it_as_plain_autograd():
    torch.manual_seed(0)
    assert step_error(Averaged().double(), 'masked', *batch()) <= 1e-14


@pytest.mark.parametrize('mode', ['reforward', 'reuse'])
def test_the_same_model_without_the_function_passes_and_is_exact(mode):
    torch.manual_seed(0)
    assert step_error(Averaged(per_row_mean=False).double(), mode, *batch()) <= 1e-12


class Checkpointed(nn.Module):
    "A hidden layer under torch.utils.checkpoint (use_reentrant as given)."
    def __init__(self, reentrant):
        super().__init__()
        self.a, self.b, self.head, self.reentrant = nn.Linear(10, 16), nn.Linear(16, 16), nn.Linear(16, 5), reentrant
    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.b(t)), torch.tanh(self.a(x)), use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize('reentrant', [True, False])
def test_reentrant_checkpointing_skips_the_check_and_reforward_says_why_it_cannot(reentrant):
    "Reentrant checkpointing refuses autograd.grad: the probe's backward check raised its RuntimeError and stopped reuse (which ran before it); reforward's raw RuntimeError is now one line with the fix."
    torch.manual_seed(0)
    x, y = batch()
    assert step_error(Checkpointed(reentrant).double(), 'reuse', x, y) <= 1e-12
    if reentrant:
        again = CAPSkip(Checkpointed(True).double(), budget=0.5, mode='reforward')
        with pytest.raises(RuntimeError) as err:
            again.loss(again(x), y).backward()
        assert '\n' not in str(err.value) and 'use_reentrant=False' in str(err.value), str(err.value)


def test_the_16_bit_tolerance_passes_a_bf16_vit_and_still_catches_the_factor():
    "bf16 gradients of rows run alone drift by a few percent (a bf16 ViT-tiny: 0.04, most of the forward check's 5e-2): 16-bit parameters get BACKWARD_TOL[2] = 0.25, still far below the drift of a backward reading the batch size."
    import timm
    from capskip.engine.backward_probe import BACKWARD_TOL, subset_backward
    torch.manual_seed(0)
    vit = timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=64, num_classes=100).to(torch.bfloat16)
    assert subset_backward(vit, torch.randn(32, 3, 64, 64).to(torch.bfloat16), 16) < BACKWARD_TOL[2]
    x, _ = batch()
    assert subset_backward(Averaged().to(torch.bfloat16), x.to(torch.bfloat16), B // 2) > 2 * BACKWARD_TOL[2]
