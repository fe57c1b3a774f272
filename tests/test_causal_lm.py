"""Causal-LM rows through the engine and `capskip.CAPSkip`: a row is a sequence, the head an `nn.Linear` over the
last dim ([B, L, d] -> [B, L, V]). One step's gradients equal plain autograd of the kept sequences' loss with the
same normalisation (1/N, N = labelled tokens of the batch) in masked, reforward and reuse (reuse traced, the
backward run on the kept rows only); budget 0 is the dense step; a frozen lm_head keeps the others exact."""
import warnings

import pytest
import torch

import transformers                      # the hf extra (in dev): a missing package fails here, it is never skipped
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import capskip.engine.reuse as reuse
from capskip import CAPSkip
from capskip.engine.check import model_grads
from capskip.testing import grad_errors as errors, sequence_grads   # the zero-gradient-safe metric, the float64 reference
from capskip.engine.reuse import cached_traces

transformers.logging.set_verbosity_error()
B, L, VOCAB = 6, 8, 64
LENGTHS = torch.tensor([8, 6, 8, 3, 8, 5])


def lm(name):
    torch.manual_seed(0)
    if name == 'gpt2':
        return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=16,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                          eos_token_id=0))
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                        hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                        max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def hf_batch():
    "Right-padded ids, their attention mask and Hugging Face's labels (= input_ids, -100 on padding)."
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (B, L), generator=g)
    mask = (torch.arange(L)[None] < LENGTHS[:, None]).long()
    return {'input_ids': ids, 'attention_mask': mask, 'labels': torch.where(mask.bool(), ids, -100)}


def aligned(labels):
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)


def reference(model, batch, applied):
    "Plain autograd on a float64 copy: (1/N) Σ_i applied_i Σ_t CE over labelled tokens, N = labelled tokens of the batch."
    inputs = {'input_ids': batch['input_ids'], 'attention_mask': batch['attention_mask']}
    return sequence_grads(model, inputs, aligned(batch['labels']), applied)


def backward_rows(monkeypatch) -> list:
    "(rows, sliced) of every backward the reuse executor runs."
    seen, real = [], reuse._bw_args
    def spy(traced, specs, saved, tangent, rows):
        seen.append((tangent.shape[0], rows is not None))
        return real(traced, specs, saved, tangent, rows)
    monkeypatch.setattr(reuse, '_bw_args', spy)
    return seen


def step(skip, model, batch):
    model.zero_grad(set_to_none=True)
    logits = skip(**batch)
    loss = skip.loss(logits)
    loss.backward()
    return logits, loss, model_grads(model)


@pytest.mark.parametrize('name', ['gpt2', 'llama'])
@pytest.mark.parametrize('mode', ['masked', 'reforward', 'reuse'])
def test_causal_lm_step_is_exact_for_the_kept_sequences(name, mode, monkeypatch):
    model, batch = lm(name), hf_batch()
    seen = backward_rows(monkeypatch)
    skip = CAPSkip(model, budget=0.5, mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)       # a fallback to reforward / a full backward warns: fail
        logits, loss, got = step(skip, model, batch)
    s = skip.last
    kept = int(s.kept)
    assert logits.shape == (B, L, VOCAB) and skip.features_of(logits).shape == (B, L, 32)
    assert 0 < kept < B and s.drop.sum() == B - kept, (kept, s.drop)
    assert 0 <= float(s.distortion) <= 0.5 + 1e-6
    worst, glob = errors(got, reference(model, batch, s.applied))
    assert worst <= 1e-5 and glob <= 1e-5, (name, mode, worst, glob)
    if mode == 'reuse':
        assert seen == [(max(kept, 2), True)], seen             # the backward ran on the kept sequences only
        entries = [e for m in skip.engine.modules() for e in cached_traces(m)]
        assert entries and all(not isinstance(e, str) and e.fallback_reason is None for e in entries), entries


@pytest.mark.parametrize('mode', ['masked', 'reuse'])
def test_budget_zero_is_the_dense_step_and_hf_loss(mode):
    model, batch = lm('gpt2'), hf_batch()
    skip = CAPSkip(model, budget=0.0, mode=mode)
    _, loss, got = step(skip, model, batch)
    assert int(skip.last.kept) == B and float(skip.last.distortion) == 0.0
    model.zero_grad(set_to_none=True)
    want = model(**batch).loss                                    # Hugging Face's own (shifted) loss
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    assert max(errors(got, model_grads(model))) <= 1e-5


def test_frozen_head_keeps_the_other_gradients_exact():
    model, batch = lm('llama'), hf_batch()
    model.lm_head.weight.requires_grad_(False)                    # the LoRA case: the head is not trained
    skip = CAPSkip(model, budget=0.5, mode='reuse')
    _, _, got = step(skip, model, batch)
    kept = int(skip.last.kept)
    assert 0 < kept < B and 'lm_head.weight' not in got
    assert max(errors(got, reference(model, batch, skip.last.applied))) <= 1e-5


def test_explicit_labels_denominator_and_engine_loss_backward():
    model, batch = lm('gpt2'), hf_batch()
    y, n = aligned(batch['labels']), 40.0
    skip = CAPSkip(model, budget=0.5, mode='reuse')
    inputs = {k: v for k, v in batch.items() if k != 'labels'}
    model.zero_grad(set_to_none=True)
    skip.loss(skip(**inputs), y, denominator=n).backward()        # explicit labels: aligned, not shifted
    got, applied = model_grads(model), skip.last.applied
    ref = reference(model, batch, applied * (y != -100).sum() / n)
    assert max(errors(got, ref)) <= 1e-5
    engine = skip.engine                                          # the engine's own door: loss_backward on [B, L, V]
    for w in (applied, torch.tensor([0.0, 0, 2, 0, 0, 0]), None):   # the selection, one kept row, every row
        model.zero_grad(set_to_none=True)
        kept = engine.loss_backward(engine.forward(**inputs), y, w)
        want = torch.ones(B) if w is None else w
        assert kept == int((want > 0).sum()) and max(errors(model_grads(model), reference(model, batch, want))) <= 1e-5


def test_labels_of_another_shape_are_one_line():
    model, batch = lm('gpt2'), hf_batch()
    skip = CAPSkip(model, budget=0.5, mode='masked')
    logits = skip(input_ids=batch['input_ids'], attention_mask=batch['attention_mask'])
    with pytest.raises(ValueError, match=r'labels must be token ids \[B, L\] = \[6, 8\]') as err:
        skip.loss(logits, batch['labels'][:, :5])
    assert '\n' not in str(err.value)


@pytest.mark.parametrize('mode', ['masked', 'reuse'])
def test_a_topk_gram_drops_sequences_and_the_kept_rows_gradient_is_exact(mode):
    "CAPSkip(model, gram='topk:4') on GPT-2: the certified bounds drop rows, and the step is autograd's over the kept ones."
    model, batch = lm('gpt2'), hf_batch()
    skip = CAPSkip(model, budget=0.6, mode=mode, gram='topk:4')
    _, _, got = step(skip, model, batch)
    s = skip.last
    assert skip.options.gram == 'topk:4' and 0 < int(s.kept) < B, s.drop
    assert s.token_softmax is not None and all(tuple(t.shape) == tuple(batch['labels'].shape) for t in s.token_softmax)   # the split's sums, reused
    worst, glob = errors(got, reference(model, batch, s.applied))
    assert worst <= 1e-5 and glob <= 1e-5, (mode, worst, glob)
    assert errors(got, reference(model, batch, torch.ones(B)))[0] > 1e-3   # the control: the all-kept gradient differs
