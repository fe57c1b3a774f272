"""`capskip.steps.sequence_step(head_grad=True)`: the head's gradient comes from the selector's block pass and the
backward skips the head's ∂W product; every parameter's gradient against plain autograd of the kept sequences in
float64 (tied and untied heads, padding_idx, row weights, ignored tokens, temperature, accumulation), with controls."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import capskip.sequence as sequence
from capskip.engine import Engine
from capskip.engine.check import grad_errors
from capskip.sequence import block_gram, kept_grad, row_grads_reference, select_sequences
from capskip.steps import sequence_step

V, D, L, B = 23, 6, 5, 6


class TinyLM(nn.Module):
    "Embedding (tied to the head or not), one causal attention block, a head; rows stay independent."
    def __init__(self, tied=True, bias=False, padding_idx=None, max_norm=None):
        super().__init__()
        self.tok = nn.Embedding(V, D, padding_idx=padding_idx, max_norm=max_norm)
        self.pos = nn.Parameter(torch.randn(L, D) * 0.1)
        self.block = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True, norm_first=True)
        self.head = nn.Linear(D, V, bias=bias)
        if tied: self.head.weight = self.tok.weight

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=self.pos.dtype)
        return self.head(self.block(self.tok(ids) + self.pos[:ids.shape[1]], src_mask=mask, is_causal=True))


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, L), generator=g)
    ids[0, :2] = 0                                      # padding_idx 0 appears
    y = torch.randint(0, V, (B, L), generator=g)
    y[torch.rand(B, L, generator=g) < 0.3] = -100
    y[1] = -100                                         # a row without labelled token
    w = torch.tensor([1.0, 1.0, 2.0, 0.5, 0.0, 1.5], dtype=torch.float64)
    return ids, y, w


def model_of(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyLM(**kw).double()


def reference(model, ids, y, w, drop, T):
    "Plain autograd of the kept sequences: (1/N) Σ_{i kept} w_i Σ_t CE(z_it / T, y_it), N the batch's labelled tokens."
    m = copy.deepcopy(model)
    kept = (~drop).nonzero().flatten()
    N = (y != -100).sum()
    z = m(ids[kept]) / T
    tok = F.cross_entropy(z.flatten(0, 1), y[kept].flatten(), reduction='none', ignore_index=-100).view(len(kept), L)
    ((tok.sum(1) * w[kept]).sum() / N).backward()
    return {n: p.grad for n, p in m.named_parameters()}


def grads(model): return {n: p.grad.clone() for n, p in model.named_parameters()}


class HeadWeightProducts(TorchDispatchMode):
    "Counts matrix products inside autograd's backward whose result has the head weight's shape [V, D] (the head's ∂W)."
    def __init__(self): super().__init__(); self.n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        in_backward = torch._C._current_autograd_node() is not None
        if in_backward and func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default) and tuple(out.shape[-2:]) == (V, D):
            self.n += 1
        return out


@pytest.mark.parametrize('tied,bias,mode', [(True, False, 'masked'), (False, True, 'dense')])
def test_head_grad_from_the_selector_is_exact(tied, bias, mode):
    ids, y, w = batch()
    model = model_of(tied=tied, bias=bias, padding_idx=0)
    for p in model.parameters(): p.grad = torch.full_like(p, 0.25)   # accumulation: the step adds to what is there
    engine = Engine(model, mode=mode)
    st = sequence_step(engine, ids, y, w, head_grad=True, budget=0.6, temperature=2.0)
    assert 0 < st.kept < B and bool(st.drop.any())      # some rows dropped (the test would not see Σ_all vs Σ_kept otherwise)
    got = {n: g - 0.25 for n, g in grads(model).items()}
    ref = reference(model, ids, y, w, st.drop | (w == 0), 2.0)
    worst, rel = grad_errors(got, ref)
    assert worst < 1e-12 and rel < 1e-12, (worst, rel)
    dense = reference(model, ids, y, w, torch.zeros(B, dtype=torch.bool), 2.0)
    assert grad_errors(got, dense)[0] > 1e-3              # control: the dropped rows are not in the gradient


def test_the_backward_skips_the_head_product_and_sigma_all_would_differ(monkeypatch):
    ids, y, w = batch(1)
    counts = {}
    for head_grad in (False, True):
        model = model_of(1, tied=True)
        with HeadWeightProducts() as c: sequence_step(Engine(model, mode='masked'), ids, y, w, head_grad=head_grad, budget=0.6)
        counts[head_grad] = c.n
    assert counts[False] >= 1 and counts[True] == 0, counts   # the backward's ∂W = rᵀh is gone
    model = model_of(1, tied=True)
    original = sequence.kept_grad                        # control: inject Σ_all (nothing dropped) instead of Σ_kept
    monkeypatch.setattr(sequence, 'kept_grad', lambda z, yy, h, drop, *a: original(z, yy, h, torch.zeros_like(drop), *a))
    st = sequence_step(Engine(model, mode='masked'), ids, y, w, head_grad=True, budget=0.6)
    assert bool(st.drop.any())
    ref = reference(model, ids, y, w, st.drop | (w == 0), 1.0)
    assert grad_errors(grads(model), ref)[0] > 1e-3


def test_frozen_head_is_the_plain_step_and_refusals_are_one_line():
    ids, y, w = batch(2)
    model = model_of(2, tied=False)
    model.head.weight.requires_grad_(False)
    st = sequence_step(Engine(model, mode='masked'), ids, y, w, head_grad=True, budget=0.6)
    ref = reference(model, ids, y, w, st.drop | (w == 0), 1.0)
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grad_errors(got, {n: ref[n] for n in got})[0] < 1e-12
    with pytest.raises(ValueError, match="head_grad=True needs a plain engine of mode 'dense' or 'masked'"):
        sequence_step(Engine(model_of(2), mode='reuse'), ids, y, w, head_grad=True)
    with pytest.raises(ValueError, match="module 'tok' \\(Embedding\\) shares the head's weight"):
        sequence_step(Engine(model_of(2, max_norm=1.0), mode='masked'), ids, y, w, head_grad=True)


def test_kept_grad_sides_and_select_sequences_return_grad():
    g = torch.Generator().manual_seed(3)
    z, y, h = torch.randn(5, 4, 9, generator=g, dtype=torch.float64), torch.randint(0, 9, (5, 4), generator=g), \
        torch.randn(5, 4, 3, generator=g, dtype=torch.float64)
    y[2] = -100
    w = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    G = row_grads_reference(z, y, h) * w[:, None, None]
    _, total = block_gram(z, y, h, return_grad=True, grad_weights=w, chunk=4)
    torch.testing.assert_close(total, G.sum(0), rtol=0, atol=1e-14)
    for drop in ([1, 0, 0, 0, 0], [1, 1, 0, 1, 1], [0] * 5, [1] * 5):
        drop = torch.tensor(drop, dtype=torch.bool)
        torch.testing.assert_close(kept_grad(z, y, h, drop, total, w, chunk=4), G[~drop].sum(0), rtol=0, atol=1e-14)
    for method in ('token', 'block'):
        sel, gk = select_sequences(z, y, h, 0.5, method=method, return_grad=True, grad_weights=w)
        assert bool(sel.drop.any())
        torch.testing.assert_close(gk, G[~sel.drop].sum(0), rtol=0, atol=1e-14)
        assert (gk - total).abs().max() > 1e-3           # control: the kept sum is not the total
