"""`CAPSkipTrainer` on causal language models (tiny `GPT2LMHeadModel` / `LlamaForCausalLM` from configs, offline): at
`capskip={'budget': 0}` it trains the weights `transformers.Trainer` trains from the same initialisation and data order
— gradient accumulation (the Trainer's `num_items_in_batch`: labelled tokens of the accumulated batch after the label
shift), right padding (`attention_mask`, `-100` labels), `max_grad_norm` clipping, PEFT LoRA with a frozen `lm_head`,
gradient checkpointing —; at budget 0.5 one LoRA step is plain autograd of the kept sequences' loss and the logged kept
fraction is below 1. Each comparison has a control that shows it can fail. Modes: `masked` for the budget-0 parities
(the glue does not depend on the mode; `tests/test_causal_lm.py` checks every mode's gradient), `reforward` where rows
are dropped (the backward then runs on the kept sequences only); `reuse`'s first trace of a causal LM takes 15-30 s."""
import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import transformers                      # the hf extra (in dev): a missing package fails here, it is never skipped
from peft import LoraConfig, get_peft_model
from transformers import (BertConfig, BertForTokenClassification, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          PrinterCallback, TrainerCallback, TrainingArguments)

from capskip.engine.check import grad_errors, model_grads
from capskip.integrations.hf import CAPSkipTrainer, check_classifier, is_causal_lm, loss_reduction

pytestmark = [pytest.mark.filterwarnings('error::RuntimeWarning'),      # a fallback to a full backward warns
              pytest.mark.filterwarnings('ignore:`is_gradient_checkpointing` is deprecated:FutureWarning'),   # PEFT 0.21 on
              pytest.mark.filterwarnings('ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning')]  # transformers 5
logging.getLogger('transformers').setLevel(logging.ERROR)
VOCAB, L, ROWS = 64, 12, 32


def lm(name: str) -> torch.nn.Module:
    "A 2-layer causal LM of width 32 over 64 tokens, dropout 0 (two forwards compute the same function)."
    torch.manual_seed(0)
    if name == 'gpt2':
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                                        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=0,
                                        eos_token_id=0, pad_token_id=0))


def counting_rows(n: int = ROWS, seed: int = 1) -> list[dict]:
    "Rows that count up by one from a random start (mod 63, tokens 1-63), right-padded to 12 with 4-12 real tokens."
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB - 1, (n, 1), generator=g)
    ids = (start + torch.arange(L)) % (VOCAB - 1) + 1
    lengths = torch.randint(4, L + 1, (n,), generator=g)
    mask = (torch.arange(L)[None] < lengths[:, None]).long()
    ids = ids * mask
    labels = torch.where(mask.bool(), ids, -100)
    return [{'input_ids': ids[i], 'attention_mask': mask[i], 'labels': labels[i]} for i in range(n)]


def stacked(rows: list[dict]) -> dict:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


@pytest.fixture(scope='module')
def data():
    return counting_rows()


@pytest.fixture(scope='module')
def counted(data):
    "A Llama trained 40 Adam steps on the counting rows: it predicts most next tokens (so shifting the labels matters)."
    model, batch = lm('llama'), stacked(data)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(40):
        model(**batch).loss.backward(); opt.step(); opt.zero_grad()
    return model


def lora(model: torch.nn.Module) -> torch.nn.Module:
    "LoRA (rank 4, no dropout) on the attention projections; everything else, the lm_head included, frozen."
    targets = ['c_attn'] if isinstance(model, GPT2LMHeadModel) else ['q_proj', 'v_proj']
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type='CAUSAL_LM',
                                            fan_in_fan_out=isinstance(model, GPT2LMHeadModel)))


def arguments(folder, **args) -> TrainingArguments:
    options = dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=2, learning_rate=0.5, optim='sgd',
                   max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy='no', disable_tqdm=True, seed=0)
    return TrainingArguments(str(folder), **{**options, **args})


def side_by_side(base, data, tmp_path, capskip=None, skipping=CAPSkipTrainer, prepare=None, **args):
    """The parameter change after 2 SGD steps of `Trainer` and of `skipping(capskip=...)` (default: budget 0, masked; None: the
    Trainer's alone) from
    copies of `base` (`prepare`d: gradient checkpointing) on the same data order (the Trainer's seeded sampler)."""
    moved, runs = [], [(transformers.Trainer, {})]
    if skipping is not None: runs.append((skipping, {'capskip': {'budget': 0.0, 'mode': 'masked', **(capskip or {})}}))
    for cls, extra in runs:
        model = copy.deepcopy(base)
        if prepare is not None: model = prepare(model)
        start = {k: p.detach().clone() for k, p in model.named_parameters()}
        trainer = cls(model=model, args=arguments(tmp_path / cls.__name__, **args), train_dataset=data, **extra)
        trainer.remove_callback(PrinterCallback); trainer.train()
        moved.append({k: p.detach() - start[k] for k, p in model.named_parameters() if p.requires_grad})
    return moved[0], moved[-1], trainer


