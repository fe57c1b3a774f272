"""`capskip demo`: trains dense and CAPSkip on the embedded digits data, prints the table, writes the plot, reuses runs."""
import math

import numpy as np
import pytest
from scipy import stats as sps

from capskip.analysis.demo import demo, summarize
from capskip.cli.runs import demo_main
from capskip.runs.runio import read_json, run_dir


def test_demo_cli_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    record = tmp_path / 'demo_record.json'
    argv = ['--seeds', '2', '--epochs', '1', '--recipe', 'digits', '--out', str(tmp_path), '--set', 'batch_size=256',
            '--record', str(record)]
    assert demo_main(argv) == 0
    out = capsys.readouterr().out
    lines = {l.split()[0]: l for l in out.splitlines() if l.split() and l.split()[0] in ('dense', 'capskip')}
    assert set(lines) == {'dense', 'capskip'}
    # the accuracy column: mean paired difference (pp) with its 95% t-interval, recomputed here with SciPy from the
    # run folders, and the one label that interval implies (better above 0, worse below 0, otherwise unresolved)
    acc = lambda arm, s: 100 * read_json(run_dir(tmp_path, 'digits', arm, s, 1) / 'final.json')['test_acc']
    diffs = np.array([acc('capskip', s) - acc('dense', s) for s in (1, 2)])
    if diffs.std() == 0:
        lo = hi = diffs.mean()
    else:
        lo, hi = sps.t.interval(0.95, len(diffs) - 1, loc=diffs.mean(), scale=sps.sem(diffs))
    label = 'better' if lo > 0 else 'worse' if hi < 0 else 'unresolved'
    assert f'{diffs.mean():+.2f} [{lo:+.2f}, {hi:+.2f}] {label}' in lines['capskip']
    # each seed's two runs back to back, in alternating order: dense, capskip for seed 1; capskip, dense for seed 2
    start = lambda arm, s: read_json(run_dir(tmp_path, 'digits', arm, s, 1) / 'config.json')['meta']['start_time']
    assert start('dense', 1) <= start('capskip', 1) <= start('capskip', 2) <= start('dense', 2)
    assert 'alternating order' in out and 'machine:' in out and 'load average' in out
    rec = read_json(record)                    # the recorded run: command, machine, conditions, the table as printed
    assert rec['command'].startswith('capskip demo --seeds 2') and '--record' not in rec['command']
    assert rec['machine'] and rec['table'] in out and rec['load_average']['cores'] >= 1
    assert '| capskip |' in rec['markdown'] and rec['machine'] in rec['markdown']
    assert [s['arm'] for s in rec['summaries']] == ['dense', 'capskip'] and rec['order'] == {'1': ['dense', 'capskip'], '2': ['capskip', 'dense']}
    pngs = list(tmp_path.glob('*.png'))
    assert len(pngs) == 1 and pngs[0].read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    # the table's ratio is the geometric mean of the per-seed ratios in the run folders
    t = lambda arm, s: read_json(run_dir(tmp_path, 'digits', arm, s, 1) / 'final.json')['train_time_s']
    ratio = math.sqrt(t('capskip', 1) / t('dense', 1) * t('capskip', 2) / t('dense', 2))
    assert f'{ratio:.3f}' in lines['capskip']
    # a second call reuses every finished run (the folders' results are unchanged)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.glob('digits/*/*/*/final.json')}
    res = demo(seeds=2, epochs=1, out=tmp_path, recipe='digits', overrides={'batch_size': 256})
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob('digits/*/*/*/final.json')} == before
    assert res.summaries[1].acc_diff.n == 2


def test_summarize_pairs_by_seed():
    f = lambda t, acc, bwd: {'train_time_s': t, 'test_acc': acc, 'rows_backprop_frac': bwd, 'kept_fraction': bwd}
    finals = {'dense': {1: f(10, 0.9, 1.0), 2: f(20, 0.8, 1.0)}, 'capskip': {1: f(5, 0.91, 0.5), 2: f(20, 0.78, 0.7)}}
    dense, cap = summarize(finals)
    assert dense.time_ratio == 1.0 and cap.time_ratio == pytest.approx(math.sqrt(0.5 * 1.0))
    assert cap.test_acc == pytest.approx(0.845) and cap.kept_fraction == pytest.approx(0.6)
    assert cap.acc_diff.estimate == pytest.approx(100 * ((0.91 - 0.9) + (0.78 - 0.8)) / 2)


def test_demo_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        demo_main(['--seeds', '0', '--out', str(tmp_path)])
    with pytest.raises(ValueError, match='seeds'):
        demo(seeds=0, out=tmp_path)
