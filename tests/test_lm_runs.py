"""Causal-LM runs through the runner (`capskip.runs.lm`, recipe `stdlib-sft`): TinyGPT's CAPSkip gradient is exact for
the kept sequences, `capskip train` writes the LM fields, dense and CAPSkip at budget 0 train the same weights, a
sweep + report shows the LM comparison, and an arm that cannot train sequence rows is refused in one line."""
import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

import capskip.engine.reuse as reuse
from capskip import CAPSkip
from capskip.cli.runs import sweep_main, train_main
from capskip.engine.check import model_grads
from capskip.runs.models import create_model
from capskip.runs.recipes import resolve_config
from capskip.runs.runio import load_checkpoint, read_json, read_jsonl, run_dir
from capskip.runs.train import train

B, L, V = 6, 12, 40
MODULES = ['calendar', 'csv', 'difflib', 'shlex', 'textwrap', 'string', 'cmd', 'argparse', 'fractions', 'statistics',
           'heapq', 'bisect']
TINY = {'data_kw.seq_len': 96, 'data_kw.max_rows': 16, 'data_kw.val_fraction': 0.2, 'data_kw.test_fraction': 0.2,
        'data_kw.modules': MODULES, 'model_kw': {'dim': 16, 'depth': 1, 'heads': 2, 'max_len': 96, 'dtype': 'float64'},
        'batch_size': 8, 'epochs': 2, 'warmup': False}
LM_FIELDS = ('loss', 'train_acc', 'val_loss', 'val_ppl', 'val_acc', 'test_loss', 'test_ppl', 'test_acc')


def cli_sets(overrides: dict) -> list[str]:
    return [a for k, v in overrides.items() for a in ('--set', f'{k}={json.dumps(v)}')]


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, y = torch.randint(0, V, (B, L), generator=g), torch.randint(0, V, (B, L), generator=g)
    y[:, :3] = -100; y[3, 7:] = -100                        # prompt tokens and padding carry no loss
    return ids, y


@pytest.mark.parametrize('mode', ['reuse', 'masked'])
def test_tiny_gpt_capskip_gradient_is_exact_for_the_kept_sequences(mode, monkeypatch):
    torch.manual_seed(0)
    model = create_model('tiny_gpt', num_classes=V, dim=16, depth=2, heads=2, max_len=L, dtype='float64')
    ids, y = batch()
    seen, real = [], reuse._bw_args
    def spy(traced, specs, saved, tangent, rows):
        seen.append(tangent.shape[0])
        return real(traced, specs, saved, tangent, rows)
    monkeypatch.setattr(reuse, '_bw_args', spy)
    skip = CAPSkip(model, budget=0.5, mode=mode)
    skip.loss(skip(ids), y).backward()
    s, kept = skip.last, int(skip.last.kept)
    assert 0 < kept < B and 0 <= float(s.distortion) <= 0.5 + 1e-9
    ref = copy.deepcopy(model); ref.zero_grad(set_to_none=True)
    tok = F.cross_entropy(ref(ids).reshape(-1, V), y.reshape(-1), reduction='none').view(B, L)
    ((tok.sum(1) * s.applied).sum() / (y != -100).sum()).backward()
    got, want = model_grads(model), model_grads(ref)
    worst = max(float((got[n] - w).abs().max()) for n, w in want.items())
    assert worst / max(float(w.abs().max()) for w in want.values()) < 1e-10
    if mode == 'reuse': assert seen == [max(kept, 2)], seen     # the backward ran on the kept sequences only


