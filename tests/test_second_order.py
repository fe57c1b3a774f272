"""Gradients of gradients (`create_graph=True`, e.g. a gradient penalty) through capskip: `dense` and `masked` give plain
autograd's, `skip.loss` on sequence rows included (its backward was a constant under `create_graph`: the second order
was silently lost); `reuse` and `reforward` compute first-order gradients only and say so in one line when their
gradients are differentiated again, whatever the loss (`once_differentiable` let a constant through when no upstream
gradient required grad)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from capskip import CAPSkip

V, B, L = 13, 4, 5
W = torch.tensor([1.0, 0.0, 2.0, 0.0])


def small_lm():
    "An embedding, a hidden layer and a head, float64, the same weights on every call (no attention: torch's SDPA has no double backward)."
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, V)).double()


def batch():
    g = torch.Generator().manual_seed(3)
    ids, lab = torch.randint(0, V, (B, L), generator=g), torch.randint(0, V, (B, L), generator=g)
    lab[0, :2] = -100
    return ids, lab


def penalised_grads(mode, second_order=True):
    "The parameters' gradients of loss + Σ‖∂loss/∂θ‖² (the penalty's own gradient needs the second order), loss = (1/N) Σ_i w_i Σ_t CE."
    model, (ids, lab) = small_lm(), batch()
    if mode == 'plain':
        tok = F.cross_entropy(model(ids).flatten(0, 1), lab.flatten(), reduction='none', ignore_index=-100).view(B, L)
        loss = (tok.sum(1) * W).sum() / (lab != -100).sum()
    else:
        skip = CAPSkip(model, mode=mode, budget=0.0)
        loss = skip.loss(skip(ids), lab, weights=W)
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params, create_graph=True)
    if not second_order: grads = [g.detach() for g in grads]
    (loss + sum((g ** 2).sum() for g in grads)).backward()
    return [p.grad for p in params]


def worst(got, ref):
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref))


@pytest.mark.parametrize('mode', ['dense', 'masked'])
def test_a_gradient_penalty_through_skip_loss_on_sequences_is_plain_autograds(mode):
    ref = penalised_grads('plain')
    assert worst(penalised_grads(mode), ref) < 1e-12
    assert worst(penalised_grads('plain', second_order=False), ref) > 1e-2   # the control: the second order matters here


@pytest.mark.parametrize('mode', ['reuse', 'reforward'])
def test_reuse_and_reforward_refuse_gradients_of_gradients_in_one_line(mode):
    with pytest.raises(RuntimeError, match=r"first-order gradients only; .* use mode='masked' or 'dense'"):
        penalised_grads(mode)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))
    skip = CAPSkip(net, mode=mode, budget=0.0)
    g, = torch.autograd.grad(skip(torch.randn(12, 6)).sum(), [net[0].weight], create_graph=True)   # upstream ones: no grad of their own
    with pytest.raises(RuntimeError, match='first-order gradients only'):
        (g ** 2).sum().backward()                                       # was a constant: no error, a wrong second order
    skip.close()
