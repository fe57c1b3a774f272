"""The training runner: results-folder contract, exact resume (in-process stop and a real SIGKILL), reuse of
finished runs, refusal of mismatched folders, schedule and lr scaling as recorded, clear errors; diverged runs
recorded as such (value checks on, as on CPU, and off, as on CUDA) with the last finite checkpoint kept."""
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from capskip.cli.runs import train_main
from capskip.runs.build import build_model, build_splits, evaluate
from capskip.runs.recipes import resolve_config
from capskip.runs.runio import load_checkpoint, read_json, read_jsonl, run_dir
from capskip.runs.schedules import lr_at, scaled_lr, step_progress
from capskip.runs.divergence import DIVERGED_EXIT
from capskip.runs.train import train

ROOT = Path(__file__).resolve().parents[1]
TIMING = ('train_time_s', 'epoch_time_s', 'eval_time_s', 'warmup_time_s')
ROW_KEYS = {'epoch', 'train_time_s', 'lr', 'loss', 'train_acc', 'val_acc', 'test_acc', 'rows_forwarded',
            'rows_backprop', 'kept_fraction', 'mean_distortion', 'rows_pruned'}
FINAL_KEYS = {'recipe', 'arm', 'seed', 'epochs', 'train_time_s', 'val_acc', 'test_acc', 'rows_backprop_frac',
              'kept_fraction', 'complete'}


def small(arm='capskip', recipe='digits', epochs=3, seed=1, **over):
    return resolve_config(recipe, dict({'batch_size': 256}, **over), arm=arm, seed=seed, epochs=epochs)


def strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def model_state(out, cfg):
    return load_checkpoint(run_dir(out, cfg.recipe, cfg.arm, cfg.seed, cfg.epochs) / 'checkpoint.pt')['model']


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    "An uninterrupted 3-epoch CAPSkip run (shared by several tests)."
    out = tmp_path_factory.mktemp('ref')
    cfg = small()
    return out, cfg, train(cfg, out, progress='none')


def test_results_folder_contract(reference):
    out, cfg, final = reference
    folder = run_dir(out, 'digits', 'capskip', 1, 3)
    assert sorted(p.name for p in folder.iterdir()) == ['checkpoint.pt', 'config.json', 'final.json', 'results.jsonl']
    rows = read_jsonl(folder / 'results.jsonl')
    assert [r['epoch'] for r in rows] == [1, 2, 3] and all(ROW_KEYS <= set(r) for r in rows)
    n_train = len(build_splits(cfg).train)
    assert all(r['rows_forwarded'] == n_train and 0 < r['rows_backprop'] <= n_train for r in rows)
    assert all(r['kept_fraction'] == pytest.approx(r['rows_backprop'] / r['rows_forwarded']) for r in rows)
    times = [r['train_time_s'] for r in rows]
    assert times == sorted(times) and times[0] > 0
    assert all(0 <= r['val_acc'] <= 1 and 0 <= r['test_acc'] <= 1 and 0 <= r['train_acc'] <= 1 for r in rows)
    assert FINAL_KEYS <= set(final) and final['complete'] is True
    assert final['rows_backprop_frac'] == pytest.approx(sum(r['rows_backprop'] for r in rows) / (n_train * 3))
    assert final['kept_fraction'] == pytest.approx(sum(r['kept_fraction'] for r in rows) / 3)
    assert final['train_time_s'] == rows[-1]['train_time_s'] and final['test_acc'] == rows[-1]['test_acc']
    config = read_json(folder / 'config.json')
    assert config['arm'] == 'capskip' and config['seed'] == 1 and config['epochs'] == 3 and config['batch_size'] == 256
    meta = config['meta']
    # the torch that ran: its installed distribution's version, the running module's up to the local build tag
    assert meta['versions']['torch'] == importlib.metadata.version('torch')
    assert meta['versions']['torch'].split('+')[0] == torch.__version__.split('+')[0]
    assert meta['seed'] == 1 and meta['device'] == 'cpu' and 'start_time' in meta and 'git_commit' in meta


