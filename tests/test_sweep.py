"""`capskip sweep`: the grid, finished runs skipped, partial runs resumed, the time-matched dense arm derived from
the first seed's measured ratio and recorded, failures reported."""
import pytest

from capskip.cli.runs import sweep_main
from capskip.runs.recipes import resolve_config
from capskip.runs.runio import read_json, run_dir, write_json
from capskip.runs.sweep import measured_ratio, sweep, sweep_grid, time_matched_epochs
from capskip.runs.train import train

FAST = {'batch_size': 256, 'warmup': False}


def test_grid_is_seed_major_and_complete():
    grid = sweep_grid('digits', ['dense', 'capskip', 'infobatch'], [3, 1], [2, 5])
    assert len(grid) == 12 and len(set(grid)) == 12
    assert [g.seed for g in grid[:6]] == [3] * 6
    with pytest.raises(ValueError, match='at least one'):
        sweep_grid('digits', [], [1], [2])


@pytest.mark.parametrize('epochs, ratio, want', [(103, 0.5735, 59), (200, 0.9, 180), (10, 0.01, 1), (4, 1.2, 5)])
def test_time_matched_epochs(epochs, ratio, want):
    assert time_matched_epochs(epochs, ratio) == want


def test_sweep_skips_finished_resumes_partial_and_time_matches(tmp_path, capsys):
    # a partial run (killed after 1 of 2 epochs) must be resumed, not restarted or refused
    partial_cfg = resolve_config('digits', FAST, arm='capskip', seed=2, epochs=2)
    train(partial_cfg, tmp_path, progress='none', stop_after=1)
    first = sweep('digits', ['dense', 'capskip'], [1, 2], [2], tmp_path, overrides=FAST, progress='none')
    assert [r['status'] for r in first.records] == ['done'] * 4
    assert len(read_json(run_dir(tmp_path, 'digits', 'capskip', 2, 2) / 'config.json')['meta']['resumed']) == 1
    # seed 1's measured CAPSkip time set to 40% of dense's: dense must then run at round(2 x 0.4) = 1 epoch
    path = run_dir(tmp_path, 'digits', 'capskip', 1, 2) / 'final.json'
    dense_t = read_json(run_dir(tmp_path, 'digits', 'dense', 1, 2) / 'final.json')['train_time_s']
    write_json(path, dict(read_json(path), train_time_s=0.4 * dense_t))
    assert measured_ratio(tmp_path, 'digits', 'capskip', 1, 2) == pytest.approx(0.4)
    assert sweep_main(['--recipe', 'digits', '--arms', 'dense,capskip', '--seeds', '1,2', '--epochs', '2', '--out', str(tmp_path),
                 '--time-matched-dense', '--quiet', '--set', 'batch_size=256', '--set', 'warmup=false']) == 0
    out = capsys.readouterr().out
    assert 'dense at 1 epochs' in out and 'reused' in out
    for seed in (1, 2):
        folder = run_dir(tmp_path, 'digits', 'dense', seed, 1)
        tm = read_json(folder / 'config.json')['time_matched']
        assert (tm['arm'], tm['epochs'], tm['dense_epochs'], tm['seed']) == ('capskip', 2, 1, 1)
        assert tm['ratio'] == pytest.approx(0.4)
        assert read_json(folder / 'final.json')['time_matched'] == tm
    again = sweep('digits', ['dense', 'capskip'], [1, 2], [2], tmp_path, time_matched_dense=True, overrides=FAST,
                  progress='none')
    assert {r['status'] for r in again.records} == {'reused'} and len(again.records) == 6


def test_time_matched_needs_dense_and_a_reference_arm(tmp_path):
    with pytest.raises(ValueError, match="needs 'dense'"):
        sweep('digits', ['capskip'], [1], [1], tmp_path, time_matched_dense=True)
    with pytest.raises(ValueError, match='arm to match'):
        sweep('digits', ['dense', 'capskip'], [1], [1], tmp_path, time_matched_dense=True, matched_arm='infobatch')


