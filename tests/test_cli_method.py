"`capskip select-demo` and `capskip check` (capskip.cli.method): flags, printed lines, exit statuses."
import pytest

import capskip.cli.method as method
from capskip.cli.method import check_main, select_demo_main
from capskip.core import DEFAULT_BUDGET


def test_select_demo_prints_the_selection(capsys):
    assert select_demo_main(['--steps', '10', '--batch', '64']) == 0
    out = capsys.readouterr().out
    for field in ('candidates', 'm*', 'm_fv', 'm_mag', 'distortion', 'kept fraction'):
        assert field in out
    dist = float(out.split('distortion ‖D‖/‖G‖')[1].split()[0])
    check = float(out.split('from materialised grads')[1].split()[0])
    assert dist <= DEFAULT_BUDGET + 1e-6 and abs(dist - check) < 1e-4
    assert f'(budget {DEFAULT_BUDGET})' in out


def test_select_demo_refuses_a_batch_larger_than_the_test_split(capsys):
    with pytest.raises(SystemExit) as exc:
        select_demo_main(['--batch', '999', '--steps', '1'])
    assert exc.value.code == 2 and '360 rows' in capsys.readouterr().err


def test_check_passes_on_a_small_model(capsys):
    assert check_main(['--model', 'digits_cnn', '--img', '16', '--batch', '6', '--keep', '0.35', '--mode', 'all']) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith('model digits_cnn  params ')
    assert out[-1].startswith('max_rel_err=')
    assert float(out[-1].split('=')[1]) <= 1e-5
    assert out[-2] == 'OK'
    assert any(l.startswith('reuse ') for l in out) and any(l.startswith('reforward ') for l in out)
    assert any(l.startswith('reuse: exact  max_rel_err') for l in out) and 'keep 0.35' in out[0]
    assert any(l.split()[:3] == ['reuse', 'keep', '2'] for l in out)              # round(0.35·6) = 2 kept rows


def test_check_refuses_batchnorm_with_exit_2(capsys):
    assert check_main(['--model', 'torchvision:resnet18', '--img', '16', '--batch', '2', '--mode', 'reuse']) == 2
    out = capsys.readouterr().out
    assert 'refused' in out and 'BatchNorm2d' in out and 'batchnorm_to_groupnorm' in out
    assert out.strip().splitlines()[-1] == 'max_rel_err=nan'


def test_check_exits_1_above_the_tolerance(monkeypatch, capsys):
    monkeypatch.setattr('capskip.engine.check.TOLERANCE', -1.0)     # check_main imports it when it runs
    assert check_main(['--model', 'digits_cnn', '--img', '16', '--batch', '4', '--mode', 'reforward']) == 1
    assert 'FAILED' in capsys.readouterr().out


@pytest.mark.parametrize('argv, message', [(['--model', 'digits_cnn', '--batch', '1'], '--batch must be >= 2'),
                                           (['--model', 'digits_cnn', '--batch', '4', '--keep', '5'], 'kept fraction'),
                                           (['--model', 'digits_cnn', '--keep', '0'], 'kept fraction'),
                                           ([], '--zoo'), (['--zoo', '--model', 'digits_cnn'], 'drop --model'),
                                           (['--only', 'timm:convnext_atto'], 'use it with --zoo'),
                                           (['--zoo', '--only', 'timm:nope'], 'not in the zoo')])
def test_check_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        check_main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_check_zoo_prints_one_row_per_architecture(capsys):
    assert check_main(['--zoo', '--only', 'torchvision:resnet18,timm:deit_tiny_distilled_patch16_224']) == 0
    out = capsys.readouterr().out
    table = [l for l in out.splitlines() if l.startswith('| `')]
    assert len(table) == 2
    assert 'refused (BatchNorm in train mode: module bn1 (BatchNorm2d))' in table[0]
    assert 'refused (head: ' in table[1] and 'head_dist' in table[1]
    assert out.strip().splitlines()[-1] == 'OK: no gradient was wrong'


def test_check_refuses_a_model_whose_output_is_not_its_head(monkeypatch, capsys):
    import torch.nn as nn
    monkeypatch.setattr(method, '_build_model', lambda name, c, img: nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, c), nn.Softmax(1)))
    assert check_main(['--model', 'mine', '--batch', '4', '--img', '8']) == 2
    out = capsys.readouterr().out
    assert 'refused' in out and 'followed by `4` (Softmax)' in out and out.strip().splitlines()[-1] == 'max_rel_err=nan'


def bn_model(name, c, img):
    import torch.nn as nn
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, c))


