"""Python state a `reuse` trace assumed (`capskip.engine._aot.state_change`, `nbs/01e_aot.ipynb`, `nbs/01f_reuse.ipynb`):
a float attribute the forward multiplies by, a flag it branches on, a dropout rate, a LoRA scaling, a plain tensor
attribute reassigned. The traced graph holds such values as constants; before, a change after the first step was
replayed with the old value (a wrong loss and gradient, no word). Now dynamo's guards are checked each step and a broken
one retraces; a value that changes past `MAX_TRACES` traces runs the fallback with one warning. Every step is compared
with float64 autograd of the kept rows' loss; the controls check that nothing else retraces."""
import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from capskip.engine import reuse
from capskip.engine.check import grad_errors, model_grads
from capskip.skip import CAPSkip

TOL = 1e-12     # float64 against float64 autograd: round-off is near 1e-16; a stale constant is off by order 0.1-1


class Net(nn.Module):
    "A two-layer classifier whose forward reads Python state: a float `scale`, a flag `twice`, a tensor `shift`, dropout."
    def __init__(self, p=0.0):
        super().__init__()
        self.a, self.drop, self.fc = nn.Linear(6, 8), nn.Dropout(p), nn.Linear(8, 4)
        self.scale, self.twice, self.shift = 1.0, False, torch.zeros(8, dtype=torch.float64)
    def forward(self, x):
        h = torch.tanh(self.a(x)) * self.scale + self.shift
        if self.twice: h = 2 * h
        return self.fc(self.drop(h))


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(12, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (12,), generator=g)) for _ in range(n)]


def net(p=0.0):
    torch.manual_seed(0)
    return Net(p).double()


def errors_per_step(change, steps=3, p=0.0, budget=0.5, at=None):
    "Train a reuse CAPSkip and a plain copy side by side; `change(model, step)` edits both before each step; per step the (top, global) error of the reuse gradient against autograd of the kept rows (the steps from `at` on)."
    model, ref = net(p), net(p)
    skip = CAPSkip(model, budget=budget, mode='reuse')
    out = []
    for step, (x, y) in enumerate(batches(steps)):
        change(model, step); change(ref, step)
        model.zero_grad(); ref.zero_grad()
        skip.loss(skip(x), y).backward()
        w = skip.last.applied
        (F.cross_entropy(ref(x), y, reduction='none') * w).sum().div(len(y)).backward()
        if at is None or step >= at: out.append(grad_errors(model_grads(model), model_grads(ref)))
    return out, model


def set_scale(m, step): m.scale = 1.0 if step < 2 else 0.3
def set_flag(m, step): m.twice = step >= 2
def set_shift(m, step):
    if step >= 2: m.shift = torch.full((8,), 0.5, dtype=torch.float64)     # reassigned: a new tensor, not a buffer
def set_rate(m, step): m.drop.p = 0.5 if step < 2 else 0.0                 # a dropout schedule that ends


@pytest.mark.parametrize('change', [set_scale, set_flag, set_shift], ids=['float', 'flag', 'tensor attribute'])
def test_a_state_changed_after_the_trace_is_traced_anew(change):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        errs, model = errors_per_step(change)
    assert all(top < TOL and rel < TOL for top, rel in errs), errs
    assert len(reuse.cached_traces(model)) == (1 if change is set_shift else 2)   # a tensor attribute is read, not retraced
    said = [str(w.message) for w in caught if 'retracing Net' in str(w.message)]
    assert len(said) == (0 if change is set_shift else 1), said                  # the retrace is said, once


def test_a_dropout_rate_changed_after_the_trace_is_traced_anew():
    errs, model = errors_per_step(set_rate, steps=3, p=0.5, at=2)   # from the step at p = 0: no randomness to match
    assert all(top < TOL and rel < TOL for top, rel in errs), errs


