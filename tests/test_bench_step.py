"`capskip bench step` on a tiny model: the table's structure (no timing assertions)."
import json

import pytest

from capskip.bench.step import STEP_PHASES, backward_floor, format_floor, mode_ideal, parse_keeps
from capskip.cli.tools import bench_main, bench_step_main as main


def test_bench_step_table_structure(tmp_path, capsys):
    out_json = tmp_path / 'rows.json'
    rc = main(['--model', 'digits_cnn', '--img', '8', '--batch', '8', '--num-classes', '10', '--keep', '0.5',
               '--repeats', '2', '--warmup', '1', '--json', str(out_json)])
    assert rc == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    # the measuring subprocess's progress comes through this process's sys.stderr (captured, never leaking into pytest's output)
    assert '  repetition 2/2 done' in captured.err.splitlines()
    head = next(i for i, l in enumerate(lines) if l.split()[:2] == ['mode', 'k'])
    columns = lines[head].split()
    assert columns[:8] == ['mode', 'k', 'ratio', 'ideal', 'overhead', 'peak_mem', 'peak_MiB', 'step_ms']
    assert columns[8:] == list(STEP_PHASES)
    body = [l.split() for l in lines[head + 1:head + 6]]
    assert [(r[0], r[1]) for r in body] == [('dense', '1.00'), ('masked', '0.50'), ('reforward', '0.50'), ('reuse', '0.50'),
                                            ('kept_only', '0.50')]
    assert all(len(r) == len(columns) for r in body)
    assert body[0][2] == '1.000' and body[0][5] == '1.000'        # dense is the reference of ratio and memory
    assert float(body[3][3]) == pytest.approx((1 + 2 * 0.5) / 3, abs=1e-3)
    assert float(body[4][3]) == pytest.approx(0.5, abs=1e-3)    # the reference forwards only the kept rows
    assert float(body[2][3]) == pytest.approx((1 + 3 * 0.5) / 3, abs=1e-3) and body[1][3] == '1.000'   # own ideals
    assert any(l.startswith('k=0.50: eager backward over the kept rows') for l in lines)
    assert any('reuse gathers' in l and 'GB/s' in l for l in lines)
    rows = json.loads(out_json.read_text())
    reuse = next(r for r in rows if r['mode'] == 'reuse')
    assert 0 < reuse['gathered_mib'] <= reuse['saved_mib'] and reuse['bandwidth_gbs'] > 0 and reuse['floor_saved_mib'] > 0
    assert 0 < reuse['gather_alone_ms'] < 1e3                     # the gathers, timed on their own in the same run
    assert any(l.strip().startswith('the same gathers timed alone in this run') for l in lines)
    assert [r['mode'] for r in rows] == ['dense', 'masked', 'reforward', 'reuse', 'kept_only']
    assert all(r['peak_mem'] > 0 and r['forward'] > 0 for r in rows)
    assert all(abs(r['overhead'] - (r['ratio'] - r['ideal'])) < 1e-9 for r in rows)


def test_bench_step_rejects_bad_keep(capsys):
    assert main(['--keep', '1.5']) == 2
    assert '(0, 1]' in capsys.readouterr().err
    assert bench_main(['step', '--keep', '0,0.5']) == 2
    with pytest.raises(SystemExit): main(['--batch', '1'])
    with pytest.raises(ValueError): parse_keeps('a,b')


def test_backward_floor_is_the_reference_backward_over_dense():
    row = lambda mode, k, bwd, **kw: {'mode': mode, 'k': k, 'forward': 50.0, 'backward': bwd, 'selector': 1.0, 'gather': 0.5,
                                      'optimizer': 5.0, 'step_ms': 150.0, **kw}
    acct = dict(saved_mib=300.0, gathered_mib=105.0, floor_saved_mib=110.0, bandwidth_gbs=20.0, gather_copy_ms=11.0)
    rows = [row('dense', 1.0, 100.0), row('reuse', 0.35, 42.0, **acct), row('kept_only', 0.35, 40.0),
            row('reuse', 0.69, 77.0), row('kept_only', 0.69, 70.0), row('masked', 0.35, 101.0)]
    floor = backward_floor(rows)
    assert [f['k'] for f in floor] == [0.35, 0.69]
    assert floor[0]['floor_share'] == pytest.approx(0.40) and floor[0]['reuse_over_floor'] == pytest.approx(1.05)
    assert floor[1]['floor_share'] == pytest.approx(0.70) and floor[1]['reuse_over_floor'] == pytest.approx(1.10)
    assert floor[0]['excess_ms'] == pytest.approx(2.0) and floor[0]['fixed_share'] == pytest.approx(1.5 / 150)
    assert floor[0]['gathered_mib'] == 105.0 and 'gathered_mib' not in floor[1]     # the account travels when measured
    # reuse's other phases (50 + 1 + 0.5 + 5) + the floor's backward (40) + the copy (11), over the dense step (150)
    assert floor[0]['copy_bound'] == pytest.approx(107.5 / 150) and floor[0]['copy_bound_overhead'] == pytest.approx(107.5 / 150 - 1.7 / 3)
    assert 'copy_bound' not in floor[1]                                               # no copy time measured at 0.69
    # what no selector changes: dense's forward (50) + the floor's backward (40) + dense's optimizer (5), over 150
    assert floor[0]['forward_share'] == pytest.approx(50 / 150) and floor[0]['floor_step'] == pytest.approx(95 / 150)
    assert floor[0]['floor_step_overhead'] == pytest.approx(95 / 150 - 1.7 / 3) and floor[1]['floor_step'] == pytest.approx(125 / 150)
    text = format_floor(floor).splitlines()
    assert len(text) == 6 and text[0].startswith('k=0.35: eager backward over the kept rows = 0.400')
    assert "dense's forward is 0.333 of its step" in text[1] and 'make 0.633 of the dense step (+0.067 over (1+2k)/3)' in text[1]
    assert 'reuse gathers 105.0 MiB per step' in text[2] and "takes 11.0 ms (27.5% of the floor's backward)" in text[2]   # 11 of 40 ms
    assert floor[0]['copy_share'] == pytest.approx(11 / 40)
    assert floor[0]['copy_bound_ms'] == pytest.approx(107.5) and floor[0]['reuse_phases_ms'] == pytest.approx(98.5)
    assert "floor's time plus that copy: 107.5 ms against its 98.5 ms (phase medians summed), 0.717 of the dense step, +0.150 over (1+2k)/3" in text[3]


