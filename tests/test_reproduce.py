"""`capskip reproduce`: every table's pipeline end to end with --tiny (runs shared, resumable, safe from two processes),
the dry run's estimate from a measured step time, and the real-data path on files written in CIFAR-100's format and a
fake DeiT-S state dict."""
import contextlib
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from capskip.cli.reproduce import reproduce_main
from capskip.runs.reproduce import (DEIT, SCRATCH, Job, get_protocols, list_protocols, protocol_jobs, run_jobs,
                                    tiny_epochs)


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try: code = reproduce_main(argv)
        except SystemExit as e: code = e.code
    return code, out.getvalue(), err.getvalue()


def read_csv(path):
    with open(path, newline='') as f: return list(csv.DictReader(f))


def reproduce_process(*argv):
    "`capskip reproduce ...` in a fresh process (one CPU thread: two of them share this machine's cores)."
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1'}
    return subprocess.Popen([sys.executable, '-m', 'capskip', 'reproduce', *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope='module')
def tiny_all(tmp_path_factory):
    """Every table with --tiny in one results folder, by two processes at once (they share the grid: a run one of them
    trains is locked for the other), then once more in-process, which finds every run finished and writes the tables."""
    out = tmp_path_factory.mktemp('tiny') / 'r'
    procs = [reproduce_process('all', '--tiny', '--quiet', '--out', str(out)) for _ in range(2)]
    outs = [p.communicate(timeout=1200) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    code, text, err = run(['all', '--tiny', '--quiet', '--out', str(out)])
    assert code == 0, err[-2000:]
    return out, text, ''.join(o[0] for o in outs)


def test_list_names_every_table_with_its_grid_and_needs():
    code, text, _ = run(['--list'])
    assert code == 0
    for name in list_protocols(): assert f'{name}:' in text
    assert 'ImageNet-1k DeiT-S/16 weights' in text and 'resnet18gn_cifar100_b1: capskip, capskip_rw' in text
    assert 'masked/ --set mode=masked' in text


def test_grids_are_the_papers():
    t4 = protocol_jobs(get_protocols('table4'))
    assert {(j.arm, j.epochs) for j in t4} == {(a, e) for a in ('dense', 'capskip') for e in (100, 120, 140, 160, 200)}
    assert sorted({j.seed for j in t4}) == [2, 3, 4, 5, 6]
    t3 = protocol_jobs(get_protocols('table3'))
    assert sorted(j.epochs for j in t3 if j.arm == 'dense' and j.seed == 17) == [30, 59, 80, 103]
    t6 = protocol_jobs(get_protocols('table6'))
    assert sorted(dict(j.overrides)['policy_kw.budget'] for j in t6 if j.folder.startswith('budget_')) == [0.09, 0.15, 0.25, 0.4, 0.6, 1.0]
    every = protocol_jobs(get_protocols('all'))
    assert len(every) == len(set(every)) < sum(len(protocol_jobs(get_protocols(n))) for n in list_protocols())


@pytest.mark.parametrize('argv, message', [
    (['table9'], "unknown table 'table9'"), (['table4'], 'pass --data-root DIR'), ([], 'name a table'),
    (['table2', '--tiny', '--set', 'seed=3'], 'grid fixes'), (['table4', '--tiny', '--set', 'clip_norm=-1'], 'clip_norm'),
    (['table5', '--tiny', '--bar', 'strict'], '--bar takes'), (['table4', '--tiny', '--device', 'cuda:7'], 'cuda'),
])
def test_usage_errors_are_one_line_and_exit_2(argv, message, tmp_path):
    if argv[-1:] == ['cuda:7'] and torch.cuda.is_available(): pytest.skip('a CUDA machine')
    code, _, err = run(argv + ['--out', str(tmp_path / 'r')])
    assert code == 2 and message in err and 'Traceback' not in err


def test_every_table_runs_tiny_end_to_end(tiny_all):
    out, text, parallel = tiny_all
    jobs = protocol_jobs(get_protocols('all'), tiny=True)
    assert f'runs: {len(jobs)} reused' in text                                   # the two processes trained everything
    assert 'FAILED' not in parallel and parallel.count(' done') >= 2             # both trained some of the grid
    assert len(list(out.rglob('final.json'))) == len(jobs)                     # shared runs trained once
    for name in list_protocols():
        md = (out / 'paper' / f'{name}.md').read_text()
        assert 'Tiny run' in md and '## Notes' in md, name
    eq = read_csv(out / 'paper' / 'table4_equal_epochs.csv')
    assert [r['b'] for r in eq] == [f'{SCRATCH}/dense@{e}' for e in (1, 2, 3)] and all(r['n'] == '2' for r in eq)
    assert all(r['time_ratio_label'] in ('faster', 'slower', 'unresolved') for r in eq)
    comp = read_csv(out / 'paper' / 'table5_composition.csv')
    assert all(r['n'] == '2' and r['bar_passed'] in ('yes', 'no', 'no (time)', 'no (acc.)', '– (no spread between seeds)')
               for r in comp), [(r['a'], r['bar_passed']) for r in comp]
    assert comp[5]['a'].startswith('masked/') and comp[6]['a'].startswith('rw/')     # composites from their own folders
    assert read_csv(out / 'paper' / 'table5_confound.csv')[0]['b'] == f'{SCRATCH}/dense@3'   # across recipes
    kept = read_csv(out / 'paper' / 'table6_kept.csv')
    assert [r['runs'] for r in kept] == ['1'] * 6 and kept[0]['paper_kept_fraction'] == '0.848'
    seeds = read_csv(out / 'paper' / 'table2_seeds.csv')
    assert [r['seed'] for r in seeds] == ['17', '29']
    assert len(read_csv(out / 'paper' / 'collapse.csv')) == 4
    assert read_csv(out / 'paper' / 'table1_phases.csv')[0]['mode'] == 'dense'      # bench step measured on this CPU
    for png in ('kept_vs_budget', 'table4_accuracy_time', 'table1_phases', 'collapse_curves'):
        assert (out / 'paper' / f'{png}.png').exists(), png


def test_tiny_runs_record_the_protocol(tiny_all):
    out, _, _ = tiny_all
    b1 = out / 'resnet18gn_cifar100_b1' / 'capskip_rw' / 'seed2' / f'ep{tiny_epochs(200)}'
    rows = [json.loads(l) for l in (b1 / 'results.jsonl').read_text().splitlines()]
    assert [r['policy']['capskip_active'] for r in rows] == [0.0, 1.0, 0.0]        # warm-up 1, then skip, then the dense tail
    assert rows[0]['rows_backprop'] == rows[0]['rows_forwarded']
    ft = json.loads((out / DEIT / 'capskip' / 'seed17' / f'ep{tiny_epochs(103)}' / 'final.json').read_text())
    assert ft['val_acc'] is None and ft['test_acc'] is not None                      # no validation split, as the recipe
    ib = [json.loads(l) for l in (out / 'resnet18gn_cifar100_ib' / 'infobatch' / 'seed2' / 'ep3' / 'results.jsonl').read_text().splitlines()]
    assert all('final_batch_rows' in r['policy'] for r in ib)


def test_rerun_reuses_and_a_killed_run_resumes(tiny_all):
    out, _, _ = tiny_all
    victim = out / SCRATCH / 'capskip' / 'seed2' / 'ep3'
    (victim / 'final.json').unlink()                                                # as if killed after its last epoch
    (victim / 'results.jsonl').write_text((victim / 'results.jsonl').read_text().splitlines()[0] + '\n')   # and its rows
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                       # the thread count it was trained with: a CPU run resumes with the same
    try: code, text, _ = run(['table4', '--tiny', '--quiet', '--out', str(out)])
    finally: torch.set_num_threads(threads)
    assert code == 0 and '1 done' in text and '11 reused' in text
    assert len((victim / 'results.jsonl').read_text().splitlines()) == 3            # rebuilt from the checkpoint
    assert json.loads((victim / 'final.json').read_text())['complete'] is True


def test_dry_run_lists_the_grid_and_estimates_from_a_measured_step(tiny_all):
    out, _, _ = tiny_all
    code, text, _ = run(['table5', '--tiny', '--dry-run', '--out', str(out)])
    assert code == 0 and 'nothing left to run' in text and 'complete' in text
    fresh = out.parent / 'fresh'
    (fresh / 'bench').mkdir(parents=True)
    for f in (out / 'bench').glob('*.json'): (fresh / 'bench' / f.name).write_bytes(f.read_bytes())   # this CPU's measurement
    code, text, _ = run(['table4', '--tiny', '--dry-run', '--out', str(fresh)])
    assert code == 0 and '12 runs' in text and '12 new' in text
    hours = float(text.split('estimate: ')[1].split(' device-hours')[0])
    assert 0 < hours < 0.1                                      # tiny runs: minutes at most


@pytest.fixture(scope='module')
def real_files(tmp_path_factory):
    "CIFAR-100 in its real pickle format (1 train and 1 test image per class) and a DeiT-S state dict (random weights)."
    import timm
    from capskip.testing import write_fake_cifar100
    root = tmp_path_factory.mktemp('real')
    write_fake_cifar100(root / 'cifar', per_class_train=1, per_class_test=1)
    model = timm.create_model('deit_small_patch16_224', pretrained=False, img_size=32, num_classes=1000)
    torch.save(model.state_dict(), root / 'deit_s.pth')
    return root


def test_real_grid_checks_and_dry_run_on_real_format_files(real_files, tmp_path):
    data, weights = str(real_files / 'cifar'), str(real_files / 'deit_s.pth')
    code, _, err = run(['table2', '--data-root', data, '--out', str(tmp_path / 'r')])
    assert code == 2 and '--pretrained FILE' in err
    code, text, _ = run(['table2', '--data-root', data, '--pretrained', weights, '--dry-run', '--no-bench', '--out', str(tmp_path / 'r')])
    assert code == 0 and '9 runs' in text and 'ep59' in text and 'not measured' in text


def test_dry_run_lists_and_estimates_before_the_data_is_there(tmp_path):
    code, text, err = run(['table2', '--dry-run', '--no-bench', '--out', str(tmp_path / 'r')])
    assert code == 0 and '9 runs' in text and 'not measured' in text
    assert 'note: these tables train on CIFAR-100' in err and 'note: the fine-tuning tables start from' in err
    assert 'Traceback' not in err
    code, _, err = run(['table2', '--out', str(tmp_path / 'r')])                   # a real run still refuses
    assert code == 2 and 'pass --data-root DIR' in err


@pytest.mark.parametrize('recipe, arm, overrides', [
    (DEIT, 'dense', {'data_kw.img_size': 32, 'batch_size': 50, 'amp': 'none'}),
    (SCRATCH, 'capskip', {'data_kw.img_size': 16, 'batch_size': 45, 'mode': 'reforward'}),
], ids=['deit-pretrained-no-val', 'resnet-cifar'])
def test_real_data_path_trains_one_epoch(real_files, tmp_path, recipe, arm, overrides):
    "The paper's recipe on real-format CIFAR-100 files (and DeiT-S weights), shrunk only in image size and batch."
    named = {'data_root': str(real_files / 'cifar'), 'pretrained': str(real_files / 'deit_s.pth'), 'device': 'cpu'}  # as `all` passes them
    overrides = {**overrides, 'num_workers': 0, 'eval_batch_size': 100, 'warmup': False}
    rec = run_jobs([Job('', recipe, arm, 17 if recipe == DEIT else 2, 1)], tmp_path, named, overrides, progress='none')[0]
    assert rec['status'] == 'done', rec.get('error')
    final, config = rec['final'], json.loads((Path(rec['folder']) / 'config.json').read_text())
    assert config['data'] == 'cifar100' and config['model'] == {DEIT: 'deit_s', SCRATCH: 'resnet18_gn'}[recipe]
    if recipe == DEIT:
        assert config['pretrained'].endswith('deit_s.pth') and final['val_acc'] is None and final['test_acc'] is not None
        assert final['rows_forwarded_frac'] == 1.0                                   # all 100 training rows, none held out
    else:
        assert final['val_acc'] is not None and config['cycle_momentum'] is True and config['pretrained'] is None