def assert_same(plain, skipped, tol=2e-4):
    worst, overall = grad_errors(skipped, plain)          # each parameter's relative error (zero-safe); global relative error
    assert worst <= tol and overall <= 1e-5, (worst, overall)


# float32, the same tokens summed in another order. Measured on a 2-core AMD EPYC (GPT-2, accumulation): worst 4.7e-7 with
# one thread, 4.3e-5 with two, from block 0's ln_2.weight, whose change is a small sum of terms that nearly cancel (a
# softmax kernel in place of torch.exp moved it to 4.3e-5 with one thread too); overall ≤ 2e-7. A dropped row or a wrong
# normalisation is off by 1e-2 or more.
@pytest.mark.parametrize('name,config', [('gpt2', {}), ('llama', {}), ('gpt2', {'max_grad_norm': 0.05}),
                                         ('llama', {'gradient_accumulation_steps': 1})],
                         ids=['gpt2-accumulate', 'llama-accumulate', 'gpt2-clip', 'llama-no-accumulation'])
def test_budget_0_trains_what_the_trainer_trains(name, config, data, tmp_path):
    plain, skipped, trainer = side_by_side(lm(name), data, tmp_path, **config)
    assert_same(plain, skipped)
    assert trainer.reduction == 'items'                  # ForCausalLMLoss divides by num_items_in_batch
    assert int(trainer.skip.last.kept) == trainer.skip.last.forwarded                   # budget 0 keeps every sequence


def test_budget_0_with_lora_and_a_frozen_head(data, tmp_path):
    plain, skipped, trainer = side_by_side(lora(lm('llama')), data, tmp_path, max_steps=3)   # one LoRA init for both
    assert_same(plain, skipped)
    trained = sorted(skipped)
    assert trained and all('lora_' in k for k in trained)                                  # only the adapters train
    assert not trainer.model.get_base_model().lm_head.weight.requires_grad
    assert is_causal_lm(trainer.model) and float(max(v.abs().max() for v in skipped.values())) > 0


@pytest.mark.parametrize('mode', ['masked', 'reuse'])
def test_budget_0_with_peft_prompt_tuning(mode, data, tmp_path):
    "Prompt tuning's logits carry 3 virtual tokens the batch's labels lack: the loss-reduction probe and the door pad the labels as PEFT does (before: the probe raised a cross-entropy shape error)."
    from peft import PromptTuningConfig, TaskType
    base = get_peft_model(lm('gpt2'), PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3))
    plain, skipped, trainer = side_by_side(base, data, tmp_path, capskip={'mode': mode})
    assert_same(plain, skipped)
    assert sorted(skipped) == ['prompt_encoder.default.embedding.weight'] and float(skipped[sorted(skipped)[0]].abs().max()) > 0
    assert trainer.reduction == 'items' and int(trainer.skip.last.kept) == trainer.skip.last.forwarded


def test_an_moe_router_loss_is_refused_in_one_line(data, tmp_path):
    "Mixtral with output_router_logits=True: transformers.Trainer's loss adds the routers' aux_loss, CAPSkip's would not (before: refused as a model whose loss is no mean or sum of cross-entropy)."
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
                                             num_local_experts=4, num_experts_per_tok=2, output_router_logits=True))
    trainer = CAPSkipTrainer(model=model, args=arguments(tmp_path), train_dataset=data, capskip={'budget': 0.5})
    trainer.remove_callback(PrinterCallback)
    with pytest.raises(ValueError, match=r"carries aux_loss beside its logits"):
        trainer.train()


def aligned_rows(kind: str, n: int = ROWS, seed: int = 2) -> list[dict]:
    "The counting rows with aligned labels: 5 token tags (the token mod 5), or a masked LM's targets (30% of the tokens)."
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in counting_rows(n):
        tags = torch.where(r['attention_mask'].bool(), r['input_ids'] % 5, -100)
        picked = torch.where((torch.rand(L, generator=g) < 0.3) & r['attention_mask'].bool(), r['input_ids'], -100)
        out.append(dict(r, labels=tags if kind == 'tags' else picked))
    return out


