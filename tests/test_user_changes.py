"""What users change around the door, held out from the tests that built it (probed in stop 51, kept here): Hugging
Face's default dropout (0.1) on GPT-2, whose masks reuse and reforward must replay, and a layer unfrozen or replaced
between steps, which must get its gradient from the next step on. Each against plain autograd on float64."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import capskip
from capskip.engine.check import grad_errors, model_grads

transformers.logging.set_verbosity_error()
MODES = ['reuse', 'reforward', 'masked']


@pytest.mark.parametrize('mode', MODES)
def test_gpt2_at_its_default_dropout(mode):
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)).double().train()
    assert base.config.resid_pdrop == 0.1
    ids = torch.randint(0, 64, (6, 8), generator=torch.Generator().manual_seed(1))
    model = copy.deepcopy(base)
    skip = capskip.CAPSkip(model, budget=0.5, mode=mode)
    for step in range(2):                                # the second step runs the traced graphs
        model.zero_grad()
        torch.manual_seed(100 + step)
        z = skip(input_ids=ids, labels=ids)
        skip.loss(z).backward()
        keep = skip.last.applied > 0
        assert 0 < int(keep.sum()) < 6
        ref = copy.deepcopy(base)
        torch.manual_seed(100 + step)                    # the same dropout masks
        zr = ref(input_ids=ids).logits
        assert torch.equal(zr, z.detach())
        tok = F.cross_entropy(zr[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction='none').view(6, 7)
        ((tok.sum(1) * keep.double()).sum() / tok.numel()).backward()
        top, rel = grad_errors(model_grads(model), model_grads(ref))
        assert top < 1e-12 and rel < 1e-12, (step, top, rel)
    skip.close()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 5)).double()


def step_errors(model, skip, x, y):
    "One `skip.loss(skip(x), y).backward()`: the errors of the trainable parameters' gradients against plain autograd of the kept rows, and the names that got none."
    model.zero_grad(set_to_none=True)
    skip.loss(skip(x), y).backward()
    applied = skip.last.applied
    ref = copy.deepcopy(model); ref.zero_grad(set_to_none=True)
    (F.cross_entropy(ref(x), y, reduction='none') * applied.double()).sum().div(len(y)).backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(n for n, g in got.items() if g is None)
    return grad_errors({n: g for n, g in got.items() if g is not None}, {n: want[n] for n in got if got[n] is not None}), missing


@pytest.mark.parametrize('mode', ['reuse', 'reforward'])
def test_a_layer_unfrozen_or_replaced_between_steps(mode):
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (8,), generator=g)
    model = mlp()
    for p in model[0].parameters(): p.requires_grad_(False)
    skip = capskip.CAPSkip(model, budget=0.5, mode=mode)
    for change in ('frozen', 'unfrozen', 'replaced'):
        if change == 'unfrozen':
            for p in model[0].parameters(): p.requires_grad_(True)
        if change == 'replaced':
            torch.manual_seed(5); model[2] = nn.Linear(6, 6).double()
        (top, rel), missing = step_errors(model, skip, x, y)
        assert 0 < int((skip.last.applied > 0).sum()) < 8, change
        assert missing == [] and top < 1e-12 and rel < 1e-12, (change, missing, top, rel)
    assert model[0].weight.grad is not None and model[2].weight.grad is not None
    skip.close()
