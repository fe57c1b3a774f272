"""`capskip bench selector` runs end to end on tiny sizes and prints the table (structure only; never timings)."""
import pytest
import torch

from capskip.bench.selector import COLUMNS, format_table, materialised_gram, select_materialised
from capskip.cli.tools import bench_main, bench_selector_main as main
from capskip.selector import select


def test_bench_prints_one_row_per_shape(capsys):
    assert main(['--batch', '6,9', '--classes', '4', '--dims', '3,5', '--repeats', '2', '--warmup', '1',
                 '--backend', 'aot_eager']) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, l in enumerate(lines) if l.strip().startswith('B |'))
    assert [c.strip() for c in lines[header].split('|')] == list(COLUMNS)
    rows = [[c.strip() for c in l.split('|')] for l in lines[header + 2:header + 6]]
    assert [(r[0], r[1], r[2]) for r in rows] == [('6', '4', '3'), ('6', '4', '5'), ('9', '4', '3'), ('9', '4', '5')]
    for r in rows:
        assert all(float(r[k]) > 0 for k in (3, 4, 6)) and r[8].endswith('x') and r[9].endswith('x') and r[10] == 'yes'
        assert float(r[7]) == pytest.approx(int(r[0]) * 4 * (int(r[2]) + 1) * 4 / 2 ** 20, abs=0.05)


def test_bench_through_the_cli_without_compile(capsys):
    assert bench_main(['selector', '--batch', '5', '--classes', '3', '--dims', '2', '--repeats', '1', '--backend', 'none']) == 0
    row = capsys.readouterr().out.splitlines()[-2]
    assert [c.strip() for c in row.split('|')][4] == '-'


def test_bench_rejects_bad_arguments():
    with pytest.raises(SystemExit): main(['--batch', '12x'])
    with pytest.raises(SystemExit): main(['--batch', '0'])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit): main(['--device', 'cuda'])


def test_materialised_gram_equals_factorised_selection():
    gen = torch.Generator().manual_seed(0)
    R, H = torch.randn(20, 4, generator=gen), torch.randn(20, 6, generator=gen)
    correct = torch.rand(20, generator=gen) < 0.7
    order = torch.arange(20)
    Ht = torch.cat([H, torch.ones(20, 1)], 1)
    assert torch.allclose(materialised_gram(R, H, order), (R @ R.T) * (Ht @ Ht.T), rtol=1e-4, atol=1e-4)
    for b in (0.0, 0.1, 0.6):
        mat, fac = select_materialised(R, H, correct, b), select(R, H, correct, b)
        assert torch.equal(mat.drop, fac.drop) and int(mat.m) == int(fac.m)
        assert torch.equal(mat.order, fac.order)
        assert torch.allclose(mat.prefix_norms, fac.prefix_norms, rtol=1e-4, atol=1e-5)
        assert torch.allclose(mat.threshold, fac.threshold, rtol=1e-4) and torch.allclose(mat.distortion, fac.distortion, rtol=1e-3, atol=1e-6)