@pytest.mark.parametrize('kind', ['tags', 'mlm'])
def test_budget_0_on_aligned_labels_trains_what_the_trainer_trains(kind, tmp_path):
    "A token classifier and a masked LM: sequence rows whose labels the door keeps aligned (before: the tagger was refused, and the masked LM trained on shifted labels)."
    from transformers import BertForMaskedLM
    torch.manual_seed(0)
    bert = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                      num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=16)
    base = BertForTokenClassification(bert) if kind == 'tags' else BertForMaskedLM(bert)
    plain, skipped, trainer = side_by_side(base, aligned_rows(kind), tmp_path, capskip={'mode': 'reuse'})
    assert_same(plain, skipped)
    assert int(trainer.skip.last.kept) == trainer.skip.last.forwarded and float(max(v.abs().max() for v in plain.values())) > 0


def checkpointed(model):
    model.gradient_checkpointing_enable(); model.config.use_cache = False
    return model


def test_budget_0_with_gradient_checkpointing(data, tmp_path):
    plain, skipped, trainer = side_by_side(lm('gpt2'), data, tmp_path, capskip={'mode': 'reforward'}, prepare=checkpointed)
    assert_same(plain, skipped)
    assert any(getattr(m, 'gradient_checkpointing', False) for m in trainer.model.modules())


class Recorder(TrainerCallback):
    "The gradient the optimizer steps with."
    def on_pre_optimizer_step(self, args, state, control, model=None, **kw): self.grads = model_grads(model)


def test_lora_step_at_budget_half_is_autograd_of_the_kept_sequences(counted, data, tmp_path):
    "One step of two accumulated micro-batches: Σ_m Σ_i a_i Σ_t CE_it / N, N the step's labelled tokens after the shift."
    base = lora(copy.deepcopy(counted))
    trainer = CAPSkipTrainer(model=copy.deepcopy(base), args=arguments(tmp_path, max_steps=1, learning_rate=0.0, logging_steps=1),
                             train_dataset=data, capskip={'budget': 0.5, 'mode': 'reforward'})
    recorder, micro = Recorder(), []
    trainer.add_callback(recorder); trainer.remove_callback(PrinterCallback)
    plain_loss = trainer.compute_loss
    def compute_loss(model, inputs, *a, num_items_in_batch=None, **kw):
        loss = plain_loss(model, inputs, *a, num_items_in_batch=num_items_in_batch, **kw)
        micro.append((dict(inputs), trainer.skip.last.applied.detach().clone(), int(num_items_in_batch)))
        return loss
    trainer.compute_loss = compute_loss
    trainer.train()
    n = sum(int((inputs['labels'][:, 1:] != -100).sum()) for inputs, *_ in micro)       # labelled tokens after the shift
    assert [count for *_, count in micro] == [n, n]         # the Trainer's num_items_in_batch (a Llama: after the shift)
    want, want32 = (kept_sequences_grads(base, micro, n, dt) for dt in (torch.float64, torch.float32))
    assert sorted(recorder.grads) == sorted(want) and all('lora_' in k for k in want)
    # float32 autograd of the same loss is 1.9-2.4e-5 from float64 here (this model predicts most tokens: its residuals
    # 1 - p are small and their float32 round-off is not): the skipped gradient must be as close to float64 as it is
    worst, overall = grad_errors(recorder.grads, want)
    own = grad_errors(want32, want)
    assert worst <= 1.5 * own[0] + 1e-6 and overall <= 1.5 * own[1] + 1e-6, (worst, overall, own)
    kept = [int((a > 0).sum()) for _, a, _ in micro]
    assert len(micro) == 2 and 0 < sum(kept) < 16, kept                                  # rows were dropped, some kept
    log = trainer.state.log_history[0]
    assert log['capskip/kept_fraction'] == pytest.approx(sum(kept) / 16) and log['capskip/kept_fraction'] < 1
    assert 0 < log['capskip/distortion'] <= 0.5 + 1e-6
    assert log['capskip/all_rows_fraction'] == 0.0          # no dropout: reforward's backward ran the kept rows alone
    everyone = grad_errors(recorder.grads, reference_all_rows(base, micro, n))[1]
    assert everyone > 1e-2, everyone                                                    # the dropped rows mattered


def kept_sequences_grads(base, micro, n, dtype):
    "Plain autograd in `dtype` of Σ_m Σ_i a_i Σ_t CE_it / n over the recorded micro-batches (labels shifted), gradients in float64."
    twin = copy.deepcopy(base).to(dtype)
    for inputs, applied, _ in micro:
        logits = twin(input_ids=inputs['input_ids'], attention_mask=inputs['attention_mask']).logits
        y = inputs['labels'][:, 1:]
        tok = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), y.reshape(-1), reduction='none').view(y.shape)
        (tok.sum(1) * applied.to(dtype)).sum().div(n).backward()
    return {k: g.double() for k, g in model_grads(twin).items()}


