"`capskip bench step` on a tiny model: the table's structure (no timing assertions)."
import json

import pytest

from capskip.bench_step import PHASES, main, parse_keeps


def test_bench_step_table_structure(tmp_path, capsys):
    out_json = tmp_path / 'rows.json'
    rc = main(['--model', 'digits_cnn', '--img', '8', '--batch', '8', '--num-classes', '10', '--keep', '0.5',
               '--repeats', '2', '--warmup', '1', '--json', str(out_json)])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.split()[:2] == ['mode', 'k'])
    columns = lines[head].split()
    assert columns[:8] == ['mode', 'k', 'ratio', 'ideal', 'overhead', 'peak_mem', 'peak_MiB', 'step_ms']
    assert columns[8:] == list(PHASES)
    body = [l.split() for l in lines[head + 1:head + 5]]
    assert [(r[0], r[1]) for r in body] == [('dense', '1.00'), ('masked', '0.50'), ('reforward', '0.50'), ('reuse', '0.50')]
    assert all(len(r) == len(columns) for r in body)
    assert body[0][2] == '1.000' and body[0][5] == '1.000'        # dense is the reference of ratio and memory
    assert float(body[3][3]) == pytest.approx((1 + 2 * 0.5) / 3, abs=1e-3)
    rows = json.loads(out_json.read_text())
    assert [r['mode'] for r in rows] == ['dense', 'masked', 'reforward', 'reuse']
    assert all(r['peak_mem'] > 0 and r['forward'] > 0 for r in rows)
    assert all(abs(r['overhead'] - (r['ratio'] - r['ideal'])) < 1e-9 for r in rows)


def test_bench_step_rejects_bad_keep(capsys):
    assert main(['--keep', '1.5']) == 2
    assert '(0, 1]' in capsys.readouterr().err
    with pytest.raises(ValueError): parse_keeps('a,b')
