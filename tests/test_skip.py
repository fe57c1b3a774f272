"""The door, `capskip.skip` (`nbs/01n_skip.ipynb`): the options object and the keyword form build the same `CAPSkip`,
an unknown keyword is one line naming the valid fields, `skip.options` is a frozen `SkipOptions` the policies replace
per epoch, and `skip.step` on sequence rows (a causal LM) leaves plain autograd's gradient of the kept sequences'
token loss (float64, every mode), which differs from the all-sequences gradient (the control)."""

import pytest
import torch

import transformers                      # the hf extra (in dev): a missing package fails here, it is never skipped
from transformers import GPT2Config, GPT2LMHeadModel

import capskip
from capskip.engine.check import grad_errors as errors, model_grads   # the zero-gradient-safe pair
from capskip.policies import create_policy
from capskip.skip import CAPSkip, SkipOptions, skip_options
from capskip.steps import shifted_labels
from capskip.testing import sequence_grads, tiny_mlp

transformers.logging.set_verbosity_error()
B, L, VOCAB = 6, 8, 64


def test_the_door_is_at_the_top_of_the_package():
    import capskip.policies
    assert capskip.CAPSkip is CAPSkip is capskip.policies.CAPSkip and capskip.CAPSkip.__module__ == 'capskip.skip'
    assert capskip.SkipOptions is SkipOptions and capskip.StepStats is capskip.policies.StepStats


def test_keywords_and_options_object_build_the_same_skip():
    model = tiny_mlp()
    a = CAPSkip(model, budget=0.3, reweight='rw', p=0.25, mode='masked')
    b = CAPSkip(model, SkipOptions(budget=0.3, reweight='rw', p=0.25), mode='masked')
    c = CAPSkip(model, SkipOptions(budget=0.9), budget=0.3, reweight='rw', p=0.25, mode='masked')   # a keyword overrides
    assert a.options == b.options == c.options and isinstance(a.options, SkipOptions)
    assert a.options != CAPSkip(model, budget=0.2, mode='masked').options                              # the control
    assert (a.label_smoothing, a.temperature, a.ignore_index) == (0.0, 1.0, -100)
    with pytest.raises(Exception, match='cannot assign'): a.options.budget = 0.1                     # frozen
    for s in (a, b, c): s.close()


def test_unknown_keyword_is_one_line_naming_the_fields():
    with pytest.raises(TypeError) as e: CAPSkip(tiny_mlp(), bugdet=0.1)
    msg = str(e.value)
    assert '\n' not in msg and "['bugdet']" in msg and 'budget, weighted' in msg and 'candidates' in msg and 'mode' in msg
    with pytest.raises(TypeError, match='options must be a SkipOptions'): CAPSkip(tiny_mlp(), 0.1)
    with pytest.raises(ValueError, match='budget must be a number'): skip_options(budget=-1)
    with pytest.raises(ValueError, match='budget must be a number'): SkipOptions().replace(budget=-1)
    with pytest.raises(ValueError, match='label_smoothing must be a number in'): SkipOptions(label_smoothing=2.0)
    with pytest.raises(ValueError, match='unknown candidate rule'): SkipOptions(candidates='some')


@pytest.mark.parametrize('mode', ['reuse', 'reforward', 'masked'])
def test_a_label_out_of_range_at_the_door_is_named(mode):
    "A label ≥ C (a head with fewer outputs than classes) is one line naming it and its row; the door takes -100 rows."
    skip = CAPSkip(tiny_mlp(in_features=6, num_classes=5), mode=mode)
    x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 5
    with pytest.raises(ValueError) as e: skip.loss(skip(x), torch.where(torch.arange(8) == 2, 7, y))
    msg = str(e.value)
    assert '\n' not in msg and 'must lie in [0, 5)' in msg and 'got [7] at rows [2]' in msg and 'not supported' not in msg
    y[2] = -100                                          # what the line says the door takes: left out of the loss
    skip.loss(skip(x), y).backward()
    assert float(skip.last.applied[2]) == 0.0


def test_policy_ramp_replaces_the_options_budget():
    pol = create_policy('capskip', tiny_mlp(), mode='masked', budget=0.4, ramp_epochs=4)
    budgets = []
    for epoch in range(3):
        pol.plan_epoch(epoch, 3, 16, 8)
        budgets.append(pol.core.options.budget)
    assert budgets == pytest.approx([0.1, 0.2, 0.3]) and isinstance(pol.core.options, SkipOptions)
    pol.close()


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)).double()


def hf_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (B, L), generator=g)
    mask = (torch.arange(L)[None] < torch.tensor([8, 6, 8, 3, 8, 5])[:, None]).long()
    return {'input_ids': ids, 'attention_mask': mask, 'labels': torch.where(mask.bool(), ids, -100)}


def kept_grads(model, batch, keep, weights=None):
    "Plain autograd on a float64 copy: (1/N) Σ_i keep_i w_i Σ_t CE over labelled tokens (shifted labels), N = labelled tokens."
    w = keep.double() * (1.0 if weights is None else weights.double())
    inputs = {'input_ids': batch['input_ids'], 'attention_mask': batch['attention_mask']}
    return sequence_grads(model, inputs, shifted_labels(batch['labels']), w)


@pytest.mark.parametrize('mode', ['masked', 'reforward', 'reuse'])
def test_sequence_step_is_autograd_of_the_kept_sequences(mode):
    model, batch = gpt2(), hf_batch()
    skip = CAPSkip(model, budget=0.5, mode=mode)
    model.zero_grad(set_to_none=True)
    st = skip.step(batch)                                        # labels from the batch: shifted as HF's loss shifts them
    assert isinstance(st.kept, int) and 0 < st.kept < B and st.forwarded == B and skip.last is st
    keep = st.applied > 0
    assert st.kept == int(keep.sum()) and float(st.distortion) <= 0.5 + 1e-9
    got = model_grads(model)
    assert max(errors(got, kept_grads(model, batch, keep))) < 1e-12
    assert errors(got, kept_grads(model, batch, torch.ones(B, dtype=torch.bool)))[1] > 1e-3   # the control: all kept
    assert skip.counters()['rows_backprop'] == st.kept
    skip.close()


def test_sequence_step_with_explicit_aligned_labels_and_weights():
    model, batch = gpt2(), hf_batch()
    y = shifted_labels(batch['labels'])
    w = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 3.0])
    skip = CAPSkip(model, budget=0.0, mode='reuse')
    model.zero_grad(set_to_none=True)
    st = skip.step({'input_ids': batch['input_ids'], 'attention_mask': batch['attention_mask']}, y, weights=w)
    assert st.kept == B                                          # budget 0: every sequence with a gradient kept
    assert max(errors(model_grads(model), kept_grads(model, batch, torch.ones(B, dtype=torch.bool), w))) < 1e-12
    with pytest.raises(ValueError, match=r'labels must be token ids \[B, L\] = \[6, 8\]'):
        skip.step(batch['input_ids'], y[:, :5].contiguous().view(B, 5))
    skip.close()
