"""A backward that ran every row though the rule dropped some (exact, no saving) is recorded where a user reads the step:
`StepStats.all_rows` and the counters' `all_rows_steps` (`capskip.engine.node.note_all_rows`, `nbs/01k_node.ipynb`).
Before, only the classifier's fused `skip.step` set it: a causal LM's `skip.step`, and `skip.loss(...).backward()` in
every case, recorded the skipped rows as saved with `all_rows` False, while reuse's warning said the step was recorded;
and reforward's second forward over every row (random masks, token counts) was recorded nowhere."""
import warnings

import pytest
import torch
from torch import nn

import capskip

V, D, B, L = 20, 8, 6, 5


class CountingLM(nn.Module):
    "A causal-LM-shaped model whose embedding counts tokens over the batch: reuse and reforward run every row."
    def __init__(self):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(V, D, scale_grad_by_freq=True), nn.Linear(D, D), nn.Linear(D, V)
    def forward(self, x): return self.head(torch.tanh(self.mid(self.emb(x))))


class PlainLM(CountingLM):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)


def dropout_mlp():
    return nn.Sequential(nn.Linear(D, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 3))


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (B, L), generator=g), torch.randint(0, V, (B, L), generator=g)


def two_steps(model, mode, x, y):
    "One `skip.step` and one `skip.loss(...).backward()`: their StepStats' (kept, all_rows), and the counters."
    torch.manual_seed(0)
    skip = capskip.CAPSkip(model.double(), budget=0.9, mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        first = skip.step(x, y)
        skip.loss(skip(x), y).backward()
    got = [(int(first.kept), first.all_rows), (int(skip.last.kept), skip.last.all_rows)]
    return got, skip.counters()


@pytest.mark.parametrize('mode', ['reuse', 'reforward'])
def test_a_causal_lm_whose_backward_runs_every_row_records_it(mode):
    x, y = batch()
    torch.manual_seed(0)
    got, counters = two_steps(CountingLM(), mode, x, y)
    assert all(0 < kept < B for kept, _ in got), got           # the rule dropped rows in both steps
    assert [all_rows for _, all_rows in got] == [True, True], got
    assert counters['all_rows_steps'] == 2 and counters['rows_backprop'] == sum(k for k, _ in got)   # the rule's rows, and the word


@pytest.mark.parametrize('mode', ['reuse', 'reforward', 'masked'])
def test_a_sliceable_lm_records_no_all_rows_step(mode):
    x, y = batch()
    torch.manual_seed(0)
    got, counters = two_steps(PlainLM(), mode, x, y)
    assert all(0 < kept < B for kept, _ in got) and not any(a for _, a in got), got
    assert 'all_rows_steps' not in counters


@pytest.mark.parametrize('mode, ran_every_row', [('reforward', True), ('reuse', False)])
def test_reforward_with_dropout_records_its_second_forward_over_every_row(mode, ran_every_row):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, D, generator=g, dtype=torch.float64), torch.randint(0, 3, (32,), generator=g)
    torch.manual_seed(0)
    skip = capskip.CAPSkip(dropout_mlp().double(), budget=0.9, mode=mode)
    skip.loss(skip(x), y).backward()
    assert 0 < int(skip.last.kept) < 32
    assert skip.last.all_rows == ran_every_row
    assert skip.counters().get('all_rows_steps', 0) == (1 if ran_every_row else 0)


@pytest.mark.parametrize('mode', ['reuse', 'reforward'])
def test_a_shifted_slice_of_the_logits_records_it_too(mode):
    "`skip.loss(z[:, :-1], y[:, 1:])`: the node is found through the slice."
    x, y = batch()
    torch.manual_seed(0)
    skip = capskip.CAPSkip(CountingLM().double(), budget=0.9, mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        z = skip(x)
        skip.loss(z[:, :-1], y[:, 1:]).backward()
    assert 0 < int(skip.last.kept) < B and skip.last.all_rows
    assert skip.counters()['all_rows_steps'] == 1
