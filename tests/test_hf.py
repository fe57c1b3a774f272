"""The Hugging Face integration (issue 21, item 2) against the real `transformers` package: `CAPSkipTrainer` on a
`BertForSequenceClassification` (dict batches, `.logits`, `labels` from the batch, `-100` ignored) and on an
`AutoModelForImageClassification` ViT gives, for one optimizer step, plain autograd's gradient of the kept rows
(float32, ≤ 1e-5) — with gradient accumulation, `max_grad_norm` clipping, bf16 autocast, and `ddp` on two gloo
processes — while `reuse` really skips rows (kept < batch, a traced graph cached, no fallback warning); the CAPSkip
counters reach `log_history`; evaluation is the Trainer's own; usage errors are one line."""
import copy
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import socket

import pytest
import torch
import torch.nn.functional as F

import transformers                      # the hf extra (in dev): a missing package fails here, it is never skipped
from transformers import (BertConfig, BertForSequenceClassification, PrinterCallback, TrainerCallback, TrainingArguments,
                          ViTConfig, ViTForImageClassification)

from capskip.engine.check import grad_errors, model_grads
from capskip.engine.reuse import cached_traces
from capskip.integrations.hf import CAPSkipTrainer, check_classifier
from capskip.testing import digits_tensors

pytestmark = pytest.mark.filterwarnings('error::RuntimeWarning')       # reuse's fallback to a full backward warns
logging.getLogger('transformers').setLevel(logging.ERROR)
BERT = dict(vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def token_task(n=64, seed=1):
    "12 random tokens behind [CLS]; the class is the first token mod 3; every third row's last third padded and masked."
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 30, (n, 12), generator=g); ids[:, 0] = 1
    mask = torch.ones_like(ids); mask[::3, 8:] = 0; ids[mask == 0] = 0
    return ids, mask, ids[:, 1] % 3


def pretrain(model, call, y, steps=60):
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(steps):
        F.cross_entropy(call(model).logits, y).backward(); opt.step(); opt.zero_grad()
    return model


@pytest.fixture(scope='module')
def bert():
    "A tiny BERT trained until most rows are classified correctly (so CAPSkip has rows to drop)."
    torch.manual_seed(0)
    ids, mask, y = token_task()
    model = pretrain(BertForSequenceClassification(BertConfig(**BERT)), lambda m: m(input_ids=ids, attention_mask=mask), y)
    y = y.clone(); y[5] = -100
    return model, [{'input_ids': ids[i], 'attention_mask': mask[i], 'labels': y[i]} for i in range(len(y))]


@pytest.fixture(scope='module')
def vit():
    "A tiny ViT on 8-px digits (patches of 4), trained until most rows are classified correctly."
    torch.manual_seed(0)
    X, Y, _, _ = digits_tensors()
    X, Y = X[:64], Y[:64]
    config = ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = pretrain(ViTForImageClassification(config), lambda m: m(pixel_values=X), Y, steps=100)
    return model, [{'pixel_values': X[i], 'labels': Y[i]} for i in range(len(Y))]


class Recorder(TrainerCallback):
    "The gradient the optimizer steps with (after clipping)."
    def on_pre_optimizer_step(self, args, state, control, model=None, **kw): self.grads = model_grads(model)


def train_one_step(model, data, tmp_path, batch=32, accumulate=2, **args):
    "One optimizer step of CAPSkipTrainer; returns the trainer, the optimizer's gradient, and each micro-batch's (inputs, applied)."
    options = dict(per_device_train_batch_size=batch, gradient_accumulation_steps=accumulate, max_steps=1, learning_rate=0.0,
                   max_grad_norm=0.0, use_cpu=True, report_to=[], logging_steps=1, save_strategy='no', disable_tqdm=True)
    trainer = CAPSkipTrainer(model=model, args=TrainingArguments(str(tmp_path), **{**options, **args}), train_dataset=data,
                             capskip={'budget': 0.09})
    recorder, micro = Recorder(), []
    trainer.add_callback(recorder); trainer.remove_callback(PrinterCallback)
    plain = trainer.compute_loss
    def compute_loss(model, inputs, *a, **kw):
        loss = plain(model, inputs, *a, **kw)
        micro.append((dict(inputs), trainer.skip.last.applied.detach().clone()))
        return loss
    trainer.compute_loss = compute_loss
    trainer.train()
    return trainer, recorder.grads, micro


