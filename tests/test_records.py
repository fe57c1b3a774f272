"""A run's record is whole and is what its folder says (issue 22): a crash at every write point resumes to the
uninterrupted run with one result row per epoch; SIGINT/SIGTERM say what is kept in one line; result files honour
the umask; a full disk is one line and keeps the last checkpoint; the report refuses incomplete records, mixed
configurations, aliased seeds and unreadable files — listing them, never crashing."""
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import capskip.runs.runio as runio
import capskip.runs.train as runner
from capskip.analysis.report import build_report
from capskip.analysis.results import load_runs, read_run
from capskip.cli.runs import report_main, sweep_main, train_main
from capskip.runs.recipes import resolve_config
from capskip.runs.runio import load_checkpoint, read_json, read_jsonl, run_dir, write_json
from capskip.runs.sweep import sweep_grid
from capskip.runs.train import train

ROOT = Path(__file__).resolve().parents[1]
TIMING = ('train_time_s', 'epoch_time_s', 'eval_time_s', 'warmup_time_s')
EPOCHS = 2


TINY = {'data_kw.img_size': 8, 'data_kw.n_train': 256, 'batch_size': 128, 'warmup': False, 'mode': 'reforward'}  # 2 steps an epoch
TINY_FLAGS = [f'--set={k}={str(v).lower()}' for k, v in TINY.items()]


def small(epochs=EPOCHS, **over):
    return resolve_config('digits', dict(TINY, **over), arm='capskip', seed=1, epochs=epochs)


def strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp('ref')
    cfg = small()
    final = train(cfg, out, progress='none')
    folder = run_dir(out, 'digits', 'capskip', 1, EPOCHS)
    return cfg, final, read_jsonl(folder / 'results.jsonl'), load_checkpoint(folder / 'checkpoint.pt')['model']


class Crash(Exception):
    "The process dying at a write point."


# the writes of a fresh 2-epoch run, in order: config.json, (checkpoint, results) per epoch, final.json
WRITES = ['config.json', 'checkpoint 1', 'results 1', 'checkpoint 2', 'results 2', 'final.json']


@pytest.mark.parametrize('crash_at', range(len(WRITES) + 1), ids=[f'before {w}' for w in WRITES] + ['after final.json'])
def test_a_crash_at_every_write_point_resumes_to_the_whole_record(reference, crash_at, tmp_path, monkeypatch):
    cfg, final, rows, weights = reference
    calls = []
    def dying(real):
        def write(path, obj):
            calls.append(Path(path).name)
            if len(calls) == crash_at + 1: raise Crash(f'killed before writing {Path(path).name}')
            return real(path, obj)
        return write
    for name in ('save_checkpoint', 'write_jsonl', 'write_json'):
        monkeypatch.setattr(runner, name, dying(getattr(runio, name)))
    try: train(cfg, tmp_path, progress='none')
    except Crash: pass
    monkeypatch.undo()
    assert calls[:len(WRITES)] == ['config.json', 'checkpoint.pt', 'results.jsonl', 'checkpoint.pt', 'results.jsonl',
                                   'final.json'][:len(calls)]                 # the write points named above
    folder = run_dir(tmp_path, 'digits', 'capskip', 1, EPOCHS)
    if crash_at < len(WRITES):                                   # the crash left no result that claims to be complete
        assert not (folder / 'final.json').exists()
        assert not read_run(folder, tmp_path).complete
    resumed = train(cfg, tmp_path, resume=True, progress='none')
    assert strip(read_jsonl(folder / 'results.jsonl')) == strip(rows)
    assert {k: v for k, v in resumed.items() if k not in TIMING} == {k: v for k, v in final.items() if k not in TIMING}
    model = load_checkpoint(folder / 'checkpoint.pt')['model']
    assert all(torch.equal(model[k], weights[k]) for k in weights)
    run = read_run(folder, tmp_path)
    assert run.complete and len(run.history) == EPOCHS, run.problem
    assert not list(folder.glob('.*.tmp'))


