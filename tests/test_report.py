"""`capskip report` on results folders written here in the runner's format (independently of capskip's own
synthetic writer), checked against SciPy; and once on a real tiny folder from `capskip train`."""
import csv
import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from capskip.analysis.report import build_report, report_markdown
from capskip.analysis.results import load_runs, read_run
from capskip.analysis.tables import check_bench_rows
from capskip.cli.runs import report_main, train_main


def write_run(root, recipe, arm, seed, epochs, time_s, acc, *, finish=True, kept=1.0, budget=0.09, final_extra=None,
              config_extra=None, n_rows=100):
    "One run folder exactly as DEVELOPING.md's 'Results folder' describes it (accuracies as fractions)."
    folder = root / recipe / arm / f'seed{seed}' / f'ep{epochs}'
    folder.mkdir(parents=True)
    config = {'recipe': recipe, 'arm': arm, 'seed': seed, 'epochs': epochs, 'policy_kw': {'budget': budget},
              'time_matched': None, 'meta': {'git_commit': 'abc', 'device': 'cpu'}, **(config_extra or {})}
    (folder / 'config.json').write_text(json.dumps(config))
    rows = [{'epoch': e, 'train_time_s': time_s * e / epochs, 'lr': 0.1, 'loss': 1.0, 'train_acc': acc, 'val_acc': acc,
             'test_acc': acc if e == epochs else None, 'rows_forwarded': n_rows, 'rows_backprop': round(kept * n_rows),
             'kept_fraction': kept, 'mean_distortion': 0.05 if kept < 1 else 0.0, 'rows_pruned': 0}
            for e in range(1, epochs + 1)]
    rows[-1].update({k: v for k, v in (final_extra or {}).items() if k in ('val_acc', 'test_acc')})  # final.json summarises the rows
    (folder / 'results.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    if finish:
        final = {'recipe': recipe, 'arm': arm, 'seed': seed, 'epochs': epochs, 'train_time_s': time_s, 'val_acc': acc,
                 'test_acc': acc, 'rows_backprop_frac': kept, 'kept_fraction': kept, 'complete': True, **(final_extra or {})}
        (folder / 'final.json').write_text(json.dumps(final))
    return folder


def read_csv(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def scipy_interval(values):
    values = np.asarray(values, dtype=np.float64)
    return sps.t.interval(0.95, len(values) - 1, loc=values.mean(), scale=sps.sem(values))


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / 'runs'
    times = {'dense': {4: [40.0, 42.0, 41.0], 8: [80.0, 83.0, 81.0]}, 'capskip': {4: [31.0, 33.5, 32.0], 8: [62.0, 66.0, 64.0]}}
    accs = {'dense': {4: [0.700, 0.712, 0.705], 8: [0.760, 0.771, 0.758]}, 'capskip': {4: [0.704, 0.709, 0.711], 8: [0.762, 0.768, 0.765]}}
    for arm in times:
        for e in times[arm]:
            for i, s in enumerate((1, 2, 3)):
                write_run(root, 'r', arm, s, e, times[arm][e][i], accs[arm][e][i], kept=1.0 if arm == 'dense' else 0.6)
    return root, times, accs


def test_equal_epoch_numbers_match_scipy(folder, tmp_path):
    root, times, accs = folder
    assert report_main([str(root), '--out', str(tmp_path / 'rep'), '--no-figures']) == 0
    rows = {int(r['epochs']): r for r in read_csv(tmp_path / 'rep' / 'r__equal_epochs.csv') if r['arm'] == 'capskip'}
    for e in (4, 8):
        diffs = 100 * (np.array(accs['capskip'][e]) - np.array(accs['dense'][e]))
        lo, hi = scipy_interval(diffs)
        assert float(rows[e]['acc_diff_pp']) == pytest.approx(diffs.mean(), rel=1e-9)
        assert (float(rows[e]['acc_diff_pp_lo']), float(rows[e]['acc_diff_pp_hi'])) == pytest.approx((lo, hi), rel=1e-9)
        assert rows[e]['acc_diff_pp_label'] == ('better' if lo > 0 else 'worse' if hi < 0 else 'unresolved')
        logs = np.log(np.array(times['capskip'][e]) / np.array(times['dense'][e]))
        lo, hi = scipy_interval(logs)
        assert float(rows[e]['time_ratio']) == pytest.approx(math.exp(logs.mean()), rel=1e-9)
        assert (float(rows[e]['time_ratio_lo']), float(rows[e]['time_ratio_hi'])) == pytest.approx((math.exp(lo), math.exp(hi)), rel=1e-9)
        assert rows[e]['time_ratio_label'] == 'faster'
        assert float(rows[e]['rows_bwd_pct']) == pytest.approx(60.0)
    text = (tmp_path / 'rep' / 'report.md').read_text()
    assert 'equivalent' not in text
    # every seed is paired; the only notes are capskip's 4-epoch runs, faster than any dense run (no dense margin there)
    missing = read_csv(tmp_path / 'rep' / 'missing.csv')
    assert {m['where'] for m in missing} == {'r/capskip/ep4 seed1', 'r/capskip/ep4 seed2', 'r/capskip/ep4 seed3', 'r/capskip/ep4 (dense margin)'}


def test_tta_and_dense_margin_match_hand_computation(folder):
    root, times, accs = folder
    report = build_report(root, targets=[74.0, 80.0])
    tables = {t.name: t for t in report.sections[('', 'r')]}
    tta = {r['target_pct']: r for r in tables['time_to_accuracy'].records}
    def tta_by_hand(arm, s):   # the target 74% lies between the 4- and 8-epoch accuracies of every seed
        a4, a8, t4, t8 = 100 * accs[arm][4][s], 100 * accs[arm][8][s], times[arm][4][s], times[arm][8][s]
        return t4 + (74.0 - a4) / (a8 - a4) * (t8 - t4)
    ratios = [tta_by_hand('capskip', i) / tta_by_hand('dense', i) for i in range(3)]
    assert tta[74.0]['tta_ratio'] == pytest.approx(sps.gmean(ratios), rel=1e-9)
    assert tta[74.0]['arm_tta_s_seed2'] == pytest.approx(tta_by_hand('capskip', 1), rel=1e-12)
    assert tta[80.0]['tta_ratio'] is None and tta[80.0]['not_reached']        # never reached: reported, not dropped
    assert any('target 80.00% never reached' in p for _, p in report.notes.items)
    # dense margin of capskip at 8 epochs: its time lies between dense's 4- and 8-epoch times on every seed
    margins = []
    for i in range(3):
        t, (t4, t8), (a4, a8) = times['capskip'][8][i], (times['dense'][4][i], times['dense'][8][i]), (accs['dense'][4][i], accs['dense'][8][i])
        margins.append(100 * (accs['capskip'][8][i] - (a4 + (t - t4) / (t8 - t4) * (a8 - a4))))
    ctrl = next(r for r in tables['controls'].records if (r['arm'], r['epochs']) == ('capskip', 8))
    assert ctrl['dense_margin_pp'] == pytest.approx(np.mean(margins), rel=1e-9)
    assert (ctrl['dense_margin_pp_lo'], ctrl['dense_margin_pp_hi']) == pytest.approx(scipy_interval(margins), rel=1e-9)
    # capskip at 4 epochs runs faster than any dense run: outside the envelope, listed per seed
    assert sum('outside the dense envelope' in p for _, p in report.notes.items) == 3


def test_partial_unpaired_and_inconsistent_runs_are_listed(folder, tmp_path):
    root, _, _ = folder
    write_run(root, 'r', 'capskip', 4, 8, 60.0, 0.77)                                  # no dense partner
    write_run(root, 'r', 'dense', 5, 8, 80.0, 0.77, finish=False)                       # killed run
    write_run(root, 'r', 'selective_backprop', 1, 8, 60.0, 0.75, kept=0.4)               # a single seed
    write_run(root, 'r', 'random_rescale', 1, 8, 60.0, 0.75, final_extra={'complete': False})
    write_run(root, 'r', 'random_rescale', 2, 8, 60.0, 0.75, final_extra={'seed': 7})
    bad = write_run(root, 'r', 'random_rescale', 3, 8, 60.0, 0.75)
    (bad / 'final.json').write_text('{"recipe": "r", ')                                  # truncated JSON
    assert report_main([str(root), '--out', str(tmp_path / 'rep'), '--no-figures']) == 0
    missing = read_csv(tmp_path / 'rep' / 'missing.csv')
    problems = {(m['where'], m['problem']) for m in missing}
    assert ('r/dense/seed5/ep8', 'partial: no final.json (8 of 8 epochs logged)') in problems
    assert ('r/random_rescale/seed1/ep8', 'final.json is not marked complete') in problems
    assert ('r/random_rescale/seed2/ep8', 'final.json says seed=7 but the folder says 2') in problems
    assert any(w == 'r/random_rescale/seed3/ep8' and p.startswith('unreadable final.json') for w, p in problems)
    assert any(w == 'r/capskip/ep8 seed4' and 'left out of the pairing' in p for w, p in problems)
    assert any(w.startswith('r/selective_backprop/ep8') and 'only 1 seed pair(s)' in p for w, p in problems)
    eq = {(r['arm'], r['epochs']): r for r in read_csv(tmp_path / 'rep' / 'r__equal_epochs.csv')}
    assert eq[('capskip', '8')]['n'] == '3'                    # seed 4 is unpaired, seeds 1-3 stay paired
    assert eq[('selective_backprop', '8')]['time_ratio'] == ''  # no interval from one pair, and no number pretending
    text = (tmp_path / 'rep' / 'report.md').read_text()
    assert '**' in text and 'entries under "Missing / partial runs"' in text


def test_time_matched_prefers_the_sweep_marker(tmp_path):
    root = tmp_path / 'runs'
    for s, (tc, t5, t6) in enumerate([(50.0, 52.0, 60.0), (51.0, 51.0, 62.0)], start=1):
        write_run(root, 'r', 'capskip', s, 8, tc, 0.75, kept=0.5)
        write_run(root, 'r', 'dense', s, 8, 80.0, 0.76)
        write_run(root, 'r', 'dense', s, 5, t5, 0.72)
        write_run(root, 'r', 'dense', s, 6, t6, 0.74, config_extra={'time_matched': {'arm': 'capskip', 'epochs': 8}})
    report = build_report(root)
    rec = next(t for t in report.sections[('', 'r')] if t.name == 'time_matched').records
    assert [(r['epochs'], r['reference_epochs'], r['matched_by']) for r in rec] == [(8, 6, 'sweep marker')]
    assert rec[0]['time_ratio'] == pytest.approx(math.sqrt(50 / 60 * 51 / 62), rel=1e-12)


def test_budget_sweep_and_bench_figures(tmp_path):
    root = tmp_path / 'runs'
    for b, k in ((0.05, 0.8), (0.09, 0.7), (0.4, 0.5), (1.0, 0.48)):
        write_run(root / f'b{b}', 'r', 'capskip', 1, 3, 10.0, 0.7, kept=k, budget=b)
    bench = [{'model': 'm', 'mode': 'dense', 'keep': 1.0, 'forward_ms': 2.0, 'selector_ms': None, 'gather_ms': None,
              'backward_ms': 4.0, 'optimizer_ms': 0.5, 'ratio': 1.0, 'ideal': 1.0, 'overhead': 0.0, 'peak_mem_ratio': 1.0},
             {'model': 'm', 'mode': 'reuse', 'keep': 0.5, 'forward_ms': 2.0, 'selector_ms': 0.1, 'gather_ms': 0.2,
              'backward_ms': 2.0, 'optimizer_ms': 0.5, 'ratio': 0.74, 'ideal': 2 / 3, 'overhead': 0.073, 'peak_mem_ratio': 1.1}]
    (tmp_path / 'bench.json').write_text(json.dumps(bench))
    out = tmp_path / 'rep'
    assert report_main([str(root), '--out', str(out), '--bench-json', str(tmp_path / 'bench.json')]) == 0
    kept = read_csv(out / 'kept_vs_budget.csv')
    assert [(float(r['budget']), float(r['kept_fraction'])) for r in kept] == [(0.05, 0.8), (0.09, 0.7), (0.4, 0.5), (1.0, 0.48)]
    assert [r['mode'] for r in read_csv(out / 'step_phases.csv')] == ['dense', 'reuse']
    for png in ('kept_vs_budget.png', 'step_phases.png'):
        assert (out / png).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
        assert f']({png})' in (out / 'report.md').read_text()


def test_bad_inputs_give_clear_errors(tmp_path, capsys):
    assert report_main([str(tmp_path / 'missing')]) == 2
    assert 'does not exist' in capsys.readouterr().err
    (tmp_path / 'empty').mkdir()
    assert report_main([str(tmp_path / 'empty')]) == 2
    assert 'no run folders' in capsys.readouterr().err
    write_run(tmp_path / 'runs', 'r', 'dense', 1, 2, 10.0, 0.5)
    (tmp_path / 'bench.json').write_text(json.dumps([{'model': 'm', 'mode': 'dense'}]))
    assert report_main([str(tmp_path / 'runs'), '--bench-json', str(tmp_path / 'bench.json')]) == 2
    assert "lacks ['forward_ms', 'backward_ms']" in capsys.readouterr().err
    with pytest.raises(ValueError, match='must be a number or null'):
        check_bench_rows([{'model': 'm', 'mode': 'x', 'forward_ms': '2', 'backward_ms': 1}])
    with pytest.raises(ValueError, match='not a run folder'):
        read_run(tmp_path / 'runs' / 'r', tmp_path)


def test_val_metric_and_percent_values_are_refused(tmp_path):
    "Accuracies are fractions: a folder written in percent is listed file by file, never rescaled."
    root = tmp_path / 'runs'
    for s in (1, 2):
        write_run(root, 'r', 'dense', s, 2, 10.0, 0.70 + s / 100)
        write_run(root, 'r', 'capskip', s, 2, 8.0, 0.705 + s / 100, kept=0.5)
    report = build_report(root, metric='val_acc')
    eq = next(t for t in report.sections[('', 'r')] if t.name == 'equal_epochs').records[0]
    assert eq['acc_diff_pp'] == pytest.approx(0.5)
    assert 'Metric: final `val_acc`' in report_markdown(report)
    write_run(root, 'r', 'dense', 3, 2, 10.0, 72.0)
    report = build_report(root, metric='val_acc')
    assert ('r/dense/seed3/ep2', 'final.json: val_acc = 72.0 is outside [0, 1] (accuracies and fractions are stored as '
            'fractions, not percent)') in report.notes.items


def _equal_epochs(out):
    return read_csv(out / 'r__equal_epochs.csv')


@pytest.mark.parametrize('damage, reason', [
    (lambda f: f.update(test_acc=40.56), 'final.json: test_acc = 40.56 is outside [0, 1]'),
    (lambda f: f.update(test_acc=float('nan')), 'final.json: test_acc = nan is not finite'),
    (lambda f: f.update(test_acc='0.71'), "final.json: test_acc = '0.71' is not a number"),
    (lambda f: f.update(train_time_s=float('inf')), 'final.json: train_time_s = inf is not finite'),
    (lambda f: f.update(seed='1'), "final.json: seed = '1' is not an int"),
    (lambda f: f.update(test_accuracy=0.7), "final.json has unknown key(s) ['test_accuracy']"),
    (lambda f: f.pop('train_time_s'), "final.json lacks ['train_time_s']"),
], ids=['percent', 'nan', 'string', 'inf-time', 'string-seed', 'unknown-key', 'missing-key'])
def test_one_bad_final_json_is_listed_and_changes_nothing_else(folder, tmp_path, damage, reason):
    root, _, _ = folder
    assert report_main([str(root), '--out', str(tmp_path / 'good'), '--no-figures']) == 0
    path = root / 'r' / 'capskip' / 'seed2' / 'ep8' / 'final.json'
    final = json.loads(path.read_text())
    damage(final)
    path.write_text(json.dumps(final))                    # Python's json writes NaN/Infinity, as a careless writer would
    assert report_main([str(root), '--out', str(tmp_path / 'bad'), '--no-figures']) == 0
    missing = read_csv(tmp_path / 'bad' / 'missing.csv')
    assert any(m['where'] == 'r/capskip/seed2/ep8' and m['problem'].startswith(reason) for m in missing), missing
    good = {(r['arm'], r['epochs']): r for r in _equal_epochs(tmp_path / 'good')}
    bad = {(r['arm'], r['epochs']): r for r in _equal_epochs(tmp_path / 'bad')}
    assert bad[('capskip', '4')] == good[('capskip', '4')]                   # the other budget: untouched
    assert bad[('capskip', '8')]['n'] == '2'                                 # seeds 1 and 3 still paired
    good_runs = [r for r in read_csv(tmp_path / 'good' / 'r__runs.csv') if (r['arm'], r['seed'], r['epochs']) != ('capskip', '2', '8')]
    assert read_csv(tmp_path / 'bad' / 'r__runs.csv') == good_runs           # every other run's numbers, unchanged


def test_a_bad_results_line_is_listed(folder, tmp_path):
    root, _, _ = folder
    path = root / 'r' / 'dense' / 'seed1' / 'ep4' / 'results.jsonl'
    rows = [json.loads(l) for l in path.read_text().splitlines()]
    rows[1]['rows_backprop'] = -5
    path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    report = build_report(root)
    assert ('r/dense/seed1/ep4', 'results.jsonl line 2: rows_backprop = -5 is negative') in report.notes.items


def test_diverged_runs_are_listed_as_such_and_counted_per_arm(folder, tmp_path):
    root, _, _ = folder
    for arm, seed, epochs, at in (('capskip', 2, 8, (3, 5)), ('capskip', 3, 8, (1, 2))):
        path = root / 'r' / arm / f'seed{seed}' / f'ep{epochs}' / 'final.json'
        final = json.loads(path.read_text())
        path.write_text(json.dumps({k: final[k] for k in ('recipe', 'arm', 'seed', 'epochs', 'train_time_s')} | {
            'status': 'diverged', 'complete': False, 'val_acc': None, 'test_acc': None, 'last_finite_epoch': at[0] - 1,
            'diverged': {'epoch': at[0], 'step': at[1], 'steps': 40, 'what': 'loss', 'peak_lr': 1e6}}))
    out = tmp_path / 'rep'
    assert report_main([str(root), '--out', str(out), '--no-figures']) == 0
    counts = {(r['arm'], r['seed']): r for r in read_csv(out / 'diverged.csv')}
    assert counts[('capskip', '2')]['diverged_in_arm'] == '2' and counts[('capskip', '2')]['runs_in_arm'] == '6'
    assert (counts[('capskip', '2')]['epoch'], counts[('capskip', '2')]['step']) == ('3', '5')
    assert counts[('dense', '')]['diverged_in_arm'] == '0' and counts[('dense', '')]['runs_in_arm'] == '6'
    text = (out / 'report.md').read_text()
    assert '## Diverged runs' in text and 'seed2/ep8: epoch 3, step 5 of 40, loss' in text
    assert '12 run folders: 10 complete, 2 diverged' in text
    assert not any('diverged' in m['problem'] for m in read_csv(out / 'missing.csv'))   # a result, not a missing run
    eq = {(r['arm'], r['epochs']): r for r in _equal_epochs(out)}
    assert eq[('capskip', '8')]['n'] == '1' and eq[('capskip', '4')]['n'] == '3'


def test_report_on_a_real_capskip_train_folder(tmp_path):
    out = tmp_path / 'runs'
    for arm in ('dense', 'capskip'):
        for seed in (1, 2):
            train_main(['--recipe', 'digits', '--arm', arm, '--seed', str(seed), '--epochs', '1', '--out', str(out), '--quiet'])
    train_main(['--recipe', 'digits', '--arm', 'capskip', '--seed', '3', '--epochs', '2', '--out', str(out), '--quiet',
                '--stop-after', '1'])
    runs = load_runs(out)
    assert sorted((r.arm, r.seed, r.epochs, r.complete) for r in runs) == [
        ('capskip', 1, 1, True), ('capskip', 2, 1, True), ('capskip', 3, 2, False), ('dense', 1, 1, True), ('dense', 2, 1, True)]
    assert report_main([str(out), '--out', str(tmp_path / 'rep')]) == 0
    eq = read_csv(tmp_path / 'rep' / 'digits__equal_epochs.csv')
    assert [(r['arm'], r['epochs'], r['n']) for r in eq] == [('capskip', '1', '2')]
    finals = {(r.arm, r.seed): r.final for r in runs if r.complete}
    ratios = [finals[('capskip', s)]['train_time_s'] / finals[('dense', s)]['train_time_s'] for s in (1, 2)]
    assert float(eq[0]['time_ratio']) == pytest.approx(sps.gmean(ratios), rel=1e-9)
    missing = read_csv(tmp_path / 'rep' / 'missing.csv')
    assert any(m['where'] == 'digits/capskip/seed3/ep2' and m['problem'].startswith('partial: no final.json') for m in missing)
    assert (tmp_path / 'rep' / 'digits__accuracy_time.png').exists()


def test_time_matched_marker_for_another_arm_is_not_used(tmp_path):
    root = tmp_path / 'runs'
    for s in (1, 2):
        write_run(root, 'r', 'selective_backprop', s, 8, 50.0 + s, 0.75, kept=0.4)
        write_run(root, 'r', 'dense', s, 5, 51.0, 0.72)       # closest in time, unmarked
        write_run(root, 'r', 'dense', s, 6, 65.0, 0.74, config_extra={'time_matched': {'arm': 'capskip', 'epochs': 8}})
        write_run(root, 'r', 'dense', s, 3, 30.0, 0.60)       # further than the 10% tolerance
    rec = next(t for t in build_report(root).sections[('', 'r')] if t.name == 'time_matched').records
    assert [(r['arm'], r['reference_epochs'], r['matched_by']) for r in rec] == [('selective_backprop', 5, 'closest time')]
    tables = {t.name for t in build_report(root, tolerance=0.001).sections[('', 'r')]}
    assert 'time_matched' not in tables                       # 1.01 and 1.03 mismatches exceed a 0.1% tolerance


def test_group_without_reference_says_so(tmp_path):
    root = tmp_path / 'runs'
    for s in (1, 2):
        write_run(root, 'r', 'infobatch', s, 4, 10.0, 0.7)
        write_run(root, 'r', 'infobatch_capskip', s, 4, 8.0, 0.7, kept=0.5)
    report = build_report(root)
    assert {t.name for t in report.sections[('', 'r')]} == {'runs', 'composition'}
    assert 'No complete `dense` runs here' in report_markdown(report)


# --- pairings across recipes and folders, the bar, validation accuracy (issue 12) ---

def _two_recipes(root):
    "Dense at two learning rates (two recipes) and a composite in its own folder, three seeds, written by hand."
    times = {'a': [40.0, 41.0, 43.0], 'b': [39.0, 42.5, 42.0], 'masked': [44.0, 46.0, 45.0]}
    accs = {'a': [0.700, 0.712, 0.705], 'b': [0.709, 0.716, 0.715], 'masked': [0.701, 0.705, 0.700]}
    for i, s in enumerate((1, 2, 3)):
        write_run(root, 'lr01', 'dense', s, 8, times['a'][i], accs['a'][i])
        write_run(root, 'lr005', 'dense', s, 8, times['b'][i], accs['b'][i])
        write_run(root / 'masked', 'lr005', 'infobatch_capskip', s, 8, times['masked'][i], accs['masked'][i], kept=0.5)
    return times, accs


def test_pairings_across_recipes_and_folders_match_scipy(tmp_path):
    root = tmp_path / 'runs'
    times, accs = _two_recipes(root)
    assert report_main([str(root), '--out', str(tmp_path / 'rep'), '--no-figures', '--bar', '-0.4',
                        '--pair', 'lr005/dense:lr01/dense', '--pair', 'masked/lr005/infobatch_capskip@8:lr005/dense@8']) == 0
    rows = read_csv(tmp_path / 'rep' / 'pairings.csv')
    assert [r['arm'] for r in rows] == ['lr005/dense@8', 'masked/lr005/infobatch_capskip@8']
    for row, (a, b) in zip(rows, (('b', 'a'), ('masked', 'b'))):
        diffs = 100 * (np.array(accs[a]) - np.array(accs[b]))
        assert float(row['acc_diff_pp']) == pytest.approx(diffs.mean(), rel=1e-9)
        assert (float(row['acc_diff_pp_lo']), float(row['acc_diff_pp_hi'])) == pytest.approx(scipy_interval(diffs), rel=1e-9)
        logs = np.log(np.array(times[a]) / np.array(times[b]))
        lo, hi = scipy_interval(logs)
        assert float(row['time_ratio_hi']) == pytest.approx(math.exp(hi), rel=1e-9)
        time_ok, acc_ok = math.exp(hi) < 1.0, scipy_interval(diffs)[0] >= -0.4
        assert row['bar'] == {(True, True): 'yes', (False, True): 'no (time)', (True, False): 'no (acc.)', (False, False): 'no'}[(time_ok, acc_ok)]
    assert 'bar passed' in (tmp_path / 'rep' / 'report.md').read_text()


def test_bad_pairings_and_missing_cells_are_explained(tmp_path, capsys):
    root = tmp_path / 'runs'
    _two_recipes(root)
    assert report_main([str(root), '--pair', 'lr01/dense']) == 2
    assert '--pair takes ARM_CELL:REF_CELL' in capsys.readouterr().err
    report = build_report(root, pairs=['lr01/dense@8:lr005/capskip@8'])
    assert any('no complete runs of lr005/capskip@8' in p for _, p in report.notes.items)


def test_val_acc_report_names_runs_without_a_validation_split(tmp_path):
    root = tmp_path / 'runs'
    for s in (1, 2):
        write_run(root, 'ft', 'dense', s, 2, 10.0, 0.7, final_extra={'val_acc': None},
                  config_extra={'data_kw': {'img_size': 224, 'val_fraction': 0.0}})
    report = build_report(root, metric='val_acc')
    assert any(w == 'ft' and 'without a validation split' in p for w, p in report.notes.items)


def test_lm_table_pairs_the_chosen_metric_and_its_direction():
    "`--metric loss|ppl|acc`: the LM table shows that metric alone; lower loss/ppl and higher accuracy are 'better'."
    from pathlib import Path
    from capskip.analysis.results import Notes, ReportData, Run
    from capskip.analysis.tables import sequence_table
    data = ReportData(('', 'lm'), {}, 'test_acc', 100.0, Notes())
    for arm, shift in (('dense', 0.0), ('capskip', -0.01)):              # capskip: lower loss, higher token accuracy
        for s, loss in ((1, 3.0), (2, 3.1), (3, 2.9)):
            final = {'test_loss': loss + shift * (4 + s), 'test_acc': 0.3 - shift * (4 + s), 'train_time_s': 10.0 + s, 'kept_fraction': 1.0}
            data.cells.setdefault((arm, 3), {})[s] = Run(path=Path('.'), recipe='lm', arm=arm, seed=s, epochs=3, variant='',
                                                         config={}, final=final)
    verdict = lambda paired: sequence_table(data, paired=paired).rows[0][3 if paired != 'acc' else 4].split(']')[1].split()[0]
    assert [verdict(m) for m in ('loss', 'ppl', 'acc')] == ['better', 'better', 'better']
    ppl = sequence_table(data, paired='ppl').rows[0][3]
    assert float(ppl.split()[0]) < 1, ppl                                # a ratio: below 1 is better
    for run in data.cells['capskip', 3].values():                         # the control: flip capskip to worse
        run.final = {**run.final, 'test_loss': run.final['test_loss'] + 0.2, 'test_acc': run.final['test_acc'] - 0.2}
    assert [verdict(m) for m in ('loss', 'ppl', 'acc')] == ['worse', 'worse', 'worse']


def test_steps_that_ran_every_row_are_summed_and_noted(folder, tmp_path):
    "An epoch's policy counters hold all_rows_steps (the backward ran every row though the rule kept fewer: reforward with dropout, or a reuse trace it could not slice); final.json sums them and the report says that rows_backprop_frac counts the rule's rows there (before: neither, the saving looked real)."
    from types import SimpleNamespace
    from capskip.runs.train import final_summary
    rows = [{'rows_backprop': 60, 'rows_forwarded': 100, 'kept_fraction': 0.6, 'val_acc': 0.7, 'test_acc': None,
             'policy': {'all_rows_steps': 3.0 if e == 1 else None}} for e in (1, 2)]
    rows[-1]['test_acc'] = 0.7
    state = SimpleNamespace(config=SimpleNamespace(recipe='r', arm='capskip', seed=1, epochs=2, time_matched=None),
                            rows=rows, splits=SimpleNamespace(train=range(100)), train_time_s=10.0)
    assert final_summary(state)['all_rows_steps'] == 3
    assert 'all_rows_steps' not in final_summary(SimpleNamespace(**{**vars(state), 'rows': [dict(r, policy={}) for r in rows]}))
    root, _, _ = folder
    write_run(root, 'r', 'capskip', 4, 8, 60.0, 0.77, kept=0.6, final_extra={'all_rows_steps': 12})
    write_run(root, 'r', 'dense', 4, 8, 80.0, 0.77)
    assert report_main([str(root), '--out', str(tmp_path / 'rep'), '--no-figures']) == 0
    missing = read_csv(tmp_path / 'rep' / 'missing.csv')
    assert any(m['where'] == 'r/capskip/seed4/ep8' and m['problem'].startswith('12 step(s) back-propagated every row')
               for m in missing), missing
    eq = {(r['arm'], r['epochs']): r for r in read_csv(tmp_path / 'rep' / 'r__equal_epochs.csv')}
    assert eq[('capskip', '8')]['n'] == '4'                   # still compared: the run is complete and exact