def reference(base, micro, clip=0.0, autocast=False, reduction='items'):
    """Plain autograd of Σ_micro-batches (1/N) Σ_i applied_i CE_i on a copy, clipped as torch clips: N the labelled rows of the
    step (`reduction='items'`, the Trainer's num_items_in_batch) or of each micro-batch (`'mean'`: a model whose own loss is
    CrossEntropyLoss()'s mean, e.g. BERT, whose micro-batch means the Trainer adds up without dividing)."""
    twin = copy.deepcopy(base)
    n = sum(int((inputs['labels'] != -100).sum()) for inputs, _ in micro)
    for inputs, applied in micro:
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
            logits = twin(**{k: v for k, v in inputs.items() if k != 'labels'}).logits
        den = n if reduction == 'items' else int((inputs['labels'] != -100).sum())
        (F.cross_entropy(logits.float(), inputs['labels'].clamp_min(0), reduction='none') * applied).sum().div(den).backward()
    if clip: torch.nn.utils.clip_grad_norm_(twin.parameters(), clip)
    return model_grads(twin)


def assert_autograd_of_kept_rows(got, base, micro, tol=1e-5, **reference_options):
    worst, overall = grad_errors(got, reference(base, micro, **reference_options))
    assert worst <= tol and overall <= tol, (worst, overall)


def assert_really_skipped(trainer, micro, batch=32):
    kept = [int((applied > 0).sum()) for _, applied in micro]
    assert all(0 < k < batch for k in kept), kept                          # rows were dropped, some kept
    assert [type(t).__name__ for m in trainer.skip.engine.modules() for t in cached_traces(m)] == ['Traced']
    assert trainer.skip.engine.executor.mode == 'reuse'


def test_bert_accumulated_step_is_autograd_of_the_kept_rows(bert, tmp_path):
    base, data = bert
    trainer, got, micro = train_one_step(copy.deepcopy(base), data, tmp_path)
    assert trainer.reduction == 'mean'                                     # BERT's own loss: CrossEntropyLoss()'s mean
    assert_autograd_of_kept_rows(got, base, micro, reduction='mean')
    assert_really_skipped(trainer, micro)
    ignored = [applied[inputs['labels'] == -100] for inputs, applied in micro]
    assert sum(len(t) for t in ignored) == 1 and all((t == 0).all() for t in ignored)      # -100: weight 0, not counted
    log = trainer.state.log_history[0]
    kept = sum(int((a > 0).sum()) for _, a in micro)
    assert log['capskip/kept_fraction'] == pytest.approx(kept / 64) and 0 <= log['capskip/distortion'] <= 0.09 + 1e-6


def test_without_accumulation_the_loss_is_the_batch_mean(bert, tmp_path):
    "One micro-batch per step: the denominator is the step's labelled rows, the same as with accumulation."
    base, data = bert
    trainer, got, micro = train_one_step(copy.deepcopy(base), data, tmp_path, batch=64, accumulate=1)
    assert len(micro) == 1
    assert_autograd_of_kept_rows(got, base, micro, reduction='mean')
    assert_really_skipped(trainer, micro, batch=64)


def test_max_grad_norm_clips_the_skipped_gradient(bert, tmp_path):
    base, data = bert
    trainer, got, micro = train_one_step(copy.deepcopy(base), data, tmp_path, max_grad_norm=1e-2)
    assert_autograd_of_kept_rows(got, base, micro, clip=1e-2, reduction='mean')
    assert sum(float(g.norm()) ** 2 for g in got.values()) ** 0.5 == pytest.approx(1e-2, rel=1e-3)   # really clipped


