"""A model that multiplies its head's output by one number (a temperature inside `forward`, Cohere's `logit_scale`,
Granite's `logits_scaling`) or soft-caps it (Gemma 2's `final_logit_softcapping`) was refused in every mode. The rule
is scale-invariant, and a soft cap multiplies each residual by 1 − (z/c)² (01b_head, "One number times the head's
output"), so they now run: each test checks the bound on the *true* head gradient by float64 autograd per row, and
the kept rows' gradient against float64 autograd. The two paths that write the head's gradient themselves refuse a
mapped head in one line."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from capskip import CAPSkip
from capskip.engine import Engine
from capskip.engine.check import model_grads
from capskip.engine.head import LogitMap
from capskip.core import ce_residuals
from capskip.selector import select
from capskip.sequence import select_sequences
from capskip.steps import sequence_step
from capskip.testing import grad_errors
from capskip.testing.oracles import sequence_grads

B, L, V = 6, 8, 64
LENGTHS = torch.tensor([8, 6, 8, 3, 8, 5])


def lm(name: str) -> nn.Module:
    import transformers as tf
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == 'cohere': model = tf.CohereForCausalLM(tf.CohereConfig(**common, logit_scale=0.0625))
    elif name == 'granite': model = tf.GraniteForCausalLM(tf.GraniteConfig(**common, logits_scaling=4.0, embedding_multiplier=2.0,
                                                                            residual_multiplier=0.5, attention_multiplier=0.25))
    else:       # Gemma 2 with a cap of 1 and a head 50x its init: saturated logits, where the cap's factor decides the rule
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=8, final_logit_softcapping=1.0, sliding_window=4,
                                                     attn_implementation='eager', tie_word_embeddings=False))
        with torch.no_grad(): model.lm_head.weight.mul_(50.0)
    return model.double()


def lm_batch(padded: bool = True) -> dict:
    "Right-padded rows (Gemma 2's own float64 forward is not finite on padded rows, so it gets full rows)."
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (B, L), generator=g)
    mask = (torch.arange(L)[None] < (LENGTHS if padded else torch.full_like(LENGTHS, L))[:, None]).long()
    return {'input_ids': ids, 'attention_mask': mask, 'labels': torch.where(mask.bool(), ids, -100)}


def shifted(labels):
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)


def head_distortion(row_grads: torch.Tensor, applied: torch.Tensor) -> float:
    "‖Σ_dropped G_i‖ / ‖Σ_i G_i‖ of the rows' true head gradients [B, ...] (float64)."
    dropped = row_grads[applied == 0].sum(0)
    return float(dropped.norm() / row_grads.sum(0).norm())


def lm_row_head_grads(model, data) -> torch.Tensor:
    "Each row's gradient of (1/N) Σ_t CE at the head's weight, by float64 autograd of the whole model (scale included)."
    y = shifted(data['labels'])
    N = (y != -100).sum()
    head = model.get_output_embeddings().weight
    grads = []
    for i in range(B):
        z = model(input_ids=data['input_ids'][i:i + 1], attention_mask=data['attention_mask'][i:i + 1]).logits
        loss = F.cross_entropy(z[0], y[i], ignore_index=-100, reduction='sum') / N
        grads.append(torch.autograd.grad(loss, head)[0])
    return torch.stack(grads)


MAPS = {'cohere': LogitMap(('mul',)), 'granite': LogitMap(('div',)), 'gemma2': LogitMap(('div', 'tanh', 'mul'), 1.0)}


@pytest.mark.parametrize('mode', ['reuse', 'reforward', 'masked'])
@pytest.mark.parametrize('name', ['cohere', 'granite', 'gemma2'])
def test_a_scaled_or_capped_causal_lm_meets_the_bound_on_its_true_head_gradient(name, mode):
    data, budget = lm_batch(padded=name != 'gemma2'), 0.5
    model = lm(name)
    skip = CAPSkip(model, budget=budget, mode=mode)
    z = skip(**data)
    skip.loss(z).backward()
    applied = skip.last.applied.detach().clone()
    assert skip.engine.last_capture.logit_map == MAPS[name]
    got, feats = model_grads(model), skip.features_of(z)
    skip.close()
    assert 0 < int((applied == 0).sum()) < B                       # the rule dropped rows: the bound is not vacuous
    fresh = lm(name)
    rows = lm_row_head_grads(fresh, data)
    assert head_distortion(rows, applied) <= budget * (1 + 1e-9)
    if name == 'gemma2':                                           # the same rule without the cap's factor breaks the bound
        plain = select_sequences(z.detach(), shifted(data['labels']), feats, budget, 'all', bias=False)
        assert head_distortion(rows, (~plain.drop).double()) > budget
    ref = sequence_grads(fresh, {k: data[k] for k in ('input_ids', 'attention_mask')}, shifted(data['labels']), applied)
    worst, overall = grad_errors(got, ref)
    tol = 1e-10 if name == 'granite' else 1e-6     # Cohere's LayerNorm and Gemma's RMSNorm compute in float32 in a float64 model
    assert worst <= tol and overall <= tol, (worst, overall)


class Tempered(nn.Module):
    "A classifier that divides its head's output by a temperature in forward()."
    def __init__(self, T=0.5):
        super().__init__()
        self.body, self.fc, self.T = nn.Sequential(nn.Linear(10, 16), nn.Tanh()), nn.Linear(16, 4), T

    def forward(self, x): return self.fc(self.body(x)) / self.T


def classifier_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 10, generator=g, dtype=torch.float64), torch.randint(0, 4, (16,), generator=g)


@pytest.mark.parametrize('mode', ['reuse', 'reforward', 'masked'])
def test_a_temperature_inside_a_classifier_meets_the_bound_on_its_true_head_gradient(mode):
    torch.manual_seed(0)
    model, (x, y), budget = Tempered().double(), classifier_batch(), 0.3
    skip = CAPSkip(model, budget=budget, mode=mode)
    skip.loss(skip(x), y).backward()
    applied = skip.last.applied.detach().clone()
    got = model_grads(model)
    skip.close()
    assert 0 < int((applied == 0).sum()) < len(y)
    fresh = Tempered().double(); fresh.load_state_dict(model.state_dict())
    rows = torch.stack([torch.autograd.grad(F.cross_entropy(fresh(x[i:i + 1]), y[i:i + 1]) / len(y), fresh.fc.weight)[0]
                        for i in range(len(y))])
    assert head_distortion(rows, applied) <= budget * (1 + 1e-9)
    fresh.zero_grad()
    ((F.cross_entropy(fresh(x), y, reduction='none') * applied).sum() / len(y)).backward()
    worst, overall = grad_errors(got, model_grads(fresh))
    assert worst <= 1e-12 and overall <= 1e-12


class Capped(nn.Module):
    "A classifier that soft-caps its head's output, c·tanh(u/c), with a head 10x its init: saturated logits."
    def __init__(self, c=1.0):
        super().__init__()
        self.body, self.fc, self.c = nn.Sequential(nn.Linear(10, 16), nn.Tanh()), nn.Linear(16, 4), c
        with torch.no_grad(): self.fc.weight.mul_(10.0)

    def forward(self, x): return self.c * torch.tanh(self.fc(self.body(x)) / self.c)


@pytest.mark.parametrize('path', ['loss', 'step'])
@pytest.mark.parametrize('mode', ['reuse', 'reforward', 'masked'])
def test_a_soft_capped_classifier_meets_the_bound_on_its_true_head_gradient(mode, path):
    torch.manual_seed(1)
    model, budget, B = Capped().double(), 0.3, 32
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, 10, generator=g, dtype=torch.float64), torch.randint(0, 4, (B,), generator=g)
    fresh = Capped().double(); fresh.load_state_dict(model.state_dict())
    skip = CAPSkip(model, budget=budget, mode=mode)
    if path == 'loss': skip.loss(skip(x), y).backward()
    else: skip.step(x, y)
    applied = skip.last.applied.detach().clone()
    got = model_grads(model)
    skip.close()
    head = (fresh.fc.weight, fresh.fc.bias)
    rows = torch.stack([torch.cat([t.flatten() for t in torch.autograd.grad(F.cross_entropy(fresh(x[i:i + 1]), y[i:i + 1]) / B, head)])
                        for i in range(B)])
    assert 0 < int((applied == 0).sum()) < B
    assert head_distortion(rows, applied) <= budget * (1 + 1e-9)
    z = fresh(x).detach()                                          # the same rule without the cap's factor breaks the bound
    plain = select(ce_residuals(z, y), torch.tanh(fresh.body[0](x)).detach(), z.argmax(1) == y, budget)
    assert head_distortion(rows, (~plain.drop).double()) > budget
    fresh.zero_grad()
    ((F.cross_entropy(fresh(x), y, reduction='none') * applied).sum() / B).backward()
    worst, overall = grad_errors(got, model_grads(fresh))
    assert worst <= 1e-12 and overall <= 1e-12


def test_paths_that_write_the_head_gradient_refuse_a_scaled_head_in_one_line():
    torch.manual_seed(0)
    x, y = classifier_batch()
    skip = CAPSkip(Tempered().double(), budget=0.3, reweight='det_lastfix', mode='masked')
    with pytest.raises(ValueError) as err:
        skip.loss(skip(x), y)
    msg = str(err.value)
    assert '\n' not in msg and "reweight='det_lastfix'" in msg and '(div after the head)' in msg and "'det_scale'" in msg
    with pytest.raises(ValueError, match="det_lastfix.*div after the head"):
        skip.step(x, y)
    model, data = lm('cohere'), lm_batch()
    with pytest.raises(ValueError) as err:
        sequence_step(Engine(model, 'masked'), data['input_ids'], shifted(data['labels']), head_grad=True)
    assert '\n' not in str(err.value) and 'head_grad=True' in str(err.value) and '(mul after the head)' in str(err.value)
    model, data = lm('gemma2'), lm_batch(padded=False)
    with pytest.raises(ValueError, match=r"head_grad=True .*\(div, tanh, mul after the head\)"):
        sequence_step(Engine(model, 'masked'), data['input_ids'], shifted(data['labels']), head_grad=True)
    with pytest.raises(ValueError, match="soft-capped logits .* need an exact Gram: gram='auto'"):
        skip = CAPSkip(model, gram='topk', mode='masked')
        skip.loss(skip(**data))
