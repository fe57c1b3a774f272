"`capskip check`: exit status and last line for an exact model, a refused model and a failing tolerance."
import torch.nn as nn

import capskip.check as check
from capskip.check import gradient_check, main, without_stochastic_layers


def test_check_passes_on_a_small_model(capsys):
    assert main(['--model', 'digits_cnn', '--img', '16', '--batch', '6', '--keep', '2', '--mode', 'all']) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith('max_rel_err=')
    assert float(out[-1].split('=')[1]) <= 1e-5
    assert any(l.startswith('reuse ') for l in out) and any(l.startswith('reforward ') for l in out)


def test_check_refuses_batchnorm_with_exit_2(capsys):
    assert main(['--model', 'torchvision:resnet18', '--img', '16', '--batch', '2', '--mode', 'reuse']) == 2
    out = capsys.readouterr().out
    assert 'refused' in out and 'BatchNorm2d' in out and 'batchnorm_to_groupnorm' in out
    assert out.strip().splitlines()[-1] == 'max_rel_err=nan'


def test_check_exits_1_above_the_tolerance(monkeypatch, capsys):
    monkeypatch.setattr(check, 'TOLERANCE', -1.0)
    assert main(['--model', 'digits_cnn', '--img', '16', '--batch', '4', '--mode', 'reforward']) == 1
    assert 'FAILED' in capsys.readouterr().out


def test_stochastic_layers_are_switched_off_in_a_copy():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    copy, changed = without_stochastic_layers(model)
    assert changed == 1 and copy[1].p == 0.0 and model[1].p == 0.5


def test_bad_keep_is_a_clear_error():
    import pytest, torch
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match='keep must be in'):
        gradient_check(model, torch.randn(3, 4), torch.zeros(3, dtype=torch.long), keep=5)