def test_bf16_autocast(bert, tmp_path):
    base, data = bert
    trainer, got, micro = train_one_step(copy.deepcopy(base), data, tmp_path, bf16=True)
    assert_autograd_of_kept_rows(got, base, micro, tol=1e-3, autocast=True, reduction='mean')   # a bf16 forward on both sides
    assert grad_errors(got, reference(base, micro, reduction='mean'))[1] > 3e-3, 'autocast was not in effect'
    assert_really_skipped(trainer, micro)


def test_vit_image_classifier(vit, tmp_path):
    base, data = vit
    trainer, got, micro = train_one_step(copy.deepcopy(base), data, tmp_path)
    assert trainer.reduction == 'items'                                    # ViT's loss_function divides by num_items_in_batch
    assert_autograd_of_kept_rows(got, base, micro)
    assert_really_skipped(trainer, micro)


def test_evaluation_is_the_trainers_own(bert, tmp_path):
    base, data = bert
    model = copy.deepcopy(base)
    args = TrainingArguments(str(tmp_path), per_device_eval_batch_size=64, use_cpu=True, report_to=[], disable_tqdm=True)
    trainer = CAPSkipTrainer(model=model, args=args, eval_dataset=data)
    metrics = trainer.evaluate()
    batch = {k: torch.stack([row[k] for row in data]) for k in data[0]}
    with torch.no_grad(): expected = float(model.eval()(**batch).loss)
    assert metrics['eval_loss'] == pytest.approx(expected, rel=1e-5)
    assert trainer.skip is None                                             # no CAPSkip was built for evaluation


def test_usage_errors_name_the_fix(bert, tmp_path):
    base, data = bert
    with pytest.raises(ValueError, match='train it with transformers.Trainer'):
        check_classifier(BertForSequenceClassification(BertConfig(**{**BERT, 'num_labels': 1})))
    unlabelled = [{k: v for k, v in row.items() if k != 'labels'} for row in data]
    with pytest.raises(ValueError, match=r"labels of each batch under 'labels'.*label_names"):
        train_one_step(copy.deepcopy(base), unlabelled, tmp_path)


# ------------------------------------------------------------- side by side with transformers.Trainer at budget 0
def side_by_side(base, data, tmp_path, steps=3, skipping=None, **args):
    """The parameter change after `steps` SGD steps of `Trainer` and of `CAPSkipTrainer(capskip={'budget': 0})` from one
    initialisation, on the same data order (the Trainer's seeded sampler); and the CAPSkipTrainer. SGD, so that a
    parameter whose gradient is zero up to round-off moves by round-off (Adam would scale round-off up to a full step)."""
    options = dict(per_device_train_batch_size=16, gradient_accumulation_steps=2, max_steps=steps, learning_rate=0.5,
                   optim='sgd', max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy='no', disable_tqdm=True, seed=0)
    moved, trainers = [], ((transformers.Trainer, {}),) + (() if skipping is False else ((skipping or CAPSkipTrainer, {'capskip': {'budget': 0.0}}),))
    for cls, extra in trainers:
        model = copy.deepcopy(base)
        trainer = cls(model=model, args=TrainingArguments(str(tmp_path / cls.__name__), **{**options, **args}), train_dataset=data, **extra)
        trainer.remove_callback(PrinterCallback); trainer.train()
        moved.append({k: (p.detach() - q.detach()).float() for (k, p), q in zip(model.named_parameters(), base.parameters())})
    return moved[0], moved[-1], trainer


def assert_same_training(plain, skipped, tol):
    worst, overall = grad_errors(skipped, plain)          # error relative to the largest change; global relative error
    assert worst <= tol and overall <= tol, (worst, overall)


# measured on this machine, float32: worst ≤ 2e-6 and global ≤ 5e-7 at budget 0 (the same rows, summed in another order);
# bf16 autocast: ≤ 4e-3 (CAPSkip's traced forward rounds its bf16 products in another order than the eager one)
@pytest.mark.parametrize('config', [dict(), dict(gradient_accumulation_steps=1), dict(label_smoothing_factor=0.1, max_grad_norm=0.05)],
                         ids=['accumulate', 'no_accumulation', 'smoothing_and_clip'])
