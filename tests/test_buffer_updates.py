"""A forward that keeps updating buffers (`capskip.engine.probe.updated_buffers`, `nbs/01c_probe.ipynb`): spectral
normalisation's power iteration advances `u` and `v` at every training forward. `reforward` ran that forward twice per
step (every row, then the kept rows), so its gradient followed another state than plain autograd's, with no word;
`reuse` refused it as if rows depended on each other. Both now refuse it in one line naming the buffers; `masked` and
`dense` stay plain autograd; an update a second forward leaves unchanged is not refused, and `reuse` hands it to
`reforward`, exactly."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrizations import spectral_norm

from capskip.engine.check import grad_errors, model_grads
from capskip.skip import CAPSkip

TOL = 1e-12     # float64 against float64 autograd: round-off is near 1e-16; a second power iteration moves the gradient far more


def spectral():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), spectral_norm(nn.Linear(16, 16)), nn.Tanh(), nn.Linear(16, 4)).double()


class Once(nn.Module):
    "A classifier that marks a buffer at each forward: the same value every time (a table filled once)."
    def __init__(self):
        super().__init__()
        self.a, self.fc = nn.Linear(6, 8), nn.Linear(8, 4)
        self.register_buffer('seen', torch.zeros(()))
    def forward(self, x):
        self.seen.fill_(1.0)
        return self.fc(torch.tanh(self.a(x)))


def once():
    torch.manual_seed(0)
    return Once().double()


def batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (10,), generator=g)) for _ in range(n)]


def errors(build, mode, budget=0.5):
    "Per step, the (top, global) error of `mode`'s gradient against autograd of the kept rows on a copy."
    model, ref = build(), build()
    skip = CAPSkip(model, budget=budget, mode=mode)
    out = []
    for x, y in batches():
        model.zero_grad(); ref.zero_grad()
        skip.loss(skip(x), y).backward()
        (F.cross_entropy(ref(x), y, reduction='none') * skip.last.applied).sum().div(len(y)).backward()
        out.append(grad_errors(model_grads(model), model_grads(ref)))
    return out


@pytest.mark.parametrize('mode', ['reuse', 'reforward'])
def test_a_forward_that_keeps_updating_buffers_is_refused_in_one_line(mode):
    x, y = batches(1)[0]
    skip = CAPSkip(spectral(), budget=0.5, mode=mode)
    with pytest.raises(ValueError) as err:
        skip.loss(skip(x), y).backward()
    msg = str(err.value)
    assert '\n' not in msg and '2.parametrizations.weight.0._u' in msg and "mode='masked'" in msg, msg


@pytest.mark.parametrize('mode', ['dense', 'masked'])
def test_dense_and_masked_keep_plain_autograds_gradient_and_state(mode):
    errs = errors(spectral, mode)
    assert all(top < TOL and rel < TOL for top, rel in errs), errs


def test_a_frozen_spectral_norm_runs_in_reuse_exactly():
    errs = errors(lambda: spectral().eval(), 'reuse')     # eval(): the power iteration stops, nothing is updated
    assert all(top < TOL and rel < TOL for top, rel in errs), errs


@pytest.mark.parametrize('mode', ['reuse', 'reforward'])
def test_an_update_a_second_forward_leaves_unchanged_is_not_refused(mode):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        errs = errors(once, mode)
    assert all(top < TOL and rel < TOL for top, rel in errs), errs
    if mode == 'reuse':     # the traced graph would not write the buffer back: reforward runs it
        assert any('falling back to mode="reforward"' in str(w.message) and 'buffer' in str(w.message) for w in caught)