@pytest.mark.parametrize('arm', ['capskip', 'dense'])
def test_train_accuracy_matches_a_recount(arm, tmp_path):
    "With lr 0 the model never changes, so the logged train accuracy must equal a recount of the initial model's."
    cfg = small(arm, epochs=1, base_lr=0.0, warmup=False)
    train(cfg, tmp_path, progress='none')
    row = read_jsonl(run_dir(tmp_path, 'digits', arm, 1, 1) / 'results.jsonl')
    splits = build_splits(cfg)
    model = build_model(cfg, splits.num_classes, splits.in_chans)
    assert row[0]['train_acc'] == pytest.approx(evaluate(model, splits.train, 512, torch.device('cpu')), abs=1e-12)


def test_lr_follows_the_compressed_schedule(reference):
    out, cfg, _ = reference
    rows = read_jsonl(run_dir(out, 'digits', 'capskip', 1, 3) / 'results.jsonl')
    n_steps = rows[0]['steps']
    peak = scaled_lr(cfg.base_lr, cfg.batch_size, cfg.base_batch)
    ckpt = load_checkpoint(run_dir(out, 'digits', 'capskip', 1, 3) / 'checkpoint.pt')
    assert ckpt['scheduler']['peak_lr'] == pytest.approx(peak) == pytest.approx(0.2)
    for r in rows:   # the lr logged is the one of the epoch's last step
        assert r['lr'] == pytest.approx(lr_at(vars(cfg), peak, step_progress(r['epoch'] - 1, n_steps - 1, n_steps, 3)))


def test_stop_and_resume_reaches_the_same_state(reference, tmp_path):
    out, cfg, final = reference
    partial = train(cfg, tmp_path, progress='none', stop_after=1)
    assert partial['epoch'] == 1 and not (run_dir(tmp_path, 'digits', 'capskip', 1, 3) / 'final.json').exists()
    with pytest.raises(ValueError, match='--resume'):
        train(cfg, tmp_path, progress='none')
    resumed = train(cfg, tmp_path, progress='none', resume=True)
    a, b = model_state(out, cfg), model_state(tmp_path, cfg)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert strip(read_jsonl(run_dir(tmp_path, 'digits', 'capskip', 1, 3) / 'results.jsonl')) == \
        strip(read_jsonl(run_dir(out, 'digits', 'capskip', 1, 3) / 'results.jsonl'))
    assert {k: v for k, v in resumed.items() if k not in TIMING} == {k: v for k, v in final.items() if k not in TIMING}
    assert len(read_json(run_dir(tmp_path, 'digits', 'capskip', 1, 3) / 'config.json')['meta']['resumed']) == 1


@pytest.mark.parametrize('arm', ['infobatch_capskip', 'selective_backprop'])
def test_resume_is_exact_for_stateful_policies(arm, tmp_path):
    "InfoBatch keeps per-row scores, Selective-Backprop pools rows (and gradients) across batches and epochs."
    cfg = small(arm, 'digits_ib', epochs=4, seed=2, batch_size=128)
    train(cfg, tmp_path / 'a', progress='none')
    train(cfg, tmp_path / 'b', progress='none', stop_after=2)
    train(cfg, tmp_path / 'b', progress='none', resume=True)
    a, b = model_state(tmp_path / 'a', cfg), model_state(tmp_path / 'b', cfg)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra = read_jsonl(run_dir(tmp_path / 'a', cfg.recipe, arm, 2, 4) / 'results.jsonl')
    assert strip(ra) == strip(read_jsonl(run_dir(tmp_path / 'b', cfg.recipe, arm, 2, 4) / 'results.jsonl'))
    if arm == 'infobatch_capskip':
        assert any(r['rows_pruned'] > 0 for r in ra[:-1]) and ra[-1]['rows_pruned'] == 0   # full-data tail


def test_killed_process_resumes_to_the_same_state(reference, tmp_path):
    "SIGKILL a real `python -m capskip train` after its first checkpoint, then --resume."
    out, cfg, _ = reference
    folder = run_dir(tmp_path, 'digits', 'capskip', 1, 3)
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))  # same reduction order as this process
    cmd = [sys.executable, '-m', 'capskip', 'train', '--recipe', 'digits', '--arm', 'capskip', '--seed', '1',
           '--epochs', '3', '--batch-size', '256', '--out', str(tmp_path), '--quiet']
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (folder / 'checkpoint.pt').exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if proc.poll() is None: proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (folder / 'checkpoint.pt').exists()
    killed_at = load_checkpoint(folder / 'checkpoint.pt')['epoch']
    assert train_main(cmd[4:] + ['--resume']) == 0
    a, b = model_state(out, cfg), model_state(tmp_path, cfg)
    assert all(torch.equal(a[k], b[k]) for k in a), f'killed after epoch {killed_at}'
    assert not list(folder.glob('.*.tmp'))                       # no half-written files left behind