def test_budget_0_trains_what_the_trainer_trains(bert, tmp_path, config):
    base, data = bert
    plain, skipped, trainer = side_by_side(base, data, tmp_path, **config)
    assert_same_training(plain, skipped, 1e-5)
    smoothing = config.get('label_smoothing_factor', 0.0)
    assert trainer.skip.label_smoothing == smoothing
    assert trainer.reduction == ('items' if smoothing else 'mean')     # the LabelSmoother divides by num_items_in_batch


class GlobalMean(CAPSkipTrainer):
    "The old normalisation: num_items_in_batch for every model (a BERT's step then is 1/accumulation of the Trainer's)."
    reduction = property(lambda self: 'items', lambda self, value: None)


def test_the_side_by_side_check_sees_each_option(bert, tmp_path):
    "The comparison can fail: the Trainer without an option, or CAPSkipTrainer with the old normalisation, moves elsewhere."
    base, data = bert
    plain, _, _ = side_by_side(base, data, tmp_path / 'a', skipping=False, label_smoothing_factor=0.1, max_grad_norm=0.05)
    _, unsmoothed, _ = side_by_side(base, data, tmp_path / 'b', skipping=False, max_grad_norm=0.05)
    _, unclipped, _ = side_by_side(base, data, tmp_path / 'c', skipping=False, label_smoothing_factor=0.1)
    for other in (unsmoothed, unclipped): assert grad_errors(other, plain)[1] > 1e-2
    trainer_step, old_step, _ = side_by_side(base, data, tmp_path / 'd', skipping=GlobalMean)
    assert grad_errors(old_step, trainer_step)[1] > 0.3                     # half the Trainer's step with 2 micro-batches


def test_budget_0_trains_what_the_trainer_trains_in_bf16(bert, tmp_path):
    base, data = bert
    plain, skipped, _ = side_by_side(base, data, tmp_path, bf16=True)
    assert_same_training(plain, skipped, 4e-3)
    plain32, _, _ = side_by_side(base, data, tmp_path / 'fp32', skipping=False)
    assert grad_errors(plain32, plain)[1] > 4e-3, 'bf16 autocast was not in effect'


def test_budget_0_trains_what_the_trainer_trains_for_a_vit(vit, tmp_path):
    "ViT's own loss divides by num_items_in_batch (the Trainer's count over the accumulated micro-batches)."
    base, data = vit
    plain, skipped, trainer = side_by_side(base, data, tmp_path, label_smoothing_factor=0.0)
    assert_same_training(plain, skipped, 1e-5)
    assert trainer.reduction == 'items'


def test_options_it_cannot_follow_are_refused(bert, tmp_path):
    base, data = bert
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match=r'compute_loss_func= would be ignored: drop it'):
        CAPSkipTrainer(model=copy.deepcopy(base), args=args, train_dataset=data, compute_loss_func=lambda *a, **k: 0)
    with pytest.raises(ValueError, match=r'disagrees with TrainingArguments\(label_smoothing_factor=0.1\): set it in one place'):
        CAPSkipTrainer(model=copy.deepcopy(base), args=args, train_dataset=data, capskip={'label_smoothing': 0.2})
    trainer = CAPSkipTrainer(model=copy.deepcopy(base), args=args, train_dataset=data, capskip={'label_smoothing': 0.1})
    assert trainer.capskip_options['label_smoothing'] == 0.1


