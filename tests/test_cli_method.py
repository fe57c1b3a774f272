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
