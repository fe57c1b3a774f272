"""The training runner on a token-id task: `capskip train --recipe digits_text` (and so `sweep` and `report`) trains
`DigitsText` on the digits read as 65-token sequences, CAPSkip in `reuse` — rows really skipped, no fallback — and
the run resumes exactly like an image run."""
import pytest
import torch

from capskip.runs.data import create_splits
from capskip.runs.recipes import get_recipe
from capskip.runs.runio import load_checkpoint, read_jsonl, run_dir
from capskip.runs.text import DIGITS_SEQ, TokenRows
from capskip.runs.train import train

pytestmark = pytest.mark.filterwarnings('error::RuntimeWarning')       # reuse's fallback to a full backward warns


def text_config(arm='capskip', epochs=3, **over):
    cfg = get_recipe('digits_text')
    cfg.arm, cfg.epochs, cfg.seed, cfg.epoch_budgets = arm, epochs, 1, [epochs]
    for k, v in over.items(): setattr(cfg, k, v)
    return cfg


def test_the_splits_are_token_ids():
    splits = create_splits('digits_text')
    x, y, idx = splits.train.fetch(torch.arange(5))
    assert x.dtype == torch.long and x.shape == (5, DIGITS_SEQ) and isinstance(splits.train, TokenRows)
    assert [len(splits.train), len(splits.val), len(splits.test)] == [1257, 180, 360]
    assert torch.equal(splits.test.labels, create_splits('digits').test.labels)


def test_capskip_trains_the_text_recipe_in_reuse(tmp_path):
    final = train(text_config(), tmp_path, progress='none')
    assert final['status'] == 'complete'
    rows = read_jsonl(run_dir(tmp_path, 'digits_text', 'capskip', 1, 3) / 'results.jsonl')
    assert rows[-1]['rows_backprop'] < rows[-1]['rows_forwarded']          # rows were skipped by the epoch-3 model
    assert final['test_acc'] > 0.2                                        # it learns in 3 epochs (chance: 0.1)


def test_a_stopped_text_run_resumes_to_the_same_state(tmp_path):
    whole = tmp_path / 'whole'; train(text_config(), whole, progress='none')
    part = tmp_path / 'part'
    train(text_config(), part, progress='none', stop_after=1)
    train(text_config(), part, progress='none', resume=True)
    a = load_checkpoint(run_dir(whole, 'digits_text', 'capskip', 1, 3) / 'checkpoint.pt')['model']
    b = load_checkpoint(run_dir(part, 'digits_text', 'capskip', 1, 3) / 'checkpoint.pt')['model']
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_token_rows_refuse_float_rows():
    with pytest.raises(ValueError, match=r'integer \[N, L\]'):
        TokenRows(torch.zeros(3, 4), torch.zeros(3))
