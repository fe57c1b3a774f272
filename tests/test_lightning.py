"""The Lightning integration (issue 21, item 2) against the real `lightning` package: a LightningModule that returns
`skip.loss(skip(x), y)` under automatic optimisation, with `CAPSkipCallback`, gets plain autograd's gradient of the kept
rows — alone, with `accumulate_grad_batches`, with `gradient_clip_val`, under `precision="bf16-mixed"`, and with
`strategy="ddp"` on two gloo processes that Lightning launches itself — while `reuse` really skips rows (kept < batch,
a traced graph cached, no fallback warning)."""
import copy
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
import lightning as L

import capskip
from capskip.engine.check import grad_errors, model_grads
from capskip.engine.reuse import cached_traces
from capskip.integrations.lightning import CAPSkipCallback, find_skips
from capskip.testing import digits_tensors, trained_digits_mlp

pytestmark = pytest.mark.filterwarnings('error::RuntimeWarning')       # reuse's fallback to a full backward warns
for _name in ('lightning.pytorch', 'lightning.fabric'): logging.getLogger(_name).setLevel(logging.ERROR)


class DigitsModule(L.LightningModule):
    def __init__(self, model, budget=capskip.DEFAULT_BUDGET, lr=0.1, **options):
        super().__init__()
        self.model, self.lr = model, lr
        self.skip = capskip.CAPSkip(self.model, budget=budget, **options)
        self.seen, self.grads = [], None
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.skip.loss(self.skip(x), y)
        self.seen.append((x, y, self.skip.last.applied))
        return loss
    def on_before_optimizer_step(self, optimizer):
        self.grads = model_grads(self.model)                    # after backward (and DDP's all-reduce), before clipping
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.clipped = model_grads(self.model)                  # what the optimizer steps with
    def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=self.lr)


@pytest.fixture(scope='module')
def digits():
    X, Y, _, _ = digits_tensors()
    return trained_digits_mlp(), X[:64], Y[:64]


def fit(module, x, y, batch_size=64, **options):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)
    trainer = L.Trainer(max_steps=1, accelerator='cpu', devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[CAPSkipCallback()], **options)
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', category=UserWarning)               # Lightning's advice (num_workers, ...)
        trainer.fit(module, data)
    return trainer


def reference(model, seen, denominator, autocast=False):
    "Plain autograd of Σ_micro-batches (1/denominator) Σ applied_i CE_i on a copy of the model."
    twin = copy.deepcopy(model)
    for x, y, applied in seen:
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
            logits = twin(x)
        (F.cross_entropy(logits.float(), y, reduction='none') * applied).sum().div(denominator).backward()
    return model_grads(twin)


def assert_really_skipped(module, batch):
    kept = [int((applied > 0).sum()) for _, _, applied in module.seen]
    assert all(0 < k < batch for k in kept), kept                          # rows were dropped, some kept
    assert [type(t).__name__ for t in cached_traces(module.model)] == ['Traced']   # reuse traced: no fallback reason
    assert module.skip.engine.executor.mode == 'reuse'


def test_one_step_is_autograd_of_the_kept_rows_and_is_logged(digits):
    base, x, y = digits
    module = DigitsModule(copy.deepcopy(base))
    trainer = fit(module, x, y)
    worst, overall = grad_errors(module.grads, reference(base, module.seen, 64))
    assert worst <= 1e-5 and overall <= 1e-5, (worst, overall)
    assert_really_skipped(module, 64)
    kept = int((module.seen[0][2] > 0).sum())
    logged = trainer.callback_metrics
    assert float(logged['capskip/kept_fraction']) == pytest.approx(kept / 64)
    assert float(logged['capskip/distortion']) == pytest.approx(float(module.skip.last.distortion))
    assert 0 < float(logged['capskip/distortion']) <= capskip.DEFAULT_BUDGET + 1e-6
    assert float(logged['capskip/all_rows_fraction']) == 0.0                 # reuse ran the kept rows alone


