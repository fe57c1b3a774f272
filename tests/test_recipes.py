"""Recipes: the registry mirrors the paper, every field is overridable and type-checked, `capskip recipes` lists them."""
import json

import pytest
import torch

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
    assert recipes_main(['--show', 'deit_s_cifar100_finetune', '--json']) == 0
    assert json.loads(capsys.readouterr().out)['time_matched_epochs'] == 59
    with pytest.raises(SystemExit):
        recipes_main(['--show', 'nope'])


# --- sources of every recipe value (issue 12) ---

@pytest.mark.parametrize('name', list(RECIPES))
def test_every_field_of_every_recipe_has_a_source(name):
    from capskip.runs.sources import SOURCE_KINDS, flat_fields, recipe_sources
    rows = recipe_sources(name)
    assert set(rows) == set(flat_fields(get_recipe(name)))
    for key, (value, src) in rows.items():
        assert src.kind in SOURCE_KINDS and src.text.strip(), key
        if src.kind == 'paper': assert any(m in src.text for m in ('§', 'Table', 'appendix')), (name, key, src.text)


def test_recipes_show_prints_each_field_with_its_source(capsys):
    assert recipes_main(['--show', 'resnet18gn_cifar100']) == 0
    out = capsys.readouterr().out
    lines = {l.split()[0]: l for l in out.splitlines() if l and not l.startswith(('-', ' '))}
    assert 'assumption:' in lines['model_kw.groups'] and 'GroupNorm' in lines['model_kw.groups']
    assert 'paper: Table 1 caption' in lines['batch_size']
    assert 'assumption:' in lines['pct_start'] and 'OneCycleLR' in lines['pct_start']
    assert 'paper:' in lines['weight_decay'] and 'lost in the extracted text' in lines['weight_decay']
    for inferred in ('base_lr', 'clip_norm', 'eval_every'):           # inferred from another sentence: not a quote
        assert 'assumption: inferred' in lines[inferred], lines[inferred]
    assert 'SPEC' not in out
    # the arms' own settings and the choices no field shows are listed too, each with its source
    assert 'assumption:' in lines['policy_kw.beta'] and '33.9%' in lines['policy_kw.beta']
    assert 'policy_kw.history' in lines and 'paper: §4.2' in lines['policy_kw.prime_epochs']
    assert 'weight decay on every parameter: assumption:' in out and 'schedule through pruned epochs: assumption:' in out
    with pytest.raises(SystemExit):
        recipes_main(['--show', 'resnet18gn_cifar10'])


def test_an_arm_option_without_a_source_is_refused(monkeypatch):
    from capskip.runs import sources
    table = dict(sources.ARM_OPTION_SOURCES); del table['history']
    monkeypatch.setattr(sources, 'ARM_OPTION_SOURCES', table)
    with pytest.raises(ValueError, match="option 'history' has no source"):
        sources.arm_settings('resnet18gn_cifar100')


def test_a_field_without_a_source_is_refused(monkeypatch):
    from capskip.runs import sources
    table = dict(sources.RECIPE_SOURCES['resnet18gn_cifar100']); del table['weight_decay']
    monkeypatch.setitem(sources.RECIPE_SOURCES, 'resnet18gn_cifar100', table)
    with pytest.raises(ValueError, match=r"no source for \['weight_decay'\]"):
        sources.recipe_sources('resnet18gn_cifar100')


def test_the_issue_labels_are_fixed():
    from capskip.policies import create_policy
    from capskip.policies.baselines import check_sb_options
    from capskip.runs.sources import recipe_sources
    assert get_recipe('resnet18gn_cifar100').model_kw == {'groups': 32}
    assert recipe_sources('resnet18gn_cifar100')['model_kw.groups'][1].kind == 'assumption'
    ib = get_recipe('resnet18gn_cifar100_ib')
    assert ib.policy_kw['final_batch'] == 'keep'                                  # the paper kept its tiny final batches
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    assert create_policy('infobatch', model, mode='masked').final_batch == 'keep'
    with pytest.raises(ValueError, match='inferred from the 33.9% kept fraction'):
        check_sb_options(-1.0, 0.0)
    scratch = get_recipe('resnet18gn_cifar100')
    assert scratch.cycle_momentum and (scratch.base_momentum, scratch.max_momentum) == (0.85, 0.95)
    assert 'momentum cycled' in scratch.notes
    deit = get_recipe('deit_s_cifar100_finetune')
    assert deit.data_kw['val_fraction'] == 0.0 and deit.eval_every == 4 and not deit.cycle_momentum


def test_one_cycle_momentum_matches_torch_and_reaches_the_optimizer():
    from capskip.runs.schedules import lr_at, make_sgd, momentum_at, set_lr, step_progress
    cfg = vars(get_recipe('resnet18gn_cifar100'))
    total, peak = 400, 0.1
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=peak, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=peak, total_steps=total)     # PyTorch's defaults
    ours = make_sgd([torch.nn.Parameter(torch.zeros(1))], lr=peak, momentum=0.9)
    worst = 0.0
    for s in range(total):
        prog = step_progress(0, s, total, 1)
        set_lr(ours, lr_at(cfg, peak, prog), momentum_at(cfg, prog))
        worst = max(worst, abs(ours.param_groups[0]['momentum'] - opt.param_groups[0]['momentum']))
        opt.step(); sched.step()
    assert worst < 2e-3                                    # O(1/T): mid-step vs start-of-step sampling
    with pytest.raises(ValueError, match="cycle_momentum needs schedule='onecycle'"):
        resolve_config('deit_s_cifar100_finetune', {'cycle_momentum': True})


def test_training_without_a_validation_split_says_so(tmp_path):
    import warnings
    from capskip.runs import data
    from capskip.testing import write_fake_cifar100
    write_fake_cifar100(tmp_path, per_class_train=3, per_class_test=1)
    data._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        splits = data.cifar100_splits(tmp_path, val_fraction=0.0)
    assert (len(splits.train), len(splits.val), splits.has_val, splits.img_size) == (300, 0, False, 32)
    assert any('model selection on validation is impossible' in str(w.message) for w in caught)
    with pytest.raises(ValueError, match=r'val_fraction must be in \[0, 1\)'):
        data.cifar100_splits(tmp_path, val_fraction=-0.1)