def test_train_cli_writes_the_lm_records(tmp_path, capsys):
    argv = ['--recipe', 'stdlib-sft', '--arm', 'capskip', '--seed', '1', '--out', str(tmp_path), '--quiet', *cli_sets(TINY)]
    assert train_main(argv) == 0
    folder = run_dir(tmp_path, 'stdlib-sft', 'capskip', 1, 2)
    rows, final = read_jsonl(folder / 'results.jsonl'), read_json(folder / 'final.json')
    assert len(rows) == 2 and final['status'] == 'complete' and read_json(folder / 'config.json')['optimizer'] == 'adamw'
    for r in rows + [final]:
        for k in LM_FIELDS if r is not final else LM_FIELDS[2:]:
            assert isinstance(r[k], float) and math.isfinite(r[k]), (k, r[k])
        for split in ('val', 'test'):
            assert abs(r[f'{split}_ppl'] - math.exp(r[f'{split}_loss'])) <= 1e-9 * r[f'{split}_ppl']
            assert 0 <= r[f'{split}_acc'] <= 1
    for r in rows:
        assert r['rows_forwarded'] == 16 and 0 < r['rows_backprop'] <= 16 and r['kept_fraction'] == r['rows_backprop'] / 16
        assert r['policy']['tokens'] > 0 and r['epoch_time_s'] > 0
    assert final['test_loss'] == rows[-1]['test_loss'] and final['best_val_loss'] == min(r['val_loss'] for r in rows)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed['arm'] == 'capskip' and printed['test_ppl'] == final['test_ppl']
    assert train_main(argv) == 0                              # a finished run is reused, not recomputed
    assert read_json(folder / 'final.json') == final


def test_dense_and_capskip_at_budget_zero_train_the_same_weights(tmp_path):
    zero = dict(TINY, **{'policy_kw.budget': 0.0})
    finals = {arm: train(resolve_config('stdlib-sft', zero, arm=arm, seed=2), tmp_path, progress='none')
              for arm in ('dense', 'capskip')}
    assert finals['capskip']['rows_backprop_frac'] == 1.0
    weights = {arm: load_checkpoint(run_dir(tmp_path, 'stdlib-sft', arm, 2, 2) / 'checkpoint.pt')['model']
               for arm in finals}
    scale = max(float(w.abs().max()) for w in weights['dense'].values())
    worst = max(float((weights['capskip'][n] - w).abs().max()) for n, w in weights['dense'].items())
    assert worst / scale < 1e-9, worst / scale
    assert abs(finals['capskip']['test_loss'] - finals['dense']['test_loss']) < 1e-9


def test_sweep_and_report_show_the_lm_comparison(tmp_path, capsys):
    from capskip.cli.runs import report_main
    small = dict(TINY, epochs=1)
    argv = ['--recipe', 'stdlib-sft', '--arms', 'dense,capskip', '--seeds', '1,2', '--epochs', '1', '--out', str(tmp_path),
            '--quiet', *cli_sets(small)]
    assert sweep_main(argv) == 0
    table = capsys.readouterr().out
    assert 'test ppl' in table and table.count(' done ') == 4, table
    assert report_main([str(tmp_path), '--no-figures']) == 0
    text = (tmp_path / 'report' / 'report.md').read_text()
    assert 'test loss diff' in text and 'test ppl ratio' in text and 'rows bwd' in text, text
    runs = {(a, s): read_json(run_dir(tmp_path, 'stdlib-sft', a, s, 1) / 'final.json') for a in ('dense', 'capskip') for s in (1, 2)}
    want = sum(runs['capskip', s]['test_loss'] - runs['dense', s]['test_loss'] for s in (1, 2)) / 2
    assert f'{want:+.4f}' in text, (want, text)
    assert report_main([str(tmp_path), '--no-figures', '--metric', 'ppl', '--out', str(tmp_path / 'ppl')]) == 0
    lm = (tmp_path / 'ppl' / 'report.md').read_text().split('### Causal LM')[1].split('###')[0]
    assert '(test ppl)' in lm and 'ratio arm / dense' in lm and 'below 1' in lm and 'test loss diff' not in lm, lm
    ratio = math.exp(sum(math.log(math.exp(runs['capskip', s]['test_loss'] - runs['dense', s]['test_loss'])) for s in (1, 2)) / 2)
    cell = next(l for l in lm.splitlines() if l.startswith('| capskip |')).split('|')[4].strip()
    assert abs(float(cell.split()[0]) - ratio) < 1e-3, (ratio, cell)   # the geometric mean of the per-seed ppl ratios
    assert cell.split(']')[1].split()[0] in ('better', 'worse', 'unresolved'), cell   # lower is better: _lower_is_better
    capsys.readouterr()
    assert report_main([str(tmp_path), '--metric', 'bleu']) == 2             # a bad value: one line naming the choices
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'test_acc, val_acc, loss, ppl, acc' in err and 'Traceback' not in err, err


