"""Inputs that require grad (`capskip.engine.inputs.pack_inputs`, `nbs/01l_inputs.ipynb`; the refusal in
`capskip.engine.facade`): embeddings computed outside a causal LM (`inputs_embeds=embed(ids)`), a classifier's input
passed by keyword, a trained tensor without a batch dimension. In `dense` and `masked` they get plain autograd's
gradient; the skipping modes refuse them in one line. Before, every keyword input travelled detached: the embedding
table, the input and the trained tensor got no gradient in any mode, with no word."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from capskip.engine.check import grad_errors, model_grads
from capskip.engine.facade import MAX_CALLS
from capskip.skip import CAPSkip

transformers.logging.set_verbosity_error()
B, L, V = 6, 10, 64
TOL = 1e-12     # float64 against float64 autograd: round-off is near 1e-16, a lost gradient is of order 1


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)).double()


def lm_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (B, L), generator=g)
    mask = (torch.arange(L)[None] < torch.tensor([10, 7, 10, 4, 10, 6])[:, None]).long()
    return ids, mask, torch.where(mask.bool(), ids, -100)


def kept_loss(z, labels, applied):
    "(1/N) Σ_i a_i Σ_t CE over the shifted labels: what skip.loss back-propagates."
    y = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    tok = F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction='none', ignore_index=-100).view(y.shape)
    return (tok.sum(1) * applied).sum() / (y != -100).sum()


@pytest.mark.parametrize('mode', ['dense', 'masked'])
def test_inputs_embeds_computed_outside_the_model(mode):
    ids, mask, labels = lm_batch()
    model = llama()
    skip = CAPSkip(model, budget=0.5, mode=mode)
    z = skip(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask, labels=labels)
    skip.loss(z).backward()
    applied = skip.last.applied
    ref = llama()
    kept_loss(ref(inputs_embeds=ref.get_input_embeddings()(ids), attention_mask=mask).logits, labels, applied).backward()
    got, want = model_grads(model), model_grads(ref)
    assert want['model.embed_tokens.weight'].abs().max() > 0.01       # the gradient the old code dropped
    top, rel = grad_errors(got, want)
    assert top < TOL and rel < TOL, (mode, top, rel)
    if mode == 'masked': assert 0 < int((applied > 0).sum()) < B     # some rows dropped, so the test sees the weights


@pytest.mark.parametrize('mode', ['reuse', 'reforward'])
def test_skipping_modes_refuse_an_input_that_requires_grad(mode):
    ids, mask, labels = lm_batch()
    model = llama()
    skip = CAPSkip(model, budget=0.5, mode=mode)
    with pytest.raises(ValueError, match=r'no gradient for the input inputs_embeds .*mode="masked"') as e:
        skip(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask, labels=labels)
    assert '\n' not in str(e.value)
    with torch.no_grad():                                               # no graph recorded: evaluation runs
        z = skip(inputs_embeds=model.get_input_embeddings()(ids).requires_grad_(), attention_mask=mask)
        torch.testing.assert_close(z, model(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=1e-12)
    z = skip(input_ids=ids, attention_mask=mask, labels=labels)         # the same model by token ids still skips
    skip.loss(z).backward()
    assert int((skip.last.applied > 0).sum()) < B


class Scaled(nn.Module):
    "A classifier whose hidden layer is multiplied by a tensor passed in (no batch dimension)."
    def __init__(self):
        super().__init__(); self.body, self.fc = nn.Linear(6, 8), nn.Linear(8, 4)
    def forward(self, x, scale=None):
        h = torch.tanh(self.body(x))
        return self.fc(h if scale is None else h * scale)


def digits_like():
    g = torch.Generator().manual_seed(0)
    return torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (10,), generator=g)


@pytest.mark.parametrize('mode', ['dense', 'masked'])
def test_a_keyword_input_and_a_trained_constant_get_their_gradients(mode):
    X, Y = digits_like()
    torch.manual_seed(0); model = Scaled().double()
    torch.manual_seed(0); ref = Scaled().double()
    scale = torch.ones(8, dtype=torch.float64, requires_grad=True)
    skip = CAPSkip(model, budget=0.5, mode=mode)
    for step in range(MAX_CALLS + 2):                                   # the constant changes every step: one call structure
        x, xr, s = X.clone().requires_grad_(), X.clone().requires_grad_(), scale.detach().clone().requires_grad_()
        z = skip(x=x, scale=scale)
        skip.loss(z, Y).backward()
        applied = skip.last.applied
        zr = ref(xr, scale=s)
        (F.cross_entropy(zr, Y, reduction='none') * applied).sum().div(len(Y)).backward()
        got = {'x': x.grad, 'scale': scale.grad, **model_grads(model)}
        want = {'x': xr.grad, 'scale': s.grad, **model_grads(ref)}
        assert got['x'] is not None and got['scale'] is not None
        top, rel = grad_errors(got, want)
        assert top < TOL and rel < TOL, (mode, step, top, rel)
        with torch.no_grad(): scale -= 0.1 * scale.grad
        for m in (model, ref): m.zero_grad()
        scale.grad = None
    assert len(skip.engine.calls) == 1


def test_the_call_does_not_hold_its_inputs_past_the_forward():
    ids, mask, labels = lm_batch()
    model = llama()
    skip = CAPSkip(model, budget=0.5, mode='masked')
    z = skip(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask, labels=labels)
    assert all(call.spec.live is None for call, _, _ in skip.engine.calls.values())
    skip.loss(z).backward()
