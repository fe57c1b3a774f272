"""`torch.compile` with sequence rows: a tiny causal LM ([B, L, V] logits, -100 padding; GPT-2, Llama and Qwen2 with
an attention mask, Llama and Qwen2 with RoPE and grouped-query attention) through `CAPSkip(model, compile=True)` and
through a model compiled before wrapping. One step at budget 0.5 gives plain autograd's float64 gradient of the kept
sequences' loss (1/N, N = labelled tokens of the batch; `capskip.testing.sequence_grads`), sequences really skipped,
the reuse backward traced and run on the kept rows only (no fallback warning)."""
import warnings

import pytest
import torch

import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import capskip.engine.reuse as reuse
from capskip import CAPSkip
from capskip.engine.check import model_grads
from capskip.testing import grad_errors as errors, sequence_grads   # the zero-gradient-safe metric, the float64 reference
from capskip.engine.reuse import cached_traces
from capskip.runs.models import tiny_gpt

transformers.logging.set_verbosity_error()
B, L, VOCAB = 6, 8, 32
LENGTHS = torch.tensor([8, 6, 8, 3, 8, 5])                     # right padding: labels -100 past each length


def model_of(name):
    torch.manual_seed(0)
    if name == 'tiny_gpt': return tiny_gpt(num_classes=VOCAB, dim=16, depth=1, heads=2, max_len=L)
    if name in ('llama', 'qwen2'):     # RoPE, grouped-query attention (2 query heads share each key/value head)
        config, cls = (LlamaConfig, LlamaForCausalLM) if name == 'llama' else (Qwen2Config, Qwen2ForCausalLM)
        return cls(config(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=16,
                          intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=L, bos_token_id=0,
                          eos_token_id=0, pad_token_id=0))
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=L,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def batch_of(name):
    "(forward keywords, aligned labels [B, L]: the next token, -100 on padding and the last position)."
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (B, L), generator=g)
    mask = torch.arange(L)[None] < LENGTHS[:, None]
    y = torch.where(mask, ids, -100)
    y = torch.cat([y[:, 1:], torch.full_like(y[:, :1], -100)], 1)
    if name == 'tiny_gpt': return {'input_ids': ids}, y
    return {'input_ids': ids, 'attention_mask': mask.long()}, y


@pytest.mark.parametrize('name,form', [('tiny_gpt', 'compile=True'), ('gpt2', 'torch.compile'),   # both forms: seconds
                                       ('llama', 'torch.compile'), ('qwen2', 'torch.compile')])
def test_compiled_lm_step_is_exact_for_the_kept_sequences(name, form, monkeypatch, compile_backend):
    if form == 'torch.compile': compile_backend('aot_eager')   # inductor is tested once here, by the tiny_gpt case
    torch._dynamo.reset()
    model, (inputs, y) = model_of(name), batch_of(name)
    seen, real = [], reuse._bw_args
    def spy(traced, specs, saved, tangent, rows):
        seen.append((tangent.shape[0], rows is not None))
        return real(traced, specs, saved, tangent, rows)
    monkeypatch.setattr(reuse, '_bw_args', spy)
    wrapped = torch.compile(model, backend='aot_eager') if form == 'torch.compile' else model   # the user's backend: unused
    skip = CAPSkip(wrapped, budget=0.5, mode='reuse', compile=form == 'compile=True')
    assert skip.engine.executor.compile and skip.engine.model is model  # the user's compile: unwrapped, compiled ours
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)                  # a fallback to reforward / full backward warns
        logits = skip(**inputs)
        skip.loss(logits, y).backward()
    s, got = skip.last, model_grads(model)
    kept = int(s.kept)
    assert logits.shape == (B, L, VOCAB)
    assert 0 < kept < B and int(s.drop.sum()) == B - kept, (kept, s.drop)
    worst, glob = errors(got, sequence_grads(model, inputs, y, s.applied))
    assert worst <= 1e-5 and glob <= 1e-5, (name, form, worst, glob)
    control = errors(got, sequence_grads(model, inputs, y))   # every sequence's gradient: must differ
    assert control[0] > 1e-3, control
    assert seen == [(max(kept, 2), True)], seen                          # the backward ran on the kept sequences only
    entries = [e for m in skip.engine.modules() for e in cached_traces(m)]
    assert entries and all(not isinstance(e, str) and e.fallback_reason is None for e in entries), entries
    skip.close()