def test_a_value_changing_every_step_falls_back_past_the_trace_limit_with_one_warning(monkeypatch):
    monkeypatch.setattr(reuse, 'MAX_TRACES', 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        errs, model = errors_per_step(lambda m, step: setattr(m, 'scale', 1.0 + 0.1 * step), steps=5)
    assert all(top < TOL and rel < TOL for top, rel in errs), errs
    assert len(reuse.cached_traces(model)) == 2
    said = [str(w.message) for w in caught if 'keeps changing' in str(w.message)]
    assert len(said) == 1 and 'model.scale == ' in said[0] and 'register_buffer' in said[0], said


def test_an_unchanged_state_is_not_retraced(caplog):
    model = net()
    skip = CAPSkip(model, budget=0.5, mode='reuse')
    with caplog.at_level(logging.INFO, logger='capskip'):
        for x, y in batches(4): skip.loss(skip(x), y).backward()
    assert len(reuse.cached_traces(model)) == 1
    assert not [r for r in caplog.records if 'retracing' in r.getMessage()]


def test_a_hook_added_after_the_trace_is_traced_anew():
    def hook(m, step):
        if step == 2: m.a.register_forward_hook(lambda mod, i, o: o * 0.5)
    errs, model = errors_per_step(hook)
    assert all(top < TOL and rel < TOL for top, rel in errs), errs


def test_a_lora_scaling_changed_after_the_trace_is_traced_anew_on_a_causal_lm():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    def lm():
        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                                            intermediate_size=32, vocab_size=32, max_position_embeddings=16, bos_token_id=0,
                                            eos_token_id=0, pad_token_id=0)).double()
        return get_peft_model(base, LoraConfig(r=2, target_modules=['q_proj', 'v_proj'], lora_dropout=0.0, init_lora_weights=False))
    def rescale(m):
        for mod in m.modules():
            if isinstance(getattr(mod, 'scaling', None), dict): mod.scaling['default'] = 0.25
    model, ref = lm(), lm()
    skip, plain = CAPSkip(model, budget=0.0, mode='reuse'), CAPSkip(ref, budget=0.0, mode='masked')
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(1, 32, (4, 10), generator=g)
        if step == 2: rescale(model); rescale(ref)
        for m, s in ((model, skip), (ref, plain)):
            m.zero_grad(); s.loss(s(input_ids=ids), ids, shift_labels=True).backward()   # Hugging Face's labels: the ids
        top, rel = grad_errors(model_grads(model), model_grads(ref))
        assert top < TOL and rel < TOL, (step, top, rel)
    traces = [t for call in skip.engine.modules() for t in reuse.cached_traces(call)]
    assert len(traces) == 2, traces       # one per scaling: the calls between do not retrace


class Counting(Net):
    "Counts its calls in a Python attribute: state the forward changes itself at every call."
    def __init__(self):
        super().__init__(); self.calls = 0
    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def test_a_forward_that_changes_state_it_reads_runs_the_fallback_at_once():
    def counting():
        torch.manual_seed(0)
        return Counting().double()
    model, ref = counting(), counting()
    skip = CAPSkip(model, budget=0.5, mode='reuse')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for x, y in batches(3):
            model.zero_grad(); ref.zero_grad()
            skip.loss(skip(x), y).backward()
            (F.cross_entropy(ref(x), y, reduction='none') * skip.last.applied).sum().div(len(y)).backward()
            top, rel = grad_errors(model_grads(model), model_grads(ref))
            assert top < TOL and rel < TOL, (top, rel)
    said = [str(w.message) for w in caught if 'changes, at every call' in str(w.message)]
    assert len(said) == 1 and 'model.calls == ' in said[0] and 'HINT' not in said[0], said
    assert len(reuse.cached_traces(model)) == 1 and isinstance(reuse.cached_traces(model)[0], str)   # no trace kept


class Scaled(nn.Module):
    "A classifier whose forward takes a float keyword, as an annealed temperature or mixing coefficient is passed."
    def __init__(self):
        super().__init__(); self.a, self.fc = nn.Linear(6, 8), nn.Linear(8, 4)
    def forward(self, x, scale=1.0): return self.fc(torch.tanh(self.a(x)) * scale)