def reference_all_rows(base, micro, n):
    twin = copy.deepcopy(base)
    for inputs, *_ in micro: (twin(**inputs).loss * int((inputs['labels'][:, 1:] != -100).sum()) / n).backward()
    return model_grads(twin)


class MicroMean(CAPSkipTrainer):
    "The wrong normalisation for a causal LM: each micro-batch's token mean (what a BERT's own loss is)."
    reduction = property(lambda self: 'mean', lambda self, value: None)


def test_the_side_by_side_check_sees_each_difference(data, tmp_path):
    "The comparison can fail: budget 0.9 drops sequences, per-micro-batch means double the step, the Trainer without clipping."
    base = lm('gpt2')
    plain, dropped, trainer = side_by_side(base, data, tmp_path / 'a', capskip={'budget': 0.9})
    assert int(trainer.skip.last.kept) < 8 and grad_errors(dropped, plain)[1] > 1e-2
    plain, meaned, _ = side_by_side(base, data, tmp_path / 'b', skipping=MicroMean)
    assert grad_errors(meaned, plain)[1] > 0.3
    clipped, _, _ = side_by_side(base, data, tmp_path / 'c', skipping=None, max_grad_norm=0.05)
    assert grad_errors(clipped, plain)[1] > 1e-2


def test_the_probe_compares_with_the_shifted_labels(counted, data):
    "A model that predicts the next token: its loss is the shifted CE / num_items_in_batch, far from the unshifted CE."
    batch = stacked(data[:16])
    assert loss_reduction(counted, batch) == 'items'
    with torch.no_grad():
        out = counted(**batch, num_items_in_batch=torch.tensor(1e6))
        unshifted = float(F.cross_entropy(out.logits.reshape(-1, VOCAB), batch['labels'].reshape(-1), reduction='sum'))
    assert abs(float(out.loss) * 1e6 / unshifted - 1) > 0.5                     # the unshifted comparison would refuse it


def test_causal_lms_pass_the_check_and_what_they_cannot_follow_is_refused(data, tmp_path):
    for model in (lm('gpt2'), lora(lm('llama'))): check_classifier(model)                  # no error
    from transformers import T5Config, T5ForConditionalGeneration
    with pytest.raises(ValueError, match=r"T5ForConditionalGeneration builds its decoder's inputs from them"):
        check_classifier(T5ForConditionalGeneration(T5Config(vocab_size=30, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                             num_heads=2)))
    for extra, message in (({'label_smoothing_factor': 0.1}, r'label_smoothing=0.1 was given: drop TrainingArguments'),
                           ({}, r"capskip=\{'reweight': 'rw'\} was given: drop it")):
        capskip = {'budget': 0.5} if extra else {'budget': 0.5, 'reweight': 'rw'}
        trainer = CAPSkipTrainer(model=lm('gpt2'), args=arguments(tmp_path, max_steps=1, **extra), train_dataset=data,
                                 capskip=capskip)
        with pytest.raises(ValueError, match=message) as err: trainer.train()
        assert '\n' not in str(err.value)


def test_budget_0_on_a_soft_capped_gemma2_trains_what_the_trainer_trains(data, tmp_path):
    "Gemma 2's final_logit_softcapping (the map capskip.engine.head.logit_map finds), padded rows, reuse: the Trainer's step."
    torch.manual_seed(0)
    base = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0, final_logit_softcapping=30.0))
    plain, skipped, trainer = side_by_side(base, data, tmp_path, capskip={'mode': 'reuse'})
    assert_same(plain, skipped)
    assert trainer.skip.engine.last_capture.logit_map.cap == 30.0


def test_micro_batches_whose_backward_ran_every_row_are_logged(counted, data, tmp_path):
    "Attention dropout in `reforward`: its second forward replays the random masks only over every row, so each backward ran every row (exact, nothing saved). The log says so beside the rule's kept fraction (before: the kept fraction alone, a saving that did not happen; stop 54)."
    model = copy.deepcopy(counted)
    for m in model.modules():
        if hasattr(m, 'attention_dropout'): m.attention_dropout = 0.1
    trainer = CAPSkipTrainer(model=model, args=arguments(tmp_path, max_steps=1, learning_rate=0.0, logging_steps=1),
                             train_dataset=data, capskip={'budget': 0.5, 'mode': 'reforward'})
    trainer.remove_callback(PrinterCallback)
    with pytest.warns(RuntimeWarning, match="draws random numbers.*mode='reuse'"):       # said once, too
        trainer.train()
    log = trainer.state.log_history[0]
    assert log['capskip/kept_fraction'] < 1 and log['capskip/all_rows_fraction'] == 1.0, log
    assert trainer.skip.counters()['all_rows_steps'] == 2                                # both micro-batches