def test_gradient_checkpointing_needs_use_cache_off(bert):
    """With use_cache=True transformers logs from inside every checkpointed forward: reuse falls back and the warning says
    the fix; with model.config.use_cache = False it traces and stays exact. (The Trainer sets config.use_cache from
    TrainingArguments(use_cache=False) itself; a loop of one's own does not.)"""
    from capskip import CAPSkip
    base, data = bert
    batch = {k: torch.stack([row[k] for row in data[:32]]) for k in data[0]}
    labels = batch.pop('labels')
    def one_step(use_cache):
        model = copy.deepcopy(base)
        model.gradient_checkpointing_enable(); model.config.use_cache = use_cache
        skip = CAPSkip(model, budget=0.09)
        skip.loss(skip(**batch), labels).backward()
        return model, skip
    hf_logger = logging.getLogger('transformers')
    hf_logger.setLevel(logging.WARNING)              # transformers' default (torch traces a logger call that prints nothing)
    try:
        with pytest.warns(RuntimeWarning, match=r'logging.Logger method.*gradient checkpointing.*set model.config.use_cache = False'):
            one_step(True)
    finally:
        hf_logger.setLevel(logging.ERROR)
    model, skip = one_step(False)                                            # the fix
    applied = skip.last.applied
    twin = copy.deepcopy(base)
    (F.cross_entropy(twin(**batch).logits, labels.clamp_min(0), reduction='none') * applied).sum().div(31).backward()
    worst, overall = grad_errors(model_grads(model), model_grads(twin))
    assert worst <= 1e-5 and overall <= 1e-5, (worst, overall)
    assert 0 < int((applied > 0).sum()) < 32
    assert [type(t).__name__ for m in skip.engine.modules() for t in cached_traces(m)] == ['Traced']


