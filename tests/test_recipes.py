"""Recipes: the registry mirrors the paper, every field is overridable and type-checked, `capskip recipes` lists them."""
import json

import pytest

from capskip.cli.runs import recipes_main
from capskip.core import DEFAULT_BUDGET
from capskip.runs.build import policy_kwargs
from capskip.runs.recipes import RECIPES, TrainConfig, apply_overrides, get_recipe, list_recipes, parse_set, resolve_config
from capskip.runs.schedules import scaled_lr


def test_paper_recipes_present():
    names = list_recipes()
    for name in ('resnet18gn_cifar100', 'resnet18gn_cifar100_ib', 'deit_s_cifar100_finetune', 'digits', 'digits_ib'):
        assert name in names


def test_paper_recipe_fields():
    r = get_recipe('resnet18gn_cifar100')
    assert (r.model, r.data, r.label_smoothing, r.weight_decay, r.schedule, r.clip_norm) == \
        ('resnet18_gn', 'cifar100', 0.1, 5e-4, 'onecycle', 0.0)
    assert scaled_lr(r.base_lr, r.batch_size, r.base_batch) == pytest.approx(0.1)
    assert r.policy_kw['budget'] == DEFAULT_BUDGET == 0.09          # paper §4
    ib = get_recipe('resnet18gn_cifar100_ib')
    assert scaled_lr(ib.base_lr, ib.batch_size, ib.base_batch) == pytest.approx(0.05) and ib.clip_norm == 5.0
    d = get_recipe('deit_s_cifar100_finetune')
    assert (d.model, d.amp, d.weight_decay, d.clip_norm, d.schedule, d.warmup_frac, d.epochs, d.seeds,
            d.time_matched_epochs, d.model_kw['drop_path_rate'], d.label_smoothing, d.data_kw['img_size']) == \
        ('deit_s', 'bf16', 0.0, 1.0, 'warmup_cosine', 0.05, 103, [17, 29, 43], 59, 0.1, 0.0, 224)
    dib = get_recipe('digits_ib')
    assert dib.clip_norm == 5.0 and dib.base_lr == get_recipe('digits').base_lr / 2


@pytest.mark.parametrize('name', list(RECIPES))
def test_every_recipe_resolves_and_its_policy_options_exist(name):
    cfg = resolve_config(name)
    assert isinstance(cfg, TrainConfig) and cfg.recipe == name
    json.dumps(cfg.to_dict())                                  # JSON-ready for config.json
    for arm in ('dense', 'capskip', cfg.arm):
        policy_kwargs(apply_overrides(cfg, {'arm': arm}))       # raises on an option no policy has


def test_overrides_are_typed_and_nested():
    cfg = resolve_config('digits', parse_set(['epochs=3', 'base_lr=1', 'policy_kw.budget=0.5', 'amp=bf16',
                                              'model_kw.width=8', 'pretrained=null', 'nesterov=true']))
    assert (cfg.epochs, cfg.base_lr, cfg.policy_kw, cfg.amp, cfg.model_kw, cfg.pretrained, cfg.nesterov) == \
        (3, 1.0, {'budget': 0.5}, 'bf16', {'width': 8}, None, True)
    assert type(cfg.base_lr) is float
    assert get_recipe('digits').policy_kw == {'budget': DEFAULT_BUDGET}     # registry untouched


@pytest.mark.parametrize('overrides, message', [
    ({'epochs': 2.5}, 'epochs must be int'),
    ({'epochs': 0}, 'epochs must be >= 1'),
    ({'momentum': 1.0}, 'momentum'),
    ({'lr': 0.1}, 'unknown config field'),
    ({'clip_norm': -1}, 'clip_norm'),
    ({'amp': 'fp16'}, "amp must be 'none' or 'bf16'"),
    ({'nesterov': 'yes'}, 'nesterov must be bool'),
    ({'seed.x': 1}, 'dotted key'),
])
def test_bad_overrides_are_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve_config('digits', overrides)


def test_unknown_recipe_suggests():
    with pytest.raises(ValueError, match="did you mean 'digits_ib'"):
        get_recipe('digits_lb')
    with pytest.raises(ValueError, match='key=value'):
        parse_set(['epochs'])


def test_recipes_cli_lists_recipes_and_arms(capsys):
    from capskip.policies import list_policies
    assert recipes_main([]) == 0
    out = capsys.readouterr().out
    for name in RECIPES: assert name in out
    for arm in list_policies(): assert arm in out
    assert recipes_main(['--show', 'deit_s_cifar100_finetune']) == 0
    assert json.loads(capsys.readouterr().out)['time_matched_epochs'] == 59
    with pytest.raises(SystemExit):
        recipes_main(['--show', 'nope'])