def test_finished_runs_are_reused_and_mismatches_refused(reference):
    out, cfg, final = reference
    folder = run_dir(out, 'digits', 'capskip', 1, 3)
    before = (folder / 'results.jsonl').stat().st_mtime_ns
    again = train(cfg, out, progress='none')
    assert again == final and (folder / 'results.jsonl').stat().st_mtime_ns == before
    with pytest.raises(ValueError, match='different configuration'):
        train(small(weight_decay=0.0), out, progress='none')


def test_dense_arm_backpropagates_everything_and_bf16_clipping_smoothing_run(tmp_path):
    cfg = small('dense', epochs=1, amp='bf16', clip_norm=1.0, label_smoothing=0.1, schedule='warmup_cosine')
    final = train(cfg, tmp_path, progress='none')
    assert final['rows_backprop_frac'] == 1.0 and final['kept_fraction'] == 1.0
    row = read_jsonl(run_dir(tmp_path, 'digits', 'dense', 1, 1) / 'results.jsonl')[0]
    assert row['loss'] is not None and 0 < row['loss'] < 10


def test_cli_flags_reach_the_saved_config(tmp_path, capsys):
    assert train_main(['--recipe', 'digits', '--arm', 'capskip', '--seed', '4', '--epochs', '1', '--budget', '0.3',
                 '--batch-size', '256', '--set', 'weight_decay=0', '--set', 'eval_every=2', '--out', str(tmp_path),
                 '--quiet']) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary['arm'] == 'capskip' and summary['seed'] == 4
    config = read_json(run_dir(tmp_path, 'digits', 'capskip', 4, 1) / 'config.json')
    assert (config['policy_kw']['budget'], config['weight_decay'], config['eval_every']) == (0.3, 0.0, 2)


@pytest.mark.parametrize('argv, message', [
    (['--arm', 'nope'], 'unknown arm'),
    (['--set', 'policy_kw.budgte=0.1'], 'not an option of any policy'),
    (['--set', 'epochs=1.5'], 'epochs must be int'),
])
def test_bad_cli_input_is_a_clear_error(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        train_main(argv + ['--out', str(tmp_path), '--quiet'])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / 'digits').exists()


def test_cifar_recipe_without_root_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match='--data-root'):
        train(resolve_config('resnet18gn_cifar100', {'data_root': None}, epochs=1), tmp_path, progress='none')


def test_missing_cifar_root_names_the_path(tmp_path):
    cfg = resolve_config('resnet18gn_cifar100', {'data_root': str(tmp_path / 'nowhere')}, epochs=1)
    with pytest.raises((FileNotFoundError, ValueError), match='nowhere'):
        train(cfg, tmp_path, progress='none')