def test_check_eval_mode_checks_the_model_in_eval_mode(monkeypatch, capsys):
    "BatchNorm is refused in train mode; with --eval it reads its running statistics, rows are independent, exact."
    import capskip.engine.check as check
    monkeypatch.setattr(method, '_build_model', bn_model)
    assert check_main(['--model', 'bn', '--batch', '4', '--img', '8']) == 2
    out = capsys.readouterr().out
    assert '  train mode  ' in out.splitlines()[0] and 'BatchNorm2d' in out
    seen = []
    real = check.gradient_check
    monkeypatch.setattr(check, 'gradient_check', lambda model, *a: seen.append(model.training) or real(model, *a))
    assert check_main(['--model', 'bn', '--batch', '4', '--img', '8', '--eval']) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert '  eval mode  ' in out[0] and out[-2] == 'OK' and seen == [False, False]
    assert any(l.startswith('reuse: exact') for l in out) and any(l.startswith('reforward: exact') for l in out)
    with pytest.raises(SystemExit) as exc:
        check_main(['--zoo', '--eval'])
    assert exc.value.code == 2 and '--eval checks one --model' in capsys.readouterr().err


def tiny_bart(tmp_path):
    transformers = pytest.importorskip('transformers')
    transformers.BartConfig(vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
                            dropout=0.0, attention_dropout=0.0).save_pretrained(tmp_path)
    return tmp_path


def test_check_gives_a_bart_classifier_valid_token_ids(tmp_path):
    "BartForSequenceClassification reads the hidden state at each row's last eos and needs as many eos in every row."
    import torch
    from capskip.runs.text import example_inputs, hf_model
    torch.manual_seed(0)
    model = hf_model(str(tiny_bart(tmp_path)), 3)
    raw = example_inputs(model, 6, 32, torch.Generator().manual_seed(0))
    assert 'eos' in method.plain_forward_error(model, raw)                       # the random ids alone fail, in one line
    x = method.valid_token_inputs(model, raw)
    ids, mask = x['input_ids'], x['attention_mask'].bool()
    eos, pad, last = model.config.eos_token_id, model.config.pad_token_id, mask.sum(1) - 1
    assert ids.eq(eos).sum(1).tolist() == [1] * 6 and ids[torch.arange(6), last].eq(eos).all()
    assert not torch.isin(ids[mask], torch.tensor([pad, model.config.bos_token_id])).any() and ids[~mask].eq(pad).all()
    assert method.plain_forward_error(model, x) is None
    assert torch.equal(x['attention_mask'], raw['attention_mask']) and not mask.all()   # padded rows kept


def test_check_runs_an_hf_bart_config(tmp_path, capsys):
    path = tiny_bart(tmp_path)
    assert check_main(['--model', f'hf:{path}', '--batch', '4', '--mode', 'reforward']) == 0
    out = capsys.readouterr().out
    assert 'reforward: exact' in out and 'eos' not in out


def test_check_turns_a_failing_mode_into_one_line(monkeypatch, capsys):
    import capskip.engine.check as check
    real = check.gradient_check
    def crash(model, x, y, modes, *a):
        if modes == ('reuse',): raise TypeError('Cannot convert symbols to int\n  a second line')
        return real(model, x, y, modes, *a)
    monkeypatch.setattr(check, 'gradient_check', crash)
    assert check_main(['--model', 'digits_cnn', '--img', '16', '--batch', '4']) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert 'reuse: FAILED (raised TypeError: Cannot convert symbols to int)  max_rel_err nan  global_err nan' in out
    assert any(l.startswith('reforward: exact') for l in out) and 'a second line' not in '\n'.join(out)
    assert out[-2].startswith('FAILED: reuse raised an error') and out[-1] == 'max_rel_err=nan'


def test_check_a_model_that_cannot_run_or_be_built_is_one_line(monkeypatch, tmp_path, capsys):
    import torch.nn as nn
    class Broken(nn.Module):
        def __init__(self, c):
            super().__init__(); self.fc = nn.Linear(3, c)
        def forward(self, x): raise ValueError('All examples must have the same number of <eos> tokens.\nmore')
    monkeypatch.setattr(method, '_build_model', lambda name, c, img: Broken(c))
    assert check_main(['--model', 'mine', '--batch', '4', '--img', '8']) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 3 and out[1].startswith("error: the model's own forward fails on the random batch (ValueError: "
                                               'All examples must have the same number of <eos> tokens.)')
    assert out[-1] == 'max_rel_err=nan'
    monkeypatch.setattr(method, '_build_model', lambda name, c, img: (_ for _ in ()).throw(KeyError('model_type')))
    with pytest.raises(SystemExit) as exc:
        check_main(['--model', 'hf:mine'])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[-1].endswith("could not build --model hf:mine: KeyError: 'model_type'")


@pytest.mark.parametrize('seed', ['1e23', str(10**23), '-1'])
def test_check_refuses_a_seed_torch_cannot_take(seed, capsys):
    "A seed outside 0 … 2**63 − 1 is one usage line (exit 2) before any model is built, not torch's overflow traceback."
    with pytest.raises(SystemExit) as e: check_main(['--seed', seed])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert 'argument --seed' in err and '2**63' in err and 'Traceback' not in err