def test_an_arm_that_cannot_train_sequence_rows_is_refused_in_one_line(tmp_path, capsys):
    for main, argv in ((train_main, ['--recipe', 'stdlib-sft', '--arm', 'infobatch']),
                       (sweep_main, ['--recipe', 'stdlib-sft', '--arms', 'dense,capskip_rw', '--seeds', '1,2'])):
        with pytest.raises(SystemExit) as stop:               # the usage error, before any run
            main([*argv, '--out', str(tmp_path)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and 'Traceback' not in err, err
        last = err.strip().splitlines()[-1]
        assert ': error: arm ' in last and 'cannot train sequence rows' in last and 'capskip_masked' in last, last
    assert not any(tmp_path.iterdir())


def test_a_stopped_lm_run_resumes_to_the_uninterrupted_one(tmp_path):
    config = resolve_config('stdlib-sft', TINY, arm='capskip', seed=3)
    whole = train(config, tmp_path / 'whole', progress='none')
    assert train(config, tmp_path / 'cut', progress='none', stop_after=1)['epoch'] == 1
    resumed = train(config, tmp_path / 'cut', resume=True, progress='none')
    same = lambda f: {k: v for k, v in f.items() if not k.endswith('time_s')}
    assert same(resumed) == same(whole)
    a, b = (load_checkpoint(run_dir(tmp_path / name, 'stdlib-sft', 'capskip', 3, 2) / 'checkpoint.pt')['model']
            for name in ('whole', 'cut'))
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_evaluate_tokens_and_evaluate_share_one_loop_and_restore_training():
    "`build.eval_batches` serves both: token loss/ppl/acc equal a float64 recount over all batches, the mode comes back."
    from capskip.runs.build import eval_batches, evaluate
    from capskip.runs.lm import evaluate_tokens
    from capskip.runs.models import tiny_gpt
    from capskip.runs.text import TokenRows
    torch.manual_seed(0)
    model, cpu = tiny_gpt(num_classes=16, dim=8, depth=1, heads=2, max_len=6, dtype='float64'), torch.device('cpu')
    ids = torch.randint(0, 16, (7, 6))
    labels = torch.cat([ids[:, 1:], torch.full((7, 1), -100)], 1)
    labels[2, 3:] = -100                                              # padding inside a row
    data = TokenRows(ids, labels)
    model.train()
    got = evaluate_tokens(model, data, 3, cpu)                        # 3 batches: 3 + 3 + 1 rows
    assert model.training
    with torch.no_grad(): z = model(ids)
    mask = labels != -100
    loss = float(F.cross_entropy(z[mask], labels[mask], reduction='mean'))
    acc = float((z.argmax(-1)[mask] == labels[mask]).double().mean())
    assert abs(got['loss'] - loss) < 1e-12 and abs(got['ppl'] - math.exp(loss)) < 1e-9 and got['acc'] == pytest.approx(acc, abs=1e-15)
    model.eval()
    assert len(list(eval_batches(model, data, 3, cpu))) == 3 and not model.training   # eval mode kept as it was
    model.train()
    import contextlib
    with contextlib.closing(eval_batches(model, data, 3, cpu)) as batches:
        logits, y = next(batches)
        assert not model.training and not logits.requires_grad and logits.shape == (3, 6, 16) and y.shape == (3, 6)
    assert model.training                                             # an early exit restores the training mode
    flat = TokenRows(ids, ids[:, 0])                                  # one label per row: build.evaluate's top-1 path
    assert evaluate(torch.nn.Sequential(torch.nn.Embedding(16, 16), torch.nn.Flatten(1), torch.nn.Linear(96, 16)),
                    flat, 3, cpu) is not None