def test_cifar_recipe_on_real_format_files_resumes_exactly_with_augmentation(tmp_path):
    "The CIFAR-100 path (pickled files, augmentation, DataLoader workers) on a tiny fake data set in the real layout."
    from capskip.testing.files import write_fake_cifar100
    write_fake_cifar100(tmp_path / 'data', per_class_train=3, per_class_test=1)
    over = {'data_root': str(tmp_path / 'data'), 'model': 'digits_cnn', 'model_kw': {}, 'batch_size': 64,
            'eval_batch_size': 100, 'num_workers': 0}     # model_kw: the recipe's ResNet options do not fit digits_cnn
    cfg = resolve_config('resnet18gn_cifar100', over, arm='capskip', seed=2, epochs=2)
    final = train(cfg, tmp_path / 'a', progress='none')
    assert final['complete'] and final['rows_forwarded_frac'] == 1.0
    rows = read_jsonl(run_dir(tmp_path / 'a', cfg.recipe, 'capskip', 2, 2) / 'results.jsonl')
    assert rows[0]['rows_forwarded'] == 270                         # 300 rows minus the stratified 10% validation
    # resumed with two loader worker processes: augmentation is seeded by (seed, epoch, row), so nothing changes
    cfg_workers = resolve_config('resnet18gn_cifar100', dict(over, num_workers=2), arm='capskip', seed=2, epochs=2)
    train(cfg_workers, tmp_path / 'b', progress='none', stop_after=1)
    train(cfg_workers, tmp_path / 'b', progress='none', resume=True)
    a, b = model_state(tmp_path / 'a', cfg), model_state(tmp_path / 'b', cfg)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_pretrained_weights_reach_the_model_and_fine_tuning_refuses_without(tmp_path):
    from capskip.runs.models import create_model
    with pytest.raises(ValueError, match='--pretrained PATH'):
        build_model(resolve_config('deit_s_cifar100_finetune'), 100, 3)
    torch.manual_seed(123)
    source = create_model('vit_tiny', num_classes=7)
    torch.save(source.state_dict(), tmp_path / 'w.pt')
    cfg = resolve_config('deit_s_cifar100_finetune', {'model': 'vit_tiny', 'data_kw.img_size': 32,
                                                      'pretrained': str(tmp_path / 'w.pt'), 'model_kw': {}})
    model = build_model(cfg, 100, 3)
    own, src = model.state_dict(), source.state_dict()
    assert all(torch.equal(own[k], src[k]) for k in own if not k.startswith('head.'))
    assert own['head.weight'].shape == (100, 192)


