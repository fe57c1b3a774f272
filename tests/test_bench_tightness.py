"""`capskip bench tightness` (`capskip.bench.tightness`): the measurement against the exact rule on a float64 model, and
the command's usage errors; and `capskip bench step`'s kept fractions as a mask of B rows realises them."""
import pytest
import torch

from capskip.bench.sequence import WidthLM
from capskip.bench.step import StepBench, format_table, realised_keep, show_k
from capskip.bench.tightness import TightnessRow, format_tightness_table, measure_bounds
from capskip.cli.tools import bench_tightness_main
from capskip.sequence import block_gram


def peaked_lm(V=30, seed=0):
    torch.manual_seed(seed)
    lm = WidthLM(layers=1, d=12, vocab=V, heads=2, max_len=10).double()
    with torch.no_grad(): lm.head.weight.mul_(2)       # softmaxes peaked enough that the rule drops rows
    return lm


def batches(V=30, n=3, seed=0):
    ids = torch.randint(0, V, (n, 6, 11), generator=torch.Generator().manual_seed(seed))
    out = []
    for i in ids:
        y = i[:, 1:].clone()
        for r in range(len(y)): y[r, :10 - 2 * r] = -100  # prompts: row r has 2r labelled tokens (row 0 none: G_i = 0)
        out.append((i[:, :-1], y))
    return out


def test_bounds_at_k_equal_v_drop_the_exact_rows_and_small_k_is_looser():
    lm, bs = peaked_lm(), batches()
    got = measure_bounds(lm, bs, ks=[1, 30], budgets=[0.09, 0.3])
    for b in (0.09, 0.3):
        assert got[b, 'topk:30'][0] == got[b, 'exact'][0] and got[b, 'topk:30'][1] < 1e-12
        assert got[b, 'topk:1'][1] > 1e-3                                    # control: k = 1 leaves a measurable gap
        assert got[b, 'topk:1'][0] <= got[b, 'exact'][0]                     # it never drops more than the exact rule here
    assert got[0.3, 'exact'][0] > got[0.09, 'exact'][0] > 0
    assert all(v[2] <= key[0] * (1 + 1e-9) for key, v in got.items())      # every dropped set within its budget


def test_the_realised_distortion_is_computed_on_the_exact_gram():
    lm, bs = peaked_lm(seed=1), batches(seed=1)[:1]
    got = measure_bounds(lm, bs, ks=[30], budgets=[0.3])
    x, y = bs[0]
    with torch.no_grad(): z, h = lm(x)
    from capskip.sequence import select_from_gram, sequence_candidates
    K = block_gram(z, y, h, bias=False)
    drop = select_from_gram(K, sequence_candidates(z, y, 'all'), 0.3).drop
    G = torch.stack([torch.einsum('lv,ld->vd', *_rows(z[i], y[i], h[i])) for i in range(len(y))])
    ratio = (G[drop].sum(0).norm() / G.sum(0).norm()).item()
    assert got[0.3, 'exact'][2] == pytest.approx(ratio, rel=1e-9, abs=1e-12)


def _rows(z, y, h):
    "A row's (r_t masked, h_t) for G_i = Σ_t r_t h_tᵀ (up to the batch's 1/N, which cancels in ‖D‖/‖G‖)."
    r = torch.softmax(z, -1)
    m = y != -100
    r[m, y[m]] -= 1
    return r * m[:, None], h


def test_format_names_each_gram_with_its_share_of_the_exact_rule():
    rows = [TightnessRow(1024, 300, 3.0, 3.1, 0.09, 'exact', 0.25, 0.0, 0.08),
            TightnessRow(1024, 300, 3.0, 3.1, 0.09, 'topk:16', 0.125, 0.2, 0.05)]
    text = format_tightness_table(rows)
    assert 'topk:16 dropped [share], width' in text and '[0.50]' in text and '0.250' in text


