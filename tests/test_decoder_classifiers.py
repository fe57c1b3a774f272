"""Decoder classifiers pool their head's output at each row's last non-pad token (`logits[arange(B), last]`): GPT-2 and
Llama `*ForSequenceClassification` run in `reuse` traced (no fallback), skip the dropped rows in the backward, and give
plain autograd's gradient of the kept rows, with the gathered head inputs as the features; the encoder-decoder
classifiers (Bart, T5), whose end-of-sequence pooling has a data-dependent size, run exact over all rows."""
import warnings

import pytest
import torch

import transformers                      # the hf extra (in dev): a missing package fails here, it is never skipped
from transformers import (BartConfig, BartForSequenceClassification, GPT2Config, GPT2ForSequenceClassification,
                          LlamaConfig, LlamaForSequenceClassification, T5Config, T5ForSequenceClassification)

import capskip.engine.reuse as reuse
from capskip.engine import Engine
from capskip.engine.check import autograd_grads, grad_errors, model_grads
from capskip.engine.reuse import cached_traces

B, T, VOCAB, C = 8, 7, 50, 3
LENGTHS = torch.tensor([7, 5, 3, 7, 2, 6, 4, 1])
KEEPS = {'k=3': torch.tensor([1., 0, 1, 0, 0, 1, 0, 0]), 'k=1 weighted': torch.tensor([0., 0, 0, 0, 2, 0, 0, 0]),
         'k=6 weighted': torch.tensor([0.5, 1, 1, 2, 0, 1, 1, 0]), 'k=B': None}


def decoder(name):
    torch.manual_seed(0)
    if name == 'gpt2':
        return GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=32,
                                                        num_labels=C, pad_token_id=0, bos_token_id=1, eos_token_id=1,
                                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return LlamaForSequenceClassification(LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                      hidden_size=16, intermediate_size=32, vocab_size=VOCAB,
                                                      max_position_embeddings=32, num_labels=C, pad_token_id=0,
                                                      bos_token_id=1, eos_token_id=1))


def encoder_decoder(name):
    torch.manual_seed(0)
    if name == 'bart':
        return BartForSequenceClassification(BartConfig(
            vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, num_labels=C,
            pad_token_id=1, eos_token_id=2, bos_token_id=0, decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, classifier_dropout=0.0))
    return T5ForSequenceClassification(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                                num_decoder_layers=1, num_heads=2, num_labels=C, pad_token_id=0,
                                                eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.0,
                                                classifier_dropout=0.0))


def padded_batch(pad, eos=None):
    "Right-padded token ids (row i has LENGTHS[i] tokens, the last one `eos` if given), its attention mask and labels."
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = (torch.arange(T)[None] < LENGTHS[:, None]).long()
    if eos is not None: ids[torch.arange(B), LENGTHS - 1] = eos
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))
    return {'input_ids': ids, 'attention_mask': mask}, torch.randint(0, C, (B,), generator=g)


def sliced_rows(monkeypatch) -> list:
    "The row count of every backward the reuse executor runs (a sliced one at k rows, the unsliced one at B)."
    seen, real = [], reuse._bw_args
    def spy(traced, specs, saved, tangent, rows):
        seen.append((tangent.shape[0], rows is not None))
        return real(traced, specs, saved, tangent, rows)
    monkeypatch.setattr(reuse, '_bw_args', spy)
    return seen


def engine_step(engine, batch, y, w):
    engine.model.zero_grad(set_to_none=True)
    fwd = engine.forward(**batch)
    kept = engine.loss_backward(fwd, y, w)
    return fwd, kept, model_grads(engine.model)


