"`capskip check --zoo` (capskip.cli.zoo): the subset of the table that fits the suite budget — a BatchNorm convnet, a distillation-head ViT, a convnet, an MLP-mixer, the text rows (token ids with padding) (the ViT under reuse: tests/test_engine_reuse.py)."
import logging

import pytest

from capskip.cli.zoo import ZOO, format_zoo, zoo_entries, zoo_row
from capskip.engine.check import TOLERANCE

SUBSET = {'torchvision:resnet18': {'reuse': 'refused (BatchNorm in train mode: module bn1 (BatchNorm2d))'},
          'timm:deit_tiny_distilled_patch16_224': {'reuse': 'refused (head: '},
          'timm:convnext_atto': {'reuse': 'exact', 'reforward': 'exact'},
          'timm:mixer_s16_224': {'reuse': 'exact', 'reforward': 'exact'},
          'digits_text': {'reuse': 'exact', 'reforward': 'exact'},                 # token ids + a padding mask
          'hf:bert-tiny-config': {'reuse': 'exact', 'reforward': 'exact'}}


@pytest.fixture(scope='module')
def rows():
    logging.getLogger('capskip.engine').setLevel(logging.ERROR)
    return {e.name: zoo_row(e) for e in zoo_entries(list(SUBSET))}


def test_the_zoo_covers_the_families():
    families = ' '.join(e.family for e in ZOO)
    assert len(ZOO) >= 15
    for kind in ('convnet', 'ViT', 'MLP-mixer', 'hierarchical', 'MultiheadAttention', 'BatchNorm', 'token ids'):
        assert kind in families


@pytest.mark.parametrize('name', list(SUBSET))
def test_subset_verdicts(rows, name):
    row = rows[name]
    for mode, expected in SUBSET[name].items():
        assert row.modes[mode].startswith(expected), (mode, row.modes[mode])
    if all(v == 'exact' for v in row.modes.values()):
        assert row.max_err <= TOLERANCE and row.global_err <= 1e-5
    assert not row.failed


def test_table(rows):
    lines = format_zoo(list(rows.values())).splitlines()
    assert len(lines) == 2 + len(SUBSET) and lines[0].startswith('| architecture |')