def test_reuse_over_floor_is_the_median_of_paired_ratios():
    "Backward ÷ floor pairs reuse and kept_only within each repetition (as the step ratio pairs with dense), so a drift that slows one repetition cancels."
    from capskip.bench.step import summarize
    rep = lambda bwd: {ph: (bwd if ph == 'backward' else 1.0) for ph in STEP_PHASES}
    times = {('dense', 1.0): [rep(100.0)] * 3,
             ('reuse', 0.5): [rep(50.0), rep(60.0), rep(200.0)],     # the third repetition ran while the machine was busy
             ('kept_only', 0.5): [rep(49.0), rep(40.0), rep(190.0)]}
    rows = summarize(times, None)
    reuse = next(r for r in rows if r['mode'] == 'reuse')
    assert reuse['bw_floor'] == pytest.approx(200 / 190)                        # median of 1.020, 1.5, 1.053
    assert reuse['backward'] / next(r for r in rows if r['mode'] == 'kept_only')['backward'] == pytest.approx(60 / 49)   # ratio of medians: 1.22
    lo, hi = reuse['bw_floor_iqr']
    assert 50 / 49 <= lo <= reuse['bw_floor'] <= hi <= 1.5
    floor = backward_floor(rows)
    assert floor[0]['reuse_over_floor'] == reuse['bw_floor'] and floor[0]['reuse_over_floor_iqr'] == (lo, hi)
    assert 'median of per-repetition ratios, middle half' in format_floor(floor)
    old = [{key: v for key, v in r.items() if key not in ('bw_floor', 'bw_floor_iqr')} for r in rows]   # a record made before pairing
    assert 'ratio of the medians' in format_floor(backward_floor(old))
    assert backward_floor(old)[0]['reuse_over_floor'] == pytest.approx(60 / 49)


def test_each_mode_has_its_own_ideal():
    assert mode_ideal('reuse', 0.35) == pytest.approx((1 + 2 * 0.35) / 3)
    assert mode_ideal('reforward', 0.35) == pytest.approx((1 + 3 * 0.35) / 3)
    assert mode_ideal('masked', 0.35) == 1.0 and mode_ideal('kept_only', 0.35) == 0.35


def test_gather_sources_are_what_the_backward_gathers_once_each():
    "At every kept count the bytes of the gather sources' kept rows are what saved_bytes reports; the timed gathers run."
    import torch
    from capskip.bench.step import gather_seconds
    from capskip.engine import Engine
    from capskip.engine.reuse import gather_sources, saved_bytes
    from capskip.runs.models import create_model
    torch.manual_seed(0)
    model = create_model('vit_tiny', num_classes=10, img_size=16, depth=2).train()   # two blocks: the same gathers per block
    x = torch.randn(8, 3, 16, 16)
    fwd = Engine(model, 'reuse').forward(x)
    sources = gather_sources(fwd.state)
    assert sources and all(t.shape[0] % 8 == 0 for t, _ in sources)                 # row-carrying values of the batch
    per_row = sum(t.numel() * t.element_size() for t, _ in sources) // 8
    for kept in (1, 3, 8):
        assert abs(saved_bytes(fwd.state, kept)[1] - kept * per_row) <= len(sources)     # integer division per source
    keep = torch.zeros(8, dtype=torch.bool); keep[[1, 4, 6]] = True
    assert 0 < gather_seconds(fwd.state, keep) < 10


