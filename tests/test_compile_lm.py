"""`torch.compile` with sequence rows: a tiny causal LM ([B, L, V] logits, -100 padding, and for GPT-2 an
attention mask) through `CAPSkip(model, compile=True)` and through a model compiled before wrapping. One step at
budget 0.5 gives plain autograd's gradient of the kept sequences' loss (1/N, N = labelled tokens of the batch),
sequences really skipped, the reuse backward traced and run on the kept rows only (no fallback warning)."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import capskip.engine.reuse as reuse
from capskip import CAPSkip
from capskip.engine.check import model_grads
from capskip.engine.reuse import cached_traces
from capskip.runs.models import tiny_gpt

transformers.logging.set_verbosity_error()
B, L, VOCAB = 6, 8, 32
LENGTHS = torch.tensor([8, 6, 8, 3, 8, 5])                     # right padding: labels -100 past each length


def model_of(name):
    torch.manual_seed(0)
    if name == 'tiny_gpt': return tiny_gpt(num_classes=VOCAB, dim=16, depth=1, heads=2, max_len=L)
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


def reference(model, inputs, y, applied):
    "Plain autograd in float64 on a copy: (1/N) Σ_i applied_i Σ_t CE over labelled tokens."
    ref = copy.deepcopy(model).double()
    z = ref(**inputs)
    z = getattr(z, 'logits', z)
    tok = F.cross_entropy(z.reshape(-1, VOCAB), y.reshape(-1), reduction='none').view(B, L)
    ((tok.sum(1) * applied.double()).sum() / (y != -100).sum()).backward()
    return model_grads(ref)


def errors(got, ref):
    "(max |error| / max |reference gradient|, global relative error): safe where gradients are zero."
    diff = torch.cat([(got[n].double() - r).flatten() for n, r in ref.items()])
    allr = torch.cat([r.flatten() for r in ref.values()])
    return float(diff.abs().max() / allr.abs().max()), float(diff.norm() / allr.norm())


@pytest.mark.parametrize('name,form', [('tiny_gpt', 'compile=True'), ('gpt2', 'torch.compile')])  # both forms, both models: seconds
def test_compiled_lm_step_is_exact_for_the_kept_sequences(name, form, monkeypatch):
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
    worst, glob = errors(got, reference(model, inputs, y, s.applied))
    assert worst <= 1e-5 and glob <= 1e-5, (name, form, worst, glob)
    control = errors(got, reference(model, inputs, y, torch.ones(B)))   # every sequence's gradient: must differ
    assert control[0] > 1e-3, control
    assert seen == [(max(kept, 2), True)], seen                          # the backward ran on the kept sequences only
    entries = [e for m in skip.engine.modules() for e in cached_traces(m)]
    assert entries and all(not isinstance(e, str) and e.fallback_reason is None for e in entries), entries
    skip.close()