@pytest.mark.parametrize('argv, message', [
    (['--vocab', '100'], 'at least 260'), (['--budgets', '1.5'], 'budgets in (0, 1)'),
    (['--width', '10', '--heads', '4'], 'multiple of --heads'), (['--steps', '-1'], 'integers ≥ 0'),
    (['--seq', '16'], 'use a longer --seq')])
def test_bench_tightness_usage_errors_are_one_line(argv, message, capsys):
    try: rc = bench_tightness_main(argv)
    except SystemExit as e: rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err and 'Traceback' not in err


def test_step_bench_reports_the_kept_fraction_its_mask_realises():
    assert realised_keep(0.35, 8) == 0.375 and realised_keep(0.69, 8) == 0.75 and realised_keep(0.01, 8) == 0.125
    assert StepBench(batch=8, keeps=[0.35, 0.69]).keeps == [0.375, 0.75]
    assert StepBench(batch=128).keeps == [45 / 128, 88 / 128]
    bench = StepBench(batch=8, keeps=[0.35])
    assert StepBench(**{**bench.__dict__}).keeps == bench.keeps                 # idempotent: the measuring process rebuilds it
    from capskip.bench.ddp import DDPBench
    assert DDPBench(batch=8, keeps=(0.35, 0.69)).keeps == (0.375, 0.75)        # the DDP bench, per process, the same way


def test_tables_print_the_realised_fraction_unrounded():
    assert show_k(0.375) == '0.375' and show_k(0.5) == '0.50' and show_k(45 / 128) == '0.352'
    row = {'mode': 'reuse', 'k': 0.375, 'ratio': 0.7, 'ideal': (1 + 2 * 0.375) / 3, 'overhead': 0.1, 'peak_mem': 1.0,
           'peak_mib': 1.0, 'step_ms': 1.0, 'forward': 1.0, 'selector': 0.0, 'gather': 0.0, 'backward': 1.0, 'optimizer': 0.0}
    assert format_table([row]).splitlines()[1].split()[:2] == ['reuse', '0.375']


def test_a_crash_keeps_the_vocabularies_measured_so_far_marked_partial(tmp_path, monkeypatch, capsys):
    import capskip.bench.tightness as tight
    from capskip.bench.tightness import load_tightness
    row = lambda V: TightnessRow(V, 0, 1.0, 1.0, 0.3, 'exact', 0.25, 0.0, 0.1)
    def fake(bench, V, progress=None):
        if V == 8192: raise RuntimeError('killed half-way')
        return [row(V)]
    monkeypatch.setattr(tight, 'train_and_measure', fake)
    path = tmp_path / 'run.json'
    with pytest.raises(RuntimeError): bench_tightness_main(['--vocab', '1024,8192', '--record', str(path)])
    rec, rows = load_tightness(path)
    assert rec['complete'] is False and [r.vocab for r in rows] == [1024]
    assert bench_tightness_main(['--vocab', '1024,2048', '--record', str(path)]) == 0      # control: a whole run
    rec, rows = load_tightness(path)
    assert rec['complete'] is True and [r.vocab for r in rows] == [1024, 2048]


def test_training_reports_progress_and_leaves_the_global_rng_alone():
    from capskip.bench.tightness import TightnessBench, train_and_measure
    bench = TightnessBench(vocabs=[300], seq=48, batch=4, width=8, layers=1, heads=2, steps=[0, 200, 200], ks=[2],
                           budgets=[0.3], eval_batches=1, dtype='float64')
    torch.manual_seed(123); before = torch.get_rng_state()
    lines = []
    rows = train_and_measure(bench, 300, lines.append)
    assert torch.equal(torch.get_rng_state(), before)
    assert sorted({r.step for r in rows}) == [0, 200] and len(rows) == 2 * 2     # a repeated checkpoint is measured once
    assert any('step 100: training loss' in l for l in lines) and sum('val loss' in l for l in lines) == 2