def test_failures_are_reported_and_the_rest_still_runs(tmp_path, capsys):
    result = sweep('digits', ['dense', 'capskip'], [1], [1], tmp_path, overrides=dict(FAST, **{'policy_kw.p': 2.0}),
                   progress='none')
    statuses = {r['arm']: r['status'] for r in result.records}
    assert statuses == {'dense': 'done', 'capskip': 'failed'} and result.failed[0]['error']
    with pytest.raises(SystemExit) as exc:
        sweep_main(['--recipe', 'digits', '--arms', 'dense,nope', '--seeds', '1', '--epochs', '1', '--out', str(tmp_path)])
    assert exc.value.code == 2 and 'unknown arm' in capsys.readouterr().err


def test_dry_run_runs_nothing(tmp_path, capsys):
    assert sweep_main(['--recipe', 'digits', '--arms', 'dense,capskip', '--seeds', '1,2', '--epochs', '3',
                 '--out', str(tmp_path), '--dry-run']) == 0
    assert capsys.readouterr().out.count('would run') == 4 and not (tmp_path / 'digits').exists()


def test_locked_runs_are_skipped_and_diverged_runs_are_results(tmp_path, capsys):
    "A run another process holds is skipped and listed; a diverged run is a result (not a failure, not rerun)."
    from capskip.runs.runio import RunLock
    with RunLock(run_dir(tmp_path, 'digits', 'dense', 1, 1)):
        code = sweep_main(['--recipe', 'digits', '--arms', 'dense,capskip', '--seeds', '1', '--epochs', '1',
                           '--set', 'batch_size=256', '--set', 'warmup=false', '--set', 'base_lr=1e6',
                           '--out', str(tmp_path), '--quiet'])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = {line.split()[0]: line.split()[3] for line in out.splitlines() if line.split()[:1] in (['dense'], ['capskip'])}
    assert rows == {'dense': 'locked', 'capskip': 'diverged'}, out
    assert '1 run(s) skipped: another process is writing them' in out and '1 run(s) diverged' in out
    assert read_json(run_dir(tmp_path, 'digits', 'capskip', 1, 1) / 'final.json')['status'] == 'diverged'
    assert not (run_dir(tmp_path, 'digits', 'dense', 1, 1) / 'config.json').exists()


def test_demo_says_which_runs_diverged(tmp_path, capsys):
    from capskip.cli.runs import demo_main
    assert demo_main(['--recipe', 'digits', '--seeds', '1', '--epochs', '1', '--set', 'base_lr=1e6', '--set', 'warmup=false',
                      '--set', 'batch_size=256', '--out', str(tmp_path)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('capskip demo: demo runs did not finish') and err[0].count('diverged') == 2


def test_time_matched_dense_onto_a_budget_of_the_grid_is_one_line(tmp_path, capsys, monkeypatch):
    import capskip.runs.sweep as sw
    monkeypatch.setattr(sw, 'measured_ratio', lambda *a, **k: 0.5)   # dense at round(2 x 0.5) = 1: the grid's own dense@1
    tiny = {'data_kw.img_size': 8, 'data_kw.n_train': 128, 'batch_size': 128, 'warmup': False, 'mode': 'reforward'}
    result = sweep('digits', ['dense', 'capskip'], [1], [1, 2], tmp_path, time_matched_dense=True, overrides=tiny,
                   progress='lines')
    out, err = capsys.readouterr()
    assert not result.failed and len(result.records) == 4, result.records
    assert 'is dense at 1 epochs (ratio 0.500), a budget of the grid itself' in out and 'Traceback' not in err


def test_the_table_says_which_runs_saved_nothing_on_some_steps():
    "A run whose final.json holds all_rows_steps gets a line under the table: its bwd rows are the rule's, not the work done."
    from capskip.runs.sweep import SweepResult
    final = {'train_time_s': 3.0, 'test_acc': 0.9, 'rows_backprop_frac': 0.6}
    res = SweepResult([{'arm': 'capskip', 'seed': 1, 'epochs': 2, 'status': 'done', 'final': dict(final, all_rows_steps=7)},
                       {'arm': 'capskip', 'seed': 2, 'epochs': 2, 'status': 'done', 'final': final}])
    lines = res.table().splitlines()
    assert len(lines) == 4 and lines[-1].startswith('capskip seed 1: 7 step(s) back-propagated every row'), lines