def test_a_step_whose_backward_ran_every_row_is_logged_and_said(digits):
    "Dropout in `reforward`: the second forward runs every row to replay the masks (exact, nothing saved). The callback logs it beside the rule's kept fraction and the executor says it once (before: the kept fraction alone and no word; stop 54)."
    base, x, y = digits
    model = torch.nn.Sequential(*base[:-1], torch.nn.Dropout(0.1), base[-1])    # the trained MLP, dropout before its head
    module = DigitsModule(copy.deepcopy(model), mode='reforward')
    with pytest.warns(RuntimeWarning, match="draws random numbers.*mode='reuse'"):
        trainer = fit(module, x, y)
    logged = trainer.callback_metrics
    assert float(logged['capskip/kept_fraction']) < 1 and float(logged['capskip/all_rows_fraction']) == 1.0
    assert module.skip.last.all_rows and module.skip.counters()['all_rows_steps'] == 1


def test_accumulate_grad_batches(digits):
    base, x, y = digits
    module = DigitsModule(copy.deepcopy(base))
    fit(module, x, y, batch_size=32, accumulate_grad_batches=2)
    assert len(module.seen) == 2                                            # two micro-batches, one optimizer step
    worst, overall = grad_errors(module.grads, reference(base, module.seen, 32 * 2))   # Lightning divides each by 2
    assert worst <= 1e-5 and overall <= 1e-5, (worst, overall)
    assert_really_skipped(module, 32)


def test_gradient_clip_val_clips_the_skipped_gradient(digits):
    base, x, y = digits
    module = DigitsModule(copy.deepcopy(base))
    fit(module, x, y, gradient_clip_val=1e-2)
    ref = reference(base, module.seen, 64)
    norm = float(torch.cat([g.flatten() for g in ref.values()]).norm())
    assert norm > 2e-2, norm                                                # the clip really bites
    clipped = {n: g * (1e-2 / (norm + 1e-6)) for n, g in ref.items()}       # torch's clip_grad_norm_ formula
    worst, overall = grad_errors(module.clipped, clipped)
    assert worst <= 1e-5 and overall <= 1e-5, (worst, overall)
    worst, _ = grad_errors(module.grads, ref)                               # before clipping: the plain gradient
    assert worst <= 1e-5, worst
    assert_really_skipped(module, 64)


def test_bf16_mixed_precision(digits):
    base, x, y = digits
    module = DigitsModule(copy.deepcopy(base))
    fit(module, x, y, precision='bf16-mixed')
    got, ref = module.grads, reference(base, module.seen, 64, autocast=True)
    fp32 = reference(base, module.seen, 64)
    worst, overall = grad_errors(got, ref)
    assert worst <= 1e-3 and overall <= 1e-3, (worst, overall)              # bf16 forward on both sides (0.0 measured)
    assert grad_errors(got, fp32)[1] > 3e-3, 'autocast was not in effect'
    assert_really_skipped(module, 64)


def test_checkpoint_keeps_each_capskips_generator(digits, tmp_path):
    base, x, y = digits
    module = DigitsModule(copy.deepcopy(base), reweight='rw')
    trainer = fit(module, x, y)                                             # one step: the generator has drawn
    trainer.save_checkpoint(tmp_path / 'last.ckpt')
    saved = module.skip.state_dict()['generator'].clone()
    stored = torch.load(tmp_path / 'last.ckpt', weights_only=True)['capskip']
    assert set(stored) == {'skip'} and torch.equal(stored['skip']['generator'], saved)
    module.skip.loss(module.skip(x), y)                                     # draws again: the state moves on
    assert not torch.equal(module.skip.state_dict()['generator'], saved)
    CAPSkipCallback().on_load_checkpoint(trainer, module, torch.load(tmp_path / 'last.ckpt', weights_only=True))
    assert torch.equal(module.skip.state_dict()['generator'], saved)
    assert set(find_skips(module)) == {'skip'}