def test_cli_reports_run_errors_without_a_traceback(tmp_path, capsys):
    assert train_main(['--recipe', 'resnet18gn_cifar100', '--data-root', str(tmp_path / 'nowhere'), '--out', str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert 'nowhere' in err and 'Traceback' not in err
    with pytest.raises(SystemExit):
        train_main(['--recipe', 'deit_s_cifar100_finetune', '--out', str(tmp_path)])
    assert '--pretrained PATH' in capsys.readouterr().err


# ---------------------------------------------------------------- diverged runs (issue 10)
def no_value_checks(monkeypatch):
    "As on CUDA: the selector and the loss do not read their inputs' values, so nothing raises at the first NaN."
    import capskip.checks
    monkeypatch.setattr(capskip.checks, 'values_checked', lambda check_values, *tensors: False)


@pytest.mark.parametrize('arm', ['dense', 'infobatch', 'random_rescale', 'capskip'])
def test_a_diverged_run_is_a_result_not_a_zero_loss(arm, tmp_path, monkeypatch):
    "--set base_lr=1e6 with value checks off: the per-epoch read stops the run; status, epoch and step are recorded."
    import capskip.runs.train as runner
    no_value_checks(monkeypatch)
    monkeypatch.setattr(runner, 'diverged_after_error', lambda *a: pytest.fail('the run raised: checks were not off'))
    cfg = small(arm, epochs=3, warmup=False, base_lr=1e6)
    final = train(cfg, tmp_path, progress='none')
    folder = run_dir(tmp_path, 'digits', arm, 1, 3)
    assert final == read_json(folder / 'final.json')
    assert (final['status'], final['complete'], final['test_acc'], final['val_acc']) == ('diverged', False, None, None)
    d = final['diverged']
    assert d['what'] in ('loss', 'gradient', 'parameters') and 1 <= d['step'] <= d['steps'] and d['epoch'] >= 1
    assert d['peak_lr'] == pytest.approx(scaled_lr(1e6, 256, cfg.base_batch))
    rows = read_jsonl(folder / 'results.jsonl') if (folder / 'results.jsonl').exists() else []
    assert len(rows) == final['last_finite_epoch'] == d['epoch'] - 1        # only finite epochs are logged
    assert all(r['loss'] is not None and r['loss'] > 0 for r in rows)      # never a NaN written as 0.0
    monkeypatch.setattr(runner, 'train_epoch', lambda *a, **k: pytest.fail('a diverged run was recomputed'))
    assert train(cfg, tmp_path, progress='none') == final


def test_cli_diverged_run_exits_3_with_one_line_naming_divergence(tmp_path, capsys):
    "On CPU the value checks raise at the first NaN logit: the runner turns that into the same 'diverged' result."
    argv = ['--recipe', 'digits', '--arm', 'capskip', '--seed', '1', '--epochs', '3', '--batch-size', '256',
            '--set', 'base_lr=1e6', '--set', 'warmup=false', '--out', str(tmp_path), '--quiet']
    assert train_main(argv) == DIVERGED_EXIT == 3
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith('capskip train: run diverged: non-finite') and 'Traceback' not in err[0]
    assert 'learning rate' in err[0] and 'fp16' not in err[0] and 'not numerical precision' in err[0]
    final = read_json(run_dir(tmp_path, 'digits', 'capskip', 1, 3) / 'final.json')
    assert final['status'] == 'diverged' and final['diverged']['epoch'] == 1
    assert train_main(argv) == 3                                            # asked again: still says so, not rerun
    again = capsys.readouterr()
    assert 'diverged run, not recomputed' in again.out and 'run diverged' in again.err


def test_the_last_finite_checkpoint_is_kept(tmp_path):
    "Epoch 1 finishes; its checkpoint's weights are then scaled so that epoch 2 overflows: epoch 1's checkpoint stays."
    cfg = small('dense', epochs=3, warmup=False)
    train(cfg, tmp_path, progress='none', stop_after=1)
    folder = run_dir(tmp_path, 'digits', 'dense', 1, 3)
    ckpt = load_checkpoint(folder / 'checkpoint.pt')
    ckpt['model'] = {k: v * 1e30 if v.is_floating_point() else v for k, v in ckpt['model'].items()}
    torch.save(ckpt, folder / 'checkpoint.pt')
    kept = load_checkpoint(folder / 'checkpoint.pt')
    final = train(cfg, tmp_path, progress='none', resume=True)
    assert final['status'] == 'diverged' and final['diverged']['epoch'] == 2 and final['last_finite_epoch'] == 1
    after = load_checkpoint(folder / 'checkpoint.pt')
    assert after['epoch'] == 1 and all(torch.equal(after['model'][k], kept['model'][k]) for k in kept['model'])
    assert len(read_jsonl(folder / 'results.jsonl')) == 1


def test_finite_watch_reads_nothing_per_step():
    "The per-step check runs on the meta device, where any host read (item, bool, tolist) would raise."
    from capskip.runs.divergence import FiniteWatch, grad_norm
    w = FiniteWatch('meta')
    model = torch.nn.Linear(4, 3, device='meta')
    for p in model.parameters(): p.grad = torch.empty_like(p)
    for step in range(3): w.add(step, torch.empty((), device='meta'), grad_norm(model.parameters()))
    with pytest.raises((RuntimeError, NotImplementedError)):
        w.read(1, 3)                                        # the one read per epoch is where the host is reached


def test_resume_without_its_checkpoint_is_an_error_and_nothing_to_resume_is_said(tmp_path, capsys):
    argv = ['--recipe', 'digits', '--arm', 'dense', '--seed', '1', '--epochs', '2', '--batch-size', '256',
            '--set', 'warmup=false', '--out', str(tmp_path), '--quiet']
    assert train_main(argv + ['--stop-after', '1', '--resume']) == 0
    assert 'nothing to resume' in capsys.readouterr().err                    # a fresh folder: said, then started
    folder = run_dir(tmp_path, 'digits', 'dense', 1, 2)
    (folder / 'checkpoint.pt').unlink()
    for extra in (['--resume'], []):
        assert train_main(argv + extra) == 2
        err = capsys.readouterr().err
        assert 'no checkpoint.pt' in err and '1 finished epoch' in err and 'Traceback' not in err
    assert len(read_jsonl(folder / 'results.jsonl')) == 1                      # nothing was overwritten


def test_a_run_that_cannot_start_leaves_no_empty_folder(tmp_path):
    cfg = resolve_config('resnet18gn_cifar100', {'data_root': str(tmp_path / 'nowhere')}, epochs=1)
    with pytest.raises((FileNotFoundError, ValueError)):
        train(cfg, tmp_path / 'out', progress='none')
    assert not (tmp_path / 'out' / 'resnet18gn_cifar100').exists()