def test_floor_text_omits_the_timed_gathers_when_not_measured():
    row = lambda mode, k, bwd, **kw: {'mode': mode, 'k': k, 'forward': 50.0, 'backward': bwd, 'selector': 1.0, 'gather': 0.5,
                                      'optimizer': 5.0, 'step_ms': 150.0, **kw}
    acct = dict(saved_mib=300.0, gathered_mib=105.0, floor_saved_mib=110.0, bandwidth_gbs=20.0, gather_copy_ms=11.0)
    rows = [row('dense', 1.0, 300.0), row('kept_only', 0.35, 100.0), row('reuse', 0.35, 120.0, **acct, gather_alone_ms=15.0),
            row('kept_only', 0.69, 200.0), row('reuse', 0.69, 210.0, **acct, gather_alone_ms=float('nan'))]
    text = format_floor(backward_floor(rows)).splitlines()
    timed = [l for l in text if 'timed alone' in l]
    assert len(timed) == 1 and '15.0 ms (75% of the excess over the floor)' in timed[0]      # 15 of the 20 ms excess


def test_causal_lm_runner_back_propagates_the_kept_sequences_exactly():
    "`--model width_lm --seq L`: rows are sequences; each mode's gradient is autograd of the kept rows' token loss (1/N)."
    import torch
    import torch.nn.functional as F
    from capskip.bench.step import StepBench, build_runner
    runner = build_runner(StepBench(model='width_lm', seq=6, batch=4, width=64, vocab=40, layers=1, keeps=[0.5]))
    runner.y = runner.y.clone(); runner.y[1, 3:] = -100                 # a partly labelled row (y views the ids)
    keep = torch.tensor([True, True, False, False])
    z = runner.model(runner.x)
    tok = F.cross_entropy(z.flatten(0, 1), runner.y.flatten(), reduction='none', ignore_index=-100).view(4, 6)
    (tok.sum(1)[keep].sum() / (runner.y != -100).sum()).backward()
    ref = {n: p.grad.clone() for n, p in runner.model.named_parameters()}
    for mode in ('masked', 'reuse'):
        runner.model.zero_grad(set_to_none=True)
        fwd = runner.engines[mode].forward(runner.x)
        runner.engines[mode].backward(fwd, runner.loss_grad(fwd.logits, runner.y, keep.float()), keep)
        for n, p in runner.model.named_parameters():
            assert torch.allclose(p.grad, ref[n], atol=1e-6, rtol=1e-4), (mode, n)
    runner.model.zero_grad(set_to_none=True)
    assert set(runner.step('reuse', 0.5)) == set(STEP_PHASES) and set(runner.step('kept_only', 0.5)) == set(STEP_PHASES)


def test_width_lm_and_seq_go_together(capsys):
    for argv in (['--model', 'width_lm'], ['--seq', '16'], ['--model', 'width_lm', '--seq', '16', '--width', '100']):
        with pytest.raises(SystemExit) as e: main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and ('--seq' in err or '--width' in err) and 'Traceback' not in err, err


@pytest.mark.parametrize('gram', ['auto', 'topk:4'])
def test_causal_lm_step_backpropagates_round_kB_rows_with_their_exact_gradient(gram):
    "runner.step on sequence rows: the selective modes back-propagate round(k·B) seeded rows (a Gram's own k, top-k's, is not the kept fraction) with autograd's gradient of those rows' token loss (1/N); with top-k the kept rows' softmax sums come from the selector's split."
    import torch
    import torch.nn.functional as F
    from capskip.bench.step import StepBench, build_runner
    runner = build_runner(StepBench(model='width_lm', seq=6, batch=8, width=64, vocab=300, layers=1, keeps=[0.375], gram=gram))
    for mode in ('masked', 'reuse'):
        seen, engine = {}, runner.engines[mode]
        def spy(fwd, grad, keep, *extra, backward=engine.backward):
            kept = backward(fwd, grad, keep, *extra)
            seen.update(keep=keep.clone(), shape=tuple(grad.shape),
                        grads={n: p.grad.clone() for n, p in runner.model.named_parameters() if p.grad is not None})
            return kept
        engine.backward = spy
        try: runner.step(mode, 0.375)
        finally: del engine.backward                                  # the instance attribute: the method again
        keep = seen['keep']
        assert int(keep.sum()) == 3 and seen['shape'] == (3, 6, 300), (mode, keep, seen['shape'])
        runner.model.zero_grad(set_to_none=True)
        z = runner.model(runner.x)
        tok = F.cross_entropy(z.flatten(0, 1), runner.y.flatten(), reduction='none', ignore_index=-100).view(8, 6)
        (tok.sum(1)[keep].sum() / (runner.y != -100).sum()).backward()
        for n, p in runner.model.named_parameters():
            torch.testing.assert_close(seen['grads'][n], p.grad, atol=1e-6, rtol=1e-4)
        runner.model.zero_grad(set_to_none=True)