def test_usage_errors_name_the_fix(digits):
    base, x, y = digits
    class Plain(DigitsModule):
        def __init__(self, model): super().__init__(model); del self.skip
        def training_step(self, batch, batch_idx): return F.cross_entropy(self.model(batch[0]), batch[1])
    with pytest.raises(ValueError, match='found no capskip.CAPSkip on Plain: set self.skip = capskip.CAPSkip'):
        fit(Plain(copy.deepcopy(base)), x, y)
    class Stepping(DigitsModule):
        def training_step(self, batch, batch_idx): self.skip.step(*batch)
    with pytest.raises(RuntimeError, match=r'skip.step\(x, y\) back-propagates inside training_step'):
        fit(Stepping(copy.deepcopy(base)), x, y)


# ---------------------------------------------------------------- strategy="ddp": Lightning launches rank 1 itself
WORKER = textwrap.dedent('''
    import logging, sys, warnings
    import torch
    import lightning as L
    from capskip.engine.reuse import cached_traces
    from capskip.integrations.lightning import CAPSkipCallback
    from capskip.testing import digits_tensors, trained_digits_mlp
    from test_lightning import DigitsModule

    warnings.simplefilter('error', RuntimeWarning)
    for name in ('lightning.pytorch', 'lightning.fabric'): logging.getLogger(name).setLevel(logging.ERROR)
    out = sys.argv[1]
    X, Y, _, _ = digits_tensors()
    module = DigitsModule(trained_digits_mlp())
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X[:128], Y[:128]), batch_size=32)
    trainer = L.Trainer(max_steps=1, accelerator='cpu', devices=2, strategy='ddp', accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[CAPSkipCallback(sync_dist=True)])
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', category=UserWarning)
        trainer.fit(module, data)
    r = trainer.global_rank
    torch.save({'grads': module.grads, 'seen': module.seen, 'world': trainer.world_size,
                'backend': torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
                'traces': [type(t).__name__ for t in cached_traces(module.model)],
                'logged': {k: float(v) for k, v in trainer.callback_metrics.items()}}, f'{out}/rank{r}.pt')
    trainer.strategy.barrier()
    for proc in getattr(trainer.strategy.launcher, 'procs', []): proc.wait(timeout=120)
''')


@pytest.fixture(scope='module')
def ddp_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('lightning_ddp')
    script = tmp / 'worker.py'
    script.write_text(WORKER)
    here = os.path.dirname(__file__)
    env = {k: v for k, v in os.environ.items() if k not in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'NODE_RANK', 'MASTER_PORT')}
    env.update(OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join([here, env.get('PYTHONPATH', '')]))
    done = subprocess.run([sys.executable, str(script), str(tmp)], env=env, cwd=here, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return [torch.load(tmp / f'rank{r}.pt', weights_only=True) for r in range(2)]


def test_ddp_two_processes_sync_the_skipped_gradients(ddp_ranks, digits):
    "Each rank: two accumulated micro-batches of 32 (the first under DDP's no_sync), one synchronised step."
    base = digits[0]
    assert [r['world'] for r in ddp_ranks] == [2, 2] and ddp_ranks[0]['backend'] == 'gloo'
    assert [len(r['seen']) for r in ddp_ranks] == [2, 2]
    g0, g1 = ddp_ranks[0]['grads'], ddp_ranks[1]['grads']
    for name in g0: assert torch.equal(g0[name], g1[name]), name          # DDP's reducer averaged them
    refs = [reference(base, r['seen'], 32 * 2) for r in ddp_ranks]
    mean = {n: (refs[0][n] + refs[1][n]) / 2 for n in refs[0]}
    worst, overall = grad_errors(g0, mean)
    assert worst <= 1e-5 and overall <= 1e-5, (worst, overall)
    assert grad_errors(refs[0], refs[1])[1] > 0.1, 'the ranks saw the same rows: the sync would not show'
    kept = [int((a > 0).sum()) for r in ddp_ranks for _, _, a in r['seen']]
    assert all(0 < k < 32 for k in kept), kept
    assert all(r['traces'] == ['Traced'] for r in ddp_ranks)
    fraction = sum(kept) / 128                                             # sync_dist=True: the mean over the ranks
    assert all(r['logged']['capskip/kept_fraction_epoch'] == pytest.approx(fraction) for r in ddp_ranks)