# ------------------------------------------------------------- ddp: two gloo processes launched by torch.distributed.run
WORKER = '''
import copy, json, logging, os, sys, torch
sys.path.insert(0, {tests!r})
import test_hf as t
logging.getLogger('transformers').setLevel(logging.ERROR)
out = sys.argv[1]
torch.manual_seed(0)
ids, mask, y = t.token_task()
base = t.pretrain(t.BertForSequenceClassification(t.BertConfig(**t.BERT)), lambda m: m(input_ids=ids, attention_mask=mask), y)
data = [{{'input_ids': ids[i], 'attention_mask': mask[i], 'labels': y[i]}} for i in range(len(y))]
trainer, got, micro = t.train_one_step(copy.deepcopy(base), data, out, batch=16, accumulate=2, ddp_backend='gloo')
rank = int(os.environ['RANK'])
torch.save(dict(grads=got, micro=micro, base=base.state_dict(), wrapped=type(trainer.skip.model).__name__,
                traced=[type(x).__name__ for m in trainer.skip.engine.modules() for x in t.cached_traces(m)],
                log=trainer.state.log_history[0], reduction=trainer.reduction), os.path.join(out, f'rank{{rank}}.pt'))
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


@pytest.fixture(scope='module')
def ddp_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('hf_ddp')
    script = tmp / 'worker.py'
    script.write_text(textwrap.dedent(WORKER.format(tests=os.path.dirname(__file__))))
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'}
    done = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(free_port()),
                           str(script), str(tmp)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(tmp / f'rank{r}.pt', weights_only=False) for r in (0, 1)]


def test_ddp_gradients_are_synced_and_exact(ddp_ranks):
    r0, r1 = ddp_ranks
    assert r0['wrapped'] == r1['wrapped'] == 'DistributedDataParallel'        # CAPSkip on the DDP wrapper
    assert r0['traced'] == r1['traced'] == ['Traced']
    worst, _ = grad_errors(r1['grads'], r0['grads'])
    assert worst <= 1e-6, worst                                              # the all-reduce ran: one gradient on both ranks
    base = BertForSequenceClassification(BertConfig(**BERT)); base.load_state_dict(r0['base'])
    micro = r0['micro'] + r1['micro']
    assert r0['reduction'] == r1['reduction'] == 'mean'
    # BERT's loss is each micro-batch's mean; the Trainer multiplies it by the 2 processes (average_tokens_across_devices)
    # and DDP averages over them: the step's gradient is the sum of the 4 micro-batch means
    def plain(dtype):
        twin = copy.deepcopy(base).to(dtype)
        for inputs, applied in micro:
            logits = twin(**{k: v for k, v in inputs.items() if k != 'labels'}).logits
            n = int((inputs['labels'] != -100).sum())
            (F.cross_entropy(logits, inputs['labels'], reduction='none') * applied.to(dtype)).sum().div(n).backward()
        return {k: v.float() for k, v in model_grads(twin).items()}
    exact, fp32 = plain(torch.float64), plain(torch.float32)
    worst, overall = grad_errors(r0['grads'], exact)
    plain_worst, _ = grad_errors(fp32, exact)
    # attention key biases have an exactly zero gradient (softmax ignores a constant added to every key): in float32
    # both sides carry round-off of about 1e-5 of the zero-gradient floor there, so the bar is plain float32 autograd's own error
    assert worst <= max(1e-5, 2 * plain_worst) and overall <= 1e-5, (worst, plain_worst, overall)
    kept = [int((a > 0).sum()) for _, a in micro]
    assert all(0 < k < 16 for k in kept), kept
    assert r0['log']['capskip/kept_fraction'] == pytest.approx(sum(kept) / 64)   # summed over both processes


# ------------------------------------------------------------- checkpoints and steps with nothing to learn from
def train_steps(model, data, out, steps, resume=None, **capskip):
    args = TrainingArguments(str(out), per_device_train_batch_size=16, max_steps=steps, learning_rate=1e-3, use_cpu=True,
                             report_to=[], logging_steps=1, save_strategy='steps', save_steps=2, disable_tqdm=True, seed=0)
    trainer = CAPSkipTrainer(model=model, args=args, train_dataset=data, capskip={'budget': 0.09, **capskip})
    trainer.remove_callback(PrinterCallback)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_a_resumed_run_draws_what_the_uninterrupted_run_draws(bert, tmp_path):
    "reweight='rw' draws from CAPSkip's generator: checkpoint-2 keeps its state, and resuming from it ends where 4 steps end."
    base, data = bert
    whole = train_steps(copy.deepcopy(base), data, tmp_path / 'whole', 4, reweight='rw')
    saved = torch.load(tmp_path / 'whole' / 'checkpoint-2' / 'capskip_state.pt', weights_only=True)
    assert not torch.equal(saved['generator'], whole.skip.state_dict()['generator'])   # steps 3-4 drew numbers
    resumed = train_steps(copy.deepcopy(base), data, tmp_path / 'resumed', 4, resume=str(tmp_path / 'whole' / 'checkpoint-2'),
                          reweight='rw')
    assert torch.equal(resumed.skip.state_dict()['generator'], whole.skip.state_dict()['generator'])
    worst, _ = grad_errors(dict(resumed.model.named_parameters()), dict(whole.model.named_parameters()))
    assert worst <= 1e-6, worst
    shutil.copytree(tmp_path / 'whole' / 'checkpoint-2', tmp_path / 'last' / 'checkpoint-2')
    latest = train_steps(copy.deepcopy(base), data, tmp_path / 'last', 4, resume=True, reweight='rw')   # True: the latest
    assert torch.equal(latest.skip.state_dict()['generator'], whole.skip.state_dict()['generator'])


def test_a_checkpoint_without_capskip_state_warns(bert, tmp_path):
    base, data = bert
    train_steps(copy.deepcopy(base), data, tmp_path, 2)
    (tmp_path / 'checkpoint-2' / 'capskip_state.pt').unlink()
    with pytest.warns(UserWarning, match=r'holds no capskip_state.pt .*starts from its seed'):
        train_steps(copy.deepcopy(base), data, tmp_path, 4, resume=str(tmp_path / 'checkpoint-2'))


def test_a_step_with_every_label_ignored_learns_nothing(bert, tmp_path):
    "num_items_in_batch = 0: loss 0, a zero gradient (the Trainer's own 0/0 would be NaN), no error."
    base, data = bert
    ignored = [{**row, 'labels': torch.tensor(-100)} for row in data]
    trainer, got, micro = train_one_step(copy.deepcopy(base), ignored, tmp_path)
    assert all(float(g.abs().max()) == 0.0 for g in got.values())
    assert trainer.state.log_history[0]['loss'] == 0.0