@pytest.mark.parametrize('mode', ['dense', 'masked', 'reforward', 'reuse'])
def test_a_float_keyword_that_changes_every_step_is_exact_in_every_mode(mode, monkeypatch):
    "Before, each new value was a new input structure: after 16 steps every mode stopped with an error about padding."
    monkeypatch.setattr(reuse, 'MAX_TRACES', 3)                        # the fallback sooner: fewer traces to wait for
    def scaled():
        torch.manual_seed(0)
        return Scaled().double()
    model, ref = scaled(), scaled()
    skip = CAPSkip(model, budget=0.5, mode=mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for step, (x, y) in enumerate(batches(20)):
            scale = 1.0 - 0.03 * step
            model.zero_grad(); ref.zero_grad()
            skip.loss(skip(x, scale=scale), y).backward()
            (F.cross_entropy(ref(x, scale=scale), y, reduction='none') * skip.last.applied).sum().div(len(y)).backward()
            top, rel = grad_errors(model_grads(model), model_grads(ref))
            assert top < TOL and rel < TOL, (step, top, rel)
    said = [str(w.message) for w in caught if 'keeps changing' in str(w.message)]
    retraced = [str(w.message) for w in caught if 'retracing Scaled' in str(w.message)]
    if mode == 'reuse':
        assert len(said) == 1 and "the forward of Scaled" in said[0] and "the call's constant argument 1 ==" in said[0], said
        assert len(retraced) == 1, retraced                              # the first retrace is said; the others are logged
    else: assert said == [] and retraced == []


class Shifted(nn.Module):
    "A classifier whose forward takes tensors without the batch dimension: a 0-d scale and a shift per feature."
    def __init__(self):
        super().__init__(); self.a, self.fc = nn.Linear(6, 8), nn.Linear(8, 4)
    def forward(self, x, tau=None, shift=None): return self.fc(torch.tanh(self.a(x)) * tau + shift)


@pytest.mark.parametrize('mode', ['dense', 'masked', 'reforward', 'reuse'])
def test_tensor_constants_that_change_every_step_are_exact_and_reuse_keeps_one_trace(mode):
    "Before, each new value was a new input structure (keyed by the tensor's values): after 16 steps every mode stopped."
    def shifted():
        torch.manual_seed(0)
        return Shifted().double()
    model, ref = shifted(), shifted()
    skip = CAPSkip(model, budget=0.5, mode=mode)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter('error')                                  # no fallback, no retrace warning
        for step, (x, y) in enumerate(batches(20)):
            tau = torch.tensor(1.0 - 0.03 * step, dtype=torch.float64)
            shift = torch.randn(8, generator=g, dtype=torch.float64)
            model.zero_grad(); ref.zero_grad()
            skip.loss(skip(x, tau=tau, shift=shift), y).backward()
            (F.cross_entropy(ref(x, tau=tau, shift=shift), y, reduction='none') * skip.last.applied).sum().div(len(y)).backward()
            top, rel = grad_errors(model_grads(model), model_grads(ref))
            assert top < TOL and rel < TOL, (step, top, rel)
    traces = [t for call in skip.engine.modules() for t in reuse.cached_traces(call)]
    assert len(traces) == (1 if mode == 'reuse' else 0) and all(not isinstance(t, str) for t in traces), traces


def test_batches_of_a_few_lengths_keep_one_trace_each():
    "A causal LM fed keyword batches padded to a few lengths (pad_to_multiple_of, what the 16-structure refusal advises): one trace per length. Before, each new length's head capture added a hook to lm_head, so every earlier length's trace saw the head's hooks change and was traced anew on its next batch (stop 54)."
    from transformers import LlamaConfig, LlamaForCausalLM
    def lm():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                                            intermediate_size=32, vocab_size=32, max_position_embeddings=32, bos_token_id=0,
                                            eos_token_id=0, pad_token_id=0)).double()
    model, ref = lm(), lm()
    skip = CAPSkip(model, budget=0.5, mode='reuse')
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter('error')                                  # no retrace, no fallback
        for L in (8, 16, 8, 24, 16, 8):
            ids = torch.randint(1, 32, (4, L), generator=g)
            model.zero_grad(); ref.zero_grad()
            skip.loss(skip(input_ids=ids, labels=ids)).backward()
            z = ref(input_ids=ids).logits[:, :-1]
            tok = F.cross_entropy(z.flatten(0, 1), ids[:, 1:].flatten(), reduction='none').view(4, L - 1)
            ((tok.sum(1) * skip.last.applied.double()).sum() / tok.numel()).backward()
            top, rel = grad_errors(model_grads(model), model_grads(ref))
            assert top < TOL and rel < TOL, (L, top, rel)
    traces = [t for call in skip.engine.modules() for t in reuse.cached_traces(call)]
    assert len(traces) == 3 and all(not isinstance(t, str) for t in traces), traces
    assert len(model.lm_head._forward_hooks) == 2                       # the one-tensor call's capture and the keyword calls' one
    skip.close()
    assert len(model.lm_head._forward_hooks) == 0


class KeywordLM(nn.Module):
    "A token model called with keywords (a ModelCall per structure): embedding, tanh, head over 12 tokens."
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(12, 6), nn.Linear(6, 12)
    def forward(self, input_ids): return self.fc(torch.tanh(self.emb(input_ids)))


@pytest.mark.parametrize('mode', ['reuse', 'reforward', 'masked'])
def test_more_lengths_than_max_calls_keep_training_exactly(mode):
    "Dynamic padding (a new length per batch) past `MAX_CALLS` structures: before, the 17th length stopped the run with a ValueError in every mode; now reuse runs later lengths in reforward with one warning, and the other modes, which keep no graph, go on (stop 54)."
    from capskip.engine.facade import MAX_CALLS
    from capskip.engine.executors import Reforward
    def kw():
        torch.manual_seed(0)
        return KeywordLM().double()
    model, ref = kw(), kw()
    skip = CAPSkip(model, budget=0.5, mode=mode)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        for L in range(2, MAX_CALLS + 5):
            ids, y = torch.randint(0, 12, (6, L), generator=g), torch.randint(0, 12, (6, L), generator=g)
            model.zero_grad(); ref.zero_grad()
            skip.loss(skip(input_ids=ids), y).backward()
            tok = F.cross_entropy(ref(ids).flatten(0, 1), y.flatten(), reduction='none').view(6, L)
            ((tok.sum(1) * skip.last.applied.double()).sum() / tok.numel()).backward()
            top, rel = grad_errors(model_grads(model), model_grads(ref))
            assert top < TOL and rel < TOL, (L, top, rel)
    later = [str(w.message) for w in said if 'input structures' in str(w.message)]
    assert len(later) == (1 if mode == 'reuse' else 0), later
    executors = [executor for _, _, executor in skip.engine.calls.values()]
    assert len(executors) == MAX_CALLS + 3
    lean = [type(e) is Reforward for e in executors]
    assert lean == ([False] * MAX_CALLS + [True] * 3 if mode == 'reuse' else [mode == 'reforward'] * (MAX_CALLS + 3))
    skip.close()