@pytest.mark.parametrize('name', ['gpt2', 'llama'])
def test_decoder_classifier_in_reuse_is_exact_skips_rows_and_is_traced(name, monkeypatch):
    model = decoder(name)
    batch, y = padded_batch(pad=0)
    seen = sliced_rows(monkeypatch)
    engine = Engine(model, 'reuse')
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)     # a fallback to reforward / full backward warns: fail on it
        for case, w in KEEPS.items():
            ref = autograd_grads(model, batch, y, w)
            seen.clear()
            fwd, kept, got = engine_step(engine, batch, y, w)
            assert kept == (B if w is None else int((w > 0).sum()))
            err, glob = grad_errors(got, ref)
            assert err <= 1e-5 and glob <= 1e-5, f'{name} {case}: {err:.2e} {glob:.2e}'
            want_rows = B if kept == B else max(kept, 2)        # one kept row runs as two half-weight copies
            assert seen == [(want_rows, kept < B)], (case, seen)
    assert engine.head is model.score and fwd.logits.shape == (B, C)
    with torch.no_grad():                                 # the features: the head's input at each row's last token
        hidden = model.base_model(**batch).last_hidden_state
    torch.testing.assert_close(fwd.features, hidden[torch.arange(B), LENGTHS - 1], rtol=1e-5, atol=1e-6)
    entries = [e for m in engine.modules() for e in cached_traces(m)]
    assert entries and all(not isinstance(e, str) and e.fallback_reason is None for e in entries), entries


@pytest.mark.parametrize('mode', ['masked', 'reforward'])
def test_decoder_classifier_in_the_eager_modes_gives_the_same_gradient(mode):
    model = decoder('gpt2')
    batch, y = padded_batch(pad=0)
    w = KEEPS['k=3']
    ref = autograd_grads(model, batch, y, w)
    fwd, kept, got = engine_step(Engine(model, mode), batch, y, w)
    assert kept == 3 and max(grad_errors(got, ref)) <= 1e-5
    assert fwd.features.shape == (B, 16)


@pytest.mark.parametrize('name', ['bart', 't5'])
def test_encoder_decoder_classifier_in_reuse_is_exact_over_all_rows(name):
    "Their pooling `hidden[eos_mask].view(B, -1, d)[:, -1]` has a size set by the data: the backward runs over all rows."
    model = encoder_decoder(name)
    cfg = model.config
    batch, y = padded_batch(pad=cfg.pad_token_id, eos=cfg.eos_token_id)
    w = KEEPS['k=3']
    ref = autograd_grads(model, batch, y, w)
    engine = Engine(model, 'reuse')
    with pytest.warns(RuntimeWarning, match='runs over all rows'):   # said, not only logged
        fwd, kept, got = engine_step(engine, batch, y, w)
    assert kept == 3 and fwd.features.shape == (B, 16)
    assert fwd.all_rows                                  # and recorded on the step
    err, glob = grad_errors(got, ref)
    assert err <= 1e-5 and glob <= 1e-5, f'{name}: {err:.2e} {glob:.2e}'
    reasons = [e if isinstance(e, str) else e.fallback_reason for m in engine.modules() for e in cached_traces(m)]
    assert reasons and all('depends on the values in the batch' in str(r) for r in reasons), reasons


def test_all_rows_backward_takes_the_gradient_itself_and_pads_a_single_row(monkeypatch):
    "The unsliced backward gets the upstream gradient itself when every row is kept (no [B, ...] copy), and a batch of one (traced as two rows) gets a zero second row; both exact against autograd."
    model = encoder_decoder('bart')
    cfg = model.config
    batch, y = padded_batch(pad=cfg.pad_token_id, eos=cfg.eos_token_id)
    seen, real = [], reuse._bw_args
    def spy(traced, specs, saved, tangent, rows):
        seen.append(tangent)
        return real(traced, specs, saved, tangent, rows)
    monkeypatch.setattr(reuse, '_bw_args', spy)
    handed = []
    real_loss = reuse.Reuse.backward_graph
    def keep_grad(self, st, grad_logits, keep, kept):
        handed.append(grad_logits)
        return real_loss(self, st, grad_logits, keep, kept)
    monkeypatch.setattr(reuse.Reuse, 'backward_graph', keep_grad)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for rows in (slice(None), slice(0, 1)):
            part = {k: v[rows] for k, v in batch.items()}
            ref = autograd_grads(model, part, y[rows], None)
            seen.clear(); handed.clear()
            fwd, kept, got = engine_step(Engine(model, 'reuse'), part, y[rows], None)
            err, glob = grad_errors(got, ref)
            assert kept == part['input_ids'].shape[0] and err <= 1e-5 and glob <= 1e-5, (rows, err, glob)
            assert len(seen) == 1 and len(handed) == 1
            if kept == B: assert seen[0] is handed[0]                     # the gradient itself
            else: assert seen[0].shape[0] == 2 and torch.equal(seen[0][0], handed[0][0]) and not seen[0][1].any()