def test_a_finished_run_with_lost_rows_is_flagged_then_repaired_by_its_command(reference, tmp_path):
    cfg, final, rows, _ = reference
    train(cfg, tmp_path, progress='none')
    folder = run_dir(tmp_path, 'digits', 'capskip', 1, EPOCHS)
    for damage in (lambda p: p.write_text(p.read_text().splitlines()[0] + '\n'), lambda p: p.write_text(''), Path.unlink):
        damage(folder / 'results.jsonl')
        problem = read_run(folder, tmp_path).problem
        assert problem and 'final.json says complete but' in problem and 'rebuilds' in problem
        report = build_report(tmp_path)
        assert any('final.json says complete but' in p for _, p in report.notes.items)
        assert not report.groups                                     # the run takes no part in any table
        train(cfg, tmp_path, progress='none')                        # the same command: rebuilt from checkpoint.pt
        assert strip(read_jsonl(folder / 'results.jsonl')) == strip(rows) and read_run(folder, tmp_path).complete


@pytest.mark.parametrize('sig, code', [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_sigint_and_sigterm_say_what_is_kept_and_resume(sig, code, tmp_path):
    "The signal lands after the first checkpoint; `--resume` then continues with one row per epoch."
    epochs = 4000                                                # never reached: the signal lands after the first epoch
    folder = run_dir(tmp_path, 'digits', 'capskip', 1, epochs)
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    cmd = [sys.executable, '-m', 'capskip', 'train', '--recipe', 'digits', '--arm', 'capskip', '--seed', '1',
           '--epochs', str(epochs), *TINY_FLAGS, '--out', str(tmp_path), '--quiet']
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (folder / 'checkpoint.pt').exists() and proc.poll() is None and time.time() < deadline: time.sleep(0.02)
    assert proc.poll() is None, 'the run ended before its first checkpoint: ' + proc.stderr.read()[-800:]
    proc.send_signal(sig)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == code, err
    assert 'Traceback' not in err and err.count('\n') == 1, err
    name = 'SIGINT' if sig == signal.SIGINT else 'SIGTERM'
    assert err.startswith(f'capskip: {name}: stopped') and '--resume' in err
    kept = load_checkpoint(folder / 'checkpoint.pt')['epoch']
    assert f'keeps its {kept} finished epoch(s)' in err, err
    assert train_main(cmd[4:] + ['--resume', '--stop-after', str(kept + 1)]) == 0      # it continues where it stopped
    assert [r['epoch'] for r in read_jsonl(folder / 'results.jsonl')] == list(range(1, kept + 2))
    assert load_checkpoint(folder / 'checkpoint.pt')['epoch'] == kept + 1


def test_result_files_honour_the_umask(tmp_path):
    old = os.umask(0o027)
    try: train(small(), tmp_path, progress='none')
    finally: os.umask(old)
    folder = run_dir(tmp_path, 'digits', 'capskip', 1, EPOCHS)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert modes == {n: 0o640 for n in ('checkpoint.pt', 'config.json', 'final.json', 'results.jsonl')}


def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    argv = ['--recipe', 'digits', '--arm', 'capskip', '--seed', '1', '--epochs', str(EPOCHS), *TINY_FLAGS,
            '--out', str(tmp_path), '--quiet']
    assert train_main(argv + ['--stop-after', '1']) == 0
    folder = run_dir(tmp_path, 'digits', 'capskip', 1, EPOCHS)
    before = (folder / 'checkpoint.pt').read_bytes()
    capsys.readouterr()
    def full(fd): raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(runio.os, 'fsync', full)
    assert train_main(argv + ['--resume']) == 2
    err = capsys.readouterr().err
    assert 'no space left on the device' in err and 'Traceback' not in err and err.count('\n') == 1, err
    monkeypatch.undo()
    assert (folder / 'checkpoint.pt').read_bytes() == before and not list(folder.glob('.*.tmp'))
    assert train_main(argv + ['--resume']) == 0 and len(read_jsonl(folder / 'results.jsonl')) == EPOCHS


@pytest.mark.parametrize('argv, message', [
    (['train', '--seed', str(2 ** 64 + 1)], 'seed must be an integer from 0'),
    (['train', '--seed', '-1'], 'seed must be an integer from 0'),
    (['train', '--epochs', '99999999999999999999'], 'epochs must be'),
    (['train', '--stop-after', '-1'], '--stop-after'),
    (['sweep', '--recipe', 'digits', '--seeds', '-1'], 'seed'),
    (['sweep', '--recipe', 'digits', '--seeds', f'1,{2 ** 64 + 1}'], 'seed'),
    (['sweep', '--recipe', 'digits', '--set', 'policy_kw.budget=-3'], 'budget'),
    (['sweep', '--recipe', 'digits', '--set', 'base_lr=Infinity'], 'base_lr'),
    (['train', '--lr', '1e308'], 'base_lr (--lr) = 1e+308 is above 1e+06, our bound'),
    (['train', '--set', 'weight_decay=' + '9' * 400], 'weight_decay = 999999999999... (400 digits) is beyond 64-bit'),
    (['train', '--set', 'model_kw.width=' + '9' * 400], 'model_kw.width = 999999999999... (400 digits) is beyond 64-bit'),
    (['train', '--set', 'model_kw.width=-1'], "model 'digits_cnn' cannot be built with model_kw {'width': -1}"),
])
def test_bad_numbers_are_refused_before_any_work(argv, message, tmp_path, capsys):
    main = {'train': train_main, 'sweep': sweep_main}[argv[0]]
    rest = argv[1:] + ['--out', str(tmp_path / 'out')]
    if argv[0] == 'train': rest += ['--recipe', 'digits', '--epochs', '1'] * ('--epochs' not in rest)
    try: code = main(rest)
    except SystemExit as e: code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and 'Traceback' not in err, err
    assert not any((tmp_path / 'out').rglob('*.json')), 'a run started'


def test_seeds_alias_nothing_in_a_grid():
    with pytest.raises(ValueError, match='seed'):
        sweep_grid('digits', ['dense'], [1, 2 ** 64 + 1], [1])


def _write_run(root, arm, seed, epochs=2, **config):
    "A minimal complete run folder in the runner's format."
    folder = run_dir(root, 'digits', arm, seed, epochs)
    cfg = {'recipe': 'digits', 'arm': arm, 'seed': seed, 'epochs': epochs, 'base_lr': 0.1, 'policy_kw': {'budget': 0.09}}
    cfg.update(config)
    write_json(folder / 'config.json', cfg)
    rows = [{'epoch': e, 'train_time_s': (2.0 + 0.1 * seed) * e / epochs, 'lr': 0.1, 'loss': 1.0, 'train_acc': 0.5, 'val_acc': 0.5,
             'test_acc': 0.5 + 0.01 * seed, 'rows_forwarded': 100, 'rows_backprop': 50, 'kept_fraction': 0.5,
             'mean_distortion': 0.05, 'rows_pruned': 0} for e in range(1, epochs + 1)]
    runio.write_jsonl(folder / 'results.jsonl', rows)
    write_json(folder / 'final.json', {'recipe': 'digits', 'arm': arm, 'seed': seed, 'epochs': epochs,
                                       'train_time_s': 2.0 + 0.1 * seed, 'val_acc': 0.5, 'test_acc': 0.5 + 0.01 * seed,
                                       'rows_backprop_frac': 0.5, 'kept_fraction': 0.5, 'complete': True,
                                       'config_hash': runio.config_hash(cfg)})
    return folder


def test_the_report_refuses_to_pool_other_configurations_and_names_the_field(tmp_path):
    for s in (1, 2, 3): _write_run(tmp_path, 'dense', s)
    for s in (1, 2, 3): _write_run(tmp_path, 'capskip', s)
    _write_run(tmp_path, 'capskip', 4, base_lr=0.5, policy_kw={'budget': 0.5})
    report = build_report(tmp_path)
    notes = dict(report.notes.items)
    assert 'base_lr (0.5 vs 0.1)' in notes['digits/capskip/seed4/ep2'] and 'policy_kw.budget (0.5 vs 0.09)' in notes['digits/capskip/seed4/ep2']
    assert sorted(report.groups[('', 'digits')].runs('capskip', 2)) == [1, 2, 3]
    _write_run(tmp_path, 'dense', 4, base_lr=0.5)                # 2 against 2 in capskip? no: dense 3 vs 1 again
    runs = {(r.arm, r.seed): r for r in load_runs(tmp_path)}
    assert not runs[('dense', 4)].complete and runs[('dense', 1)].complete


def test_without_a_majority_no_run_of_the_cell_is_pooled(tmp_path):
    _write_run(tmp_path, 'dense', 1)
    _write_run(tmp_path, 'dense', 2, weight_decay=0.0)
    runs = load_runs(tmp_path)
    assert not any(r.complete for r in runs)
    assert all('no configuration has a majority' in r.problem and 'weight_decay' in r.problem for r in runs)


def test_identical_seeds_give_no_interval_and_two_pairs_say_so(tmp_path):
    for s in (1, 2):
        _write_run(tmp_path, 'dense', s)
        f = _write_run(tmp_path, 'capskip', s)
        final, rows = read_json(f / 'final.json'), read_jsonl(f / 'results.jsonl')
        write_json(f / 'final.json', {**final, 'test_acc': final['test_acc'] + 0.0056})   # +0.56 pp for both seeds
        runio.write_jsonl(f / 'results.jsonl', rows[:-1] + [{**rows[-1], 'test_acc': final['test_acc'] + 0.0056}])
    report = build_report(tmp_path)
    eq = next(t for t in report.sections[('', 'digits')] if t.name == 'equal_epochs')
    cell = ' '.join(str(c) for c in eq.rows[0])
    assert '+0.56 [no interval] unresolved (no spread between seeds) (only 2 pairs)' in cell, cell
    assert 'better' not in cell


@pytest.mark.parametrize('damage, reason', [
    (lambda f: write_json(f / 'final.json', {**read_json(f / 'final.json'), 'train_time_s': 1e308}), 'train_time_s = 1e+308'),
    (lambda f: (f / 'final.json').write_text(json.dumps({**read_json(f / 'final.json'), 'epochs': 10 ** 400})), 'epochs = 1000'),
    (lambda f: (f / 'final.json').write_text(json.dumps(read_json(f / 'final.json'))[:-1] + ', "x": 1' + '0' * 5000 + '}'),
     'unreadable final.json'),
    (lambda f: (f / 'final.json').write_text('{"a": ' * 50_000), 'nested too deeply'),
    (lambda f: ((f / 'results.jsonl').unlink(), (f / 'results.jsonl').mkdir()), 'a folder, not a file'),
    (lambda f: write_json(f / 'final.json', {**read_json(f / 'final.json'), 'recipe': 'cifar'}), "recipe='cifar'"),
])
def test_one_bad_file_is_listed_and_the_report_still_runs(damage, reason, tmp_path, capsys):
    for s in (1, 2, 3): _write_run(tmp_path, 'dense', s); _write_run(tmp_path, 'capskip', s)
    damage(run_dir(tmp_path, 'digits', 'capskip', 2, 2))
    assert report_main([str(tmp_path), '--no-figures']) == 0
    missing = (tmp_path / 'report' / 'missing.csv').read_text()
    assert 'digits/capskip/seed2/ep2' in missing and reason in missing, missing
    assert 'Traceback' not in capsys.readouterr().err


def test_report_usage_errors_are_one_line(tmp_path, capsys):
    _write_run(tmp_path, 'dense', 1)
    (tmp_path / 'plain.txt').write_text('x')
    for argv, message in (([str(tmp_path / 'plain.txt')], 'is a file'), ([str(tmp_path), '--target', 'nan'], 'in (0, 100]')):
        assert report_main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count('\n') == 1 and 'Traceback' not in err, err


def test_arms_that_differ_in_more_than_the_arm_are_noted(tmp_path):
    for s in (1, 2): _write_run(tmp_path, 'dense', s); _write_run(tmp_path, 'capskip', s, weight_decay=0.0)
    report = build_report(tmp_path)
    notes = [p for w, p in report.notes.items if w == 'digits']
    assert len(notes) == 1 and 'weight_decay' in notes[0] and 'mix that setting with the arm' in notes[0], report.notes.items
    assert sorted(report.groups[('', 'digits')].runs('capskip', 2)) == [1, 2]    # listed where it is compared, not dropped


# --- records that say something else than what ran (hostile probes on results folders) ---

def _cell(tmp_path, arm='capskip'):
    for s in (1, 2, 3): _write_run(tmp_path, 'dense', s); _write_run(tmp_path, 'capskip', s)
    return {s: run_dir(tmp_path, 'digits', arm, s, 2) for s in (1, 2, 3)}


@pytest.mark.parametrize('edit', ['value', 'duplicate key'])
def test_a_final_json_that_is_not_its_rows_summary_is_listed_not_pooled(edit, tmp_path):
    f = _cell(tmp_path)[2] / 'final.json'
    if edit == 'value': write_json(f, {**read_json(f), 'test_acc': 0.99})
    else: f.write_text(f.read_text().rstrip().rstrip('}') + ', "test_acc": 0.99}')
    report = build_report(tmp_path)
    note = dict(report.notes.items)['digits/capskip/seed2/ep2']
    assert ('final.json says test_acc=0.99 but results.jsonl gives 0.52' in note if edit == 'value'
            else "key(s) ['test_acc'] appear twice" in note), note
    assert sorted(report.groups[('', 'digits')].runs('capskip', 2)) == [1, 3]


def test_a_run_reached_twice_through_symlinks_votes_once(tmp_path):
    for s in (1, 2): _write_run(tmp_path, 'dense', s)
    odd = _write_run(tmp_path, 'dense', 3, weight_decay=0.0)
    for alias in ('seed7', 'seed8'): (odd.parents[1] / alias).symlink_to(odd.parent, target_is_directory=True)
    (tmp_path / 'mirror').symlink_to(tmp_path / 'digits', target_is_directory=True)
    runs = load_runs(tmp_path)
    assert sorted((r.seed, r.complete) for r in runs) == [(1, True), (2, True), (3, False)]
    assert 'weight_decay' in next(r for r in runs if r.seed == 3).problem


def test_a_seed_folder_alias_is_listed_not_shadowing(tmp_path):
    import shutil
    folders = _cell(tmp_path)
    alias = folders[3].parents[1] / 'seed03' / 'ep2'
    shutil.copytree(folders[3], alias)
    write_json(alias / 'final.json', {**read_json(alias / 'final.json'), 'train_time_s': 99.0})
    report = build_report(tmp_path)
    assert 'not the name capskip train writes (seed3)' in dict(report.notes.items)['digits/capskip/seed3/ep2']
    assert report.groups[('', 'digits')].runs('capskip', 2)[3].path == folders[3].resolve()


def test_a_run_without_config_json_but_with_a_hash_is_not_pooled(tmp_path):
    (_cell(tmp_path)[2] / 'config.json').unlink()
    report = build_report(tmp_path)
    assert 'but config.json is missing' in dict(report.notes.items)['digits/capskip/seed2/ep2']
    assert sorted(report.groups[('', 'digits')].runs('capskip', 2)) == [1, 3]


def test_resume_compares_with_the_checkpoint_when_config_json_is_gone(tmp_path, monkeypatch):
    train(small(), tmp_path, progress='none', stop_after=1)
    folder = run_dir(tmp_path, 'digits', 'capskip', 1, EPOCHS)
    (folder / 'config.json').unlink()
    with pytest.raises(ValueError, match=r'its checkpoint.pt: base_lr: saved .* vs now 0.5'):
        train(small(base_lr=0.5), tmp_path, resume=True, progress='none')
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, 'get_num_threads', lambda: threads + 1)     # the checkpoint's count is the check now
    with pytest.raises(ValueError, match='OMP_NUM_THREADS'):
        train(small(), tmp_path, resume=True, progress='none')


@pytest.mark.parametrize('name', ['config.json', 'results.jsonl', 'final.json', 'checkpoint.pt'])
def test_a_folder_in_place_of_a_run_file_is_one_line_before_any_work(name, tmp_path, capsys):
    folder = run_dir(tmp_path, 'digits', 'capskip', 1, EPOCHS)
    (folder / name).mkdir(parents=True)
    argv = ['--recipe', 'digits', '--arm', 'capskip', '--seed', '1', '--epochs', str(EPOCHS), *TINY_FLAGS,
            '--out', str(tmp_path), '--quiet']
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert f'{name} is a folder where the run keeps a file' in err and err.count('\n') == 1, err
    assert sorted(p.name for p in folder.iterdir()) == [name]


def test_invalid_json_and_refused_pickles_name_the_file_in_one_line(tmp_path):
    (tmp_path / 'config.json').write_text('{"a": 1,')
    with pytest.raises(ValueError, match='config.json is not valid JSON'): read_json(tmp_path / 'config.json')
    torch.save({'w': torch.zeros(1), 'obj': Path('x')}, tmp_path / 'checkpoint.pt')      # a global the safe loader refuses
    with pytest.raises(ValueError) as e: load_checkpoint(tmp_path / 'checkpoint.pt')
    assert 'checkpoint.pt cannot be read safely' in str(e.value) and '\n' not in str(e.value)
    assert 'weights_only' not in str(e.value).replace('weights_only=True', '')


def test_report_pairs_bar_full_disk_and_interrupts(tmp_path, capsys, monkeypatch):
    _cell(tmp_path)
    out = str(tmp_path / 'rep')
    code = report_main([str(tmp_path), '--out', out, '--no-figures', '--pair', 'digits/capskip@0:digits/dense@2'])
    err = capsys.readouterr().err
    assert code == 2 and '@EPOCHS is an epoch budget from 1' in err and err.count('\n') == 1, err
    for bar in (['--bar', '-0.4,1.0'], ['--bar=-0.4,1.0']):
        assert report_main([str(tmp_path), '--out', out, '--no-figures', *bar, '--pair', 'digits/capskip:digits/dense']) == 0
        assert 'bar passed' in (tmp_path / 'rep' / 'report.md').read_text()
    capsys.readouterr()
    monkeypatch.setattr(runio.os, 'fsync', lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, 'No space left on device')))
    assert report_main([str(tmp_path), '--out', out, '--no-figures']) == 1
    err = capsys.readouterr().err
    assert 'no space left on the device' in err and 'run the report again' in err and '--resume' not in err, err
    assert err.count('\n') == 1
    monkeypatch.undo()
    import capskip.analysis.report as rep
    from capskip.cli import main
    def interrupted(*a, **k): raise KeyboardInterrupt
    monkeypatch.setattr(rep, 'build_report', interrupted)
    assert main(['report', str(tmp_path), '--no-figures']) == 130
    err = capsys.readouterr().err
    assert err.startswith('capskip report: interrupted (SIGINT)') and err.count('\n') == 1, err


def test_an_ascii_stdout_prints_every_command_without_unicode_errors():
    env = dict(os.environ, PYTHONIOENCODING='ascii', LANG='C', LC_ALL='C', CAPSKIP_NO_ALLOCATOR_ENV='1')
    out = subprocess.run([sys.executable, '-m', 'capskip', 'recipes', '--show', 'digits'], cwd=ROOT, env=env,
                         capture_output=True, timeout=120)
    assert out.returncode == 0 and b'UnicodeEncodeError' not in out.stderr, out.stderr[-600:]
    assert b'paper: ?' in out.stdout                      # the section sign, replaced
