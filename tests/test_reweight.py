"Re-weighting variants: Monte Carlo unbiasedness for every layer (rw, rwp), det_scale's norm, det_lastfix's exact last layer."
import math

import pytest
import torch

from capskip.policies import CAPSkip, create_policy
from capskip.reweight import rwp_mean_prob, rwp_multipliers, rwp_tau, rw_multipliers
from capskip.selector import last_layer_grad, residuals
from test_policies_helpers import (BATCH, autograd_grads, digits, find_head, grad_errors, head_names, model_grads,
                                   pretrained_mlp)

DRAWS = 400


def monte_carlo(reweight: str, mode: str = 'masked', draws: int = DRAWS, **kw):
    "Per-parameter mean and standard error of the step's gradient over many draws on one batch; plus dense and drop-only."
    X, Y, _, _ = digits()
    x, y = X[:BATCH], Y[:BATCH]
    model = pretrained_mlp()
    skip = CAPSkip(model, budget=1.0, mode=mode, reweight=reweight, seed=11, **kw)
    samples = []
    for _ in range(draws):
        model.zero_grad(set_to_none=True)
        s = skip.step(x, y)
        samples.append([g.flatten() for g in model_grads(model).values()])
    stacked = [torch.stack([smp[k] for smp in samples]).double() for k in range(len(samples[0]))]
    mean = [t.mean(0) for t in stacked]
    se = [t.std(0) / math.sqrt(draws) for t in stacked]
    dense = [g.flatten().double() for g in autograd_grads(model, x, y, torch.ones(BATCH)).values()]
    drop_only = [g.flatten().double() for g in autograd_grads(model, x, y, (~s.drop).float()).values()]
    return mean, se, dense, drop_only, s


def max_z(mean, se, target):
    "Largest |mean − target| / SE over all coordinates of all parameters (coordinates with SE = 0 must match exactly)."
    out = 0.0
    for m, e, t in zip(mean, se, target):
        fixed = e == 0
        assert torch.allclose(m[fixed], t[fixed], rtol=1e-5, atol=1e-8)
        if (~fixed).any(): out = max(out, ((m - t).abs()[~fixed] / e[~fixed]).max().item())
    return out


@pytest.mark.parametrize('mode', ['masked', 'reuse'])
@pytest.mark.parametrize('reweight,kw', [('rw', {'p': 0.3}), ('rwp', {'p_bar': 0.3, 'p_min': 0.1})])
def test_rw_rwp_unbiased_for_every_layer(reweight, kw, mode):
    """E[gradient] = dense gradient for every parameter: each coordinate's Monte Carlo mean lies within 5 standard
    errors of the dense value (400 draws; a false alarm has probability < 1e-6 per coordinate), while the
    drop-only gradient lies far outside that band, so the test has the power to fail."""
    mean, se, dense, drop_only, s = monte_carlo(reweight, mode=mode, **kw)
    assert s.drop.sum() >= 20                              # a large dropped set: the re-weighting matters
    assert max_z(mean, se, dense) < 5.0
    assert max_z(mean, se, drop_only) > 20.0
    for m, d in zip(mean, dense):                          # and per layer in relative L2
        assert (m - d).norm() / d.norm() < 0.1


def test_rw_and_rwp_weights():
    X, Y, _, _ = digits()
    x, y = X[:BATCH], Y[:BATCH]
    for reweight, bound in (('rw', 1 / 0.25), ('rwp', 1 / 0.1)):
        skip = CAPSkip(pretrained_mlp(), budget=1.0, mode='masked', reweight=reweight, p=0.25, p_bar=0.3, p_min=0.1)
        for _ in range(20):
            s = skip.step(x, y)
            assert torch.equal(s.applied[~s.drop], torch.ones(int((~s.drop).sum())))      # rows off S untouched
            assert s.applied.max() <= bound * (1 + 1e-6)
            if reweight == 'rw': assert set(s.applied[s.drop].tolist()) <= {0.0, 4.0}


def test_rwp_tau_against_float64_bisection():
    "The device grid bisection hits the target mean within 1e-4 and never below it (a float64 200-step bisection agrees)."
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(1, 80, (1,), generator=g))
        norms = torch.rand(n, generator=g) ** 4 * 3
        in_set = torch.rand(n, generator=g) < 0.7
        if not in_set.any(): continue
        p_bar = 0.1 + 0.9 * torch.rand((), generator=g).item()
        tau = rwp_tau(norms, in_set, p_bar, 0.1)
        achieved = rwp_mean_prob(norms.double(), in_set, tau.double()[None], 0.1).item()
        lo, hi = 0.0, norms[in_set].max().item() / 0.1
        f = lambda t: rwp_mean_prob(norms.double(), in_set, torch.tensor([t], dtype=torch.float64), 0.1).item()
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) >= p_bar else (lo, mid)
        best = f(lo)
        assert achieved >= p_bar - 1e-6 and achieved - best < 1e-4
    with pytest.raises(ValueError, match='p_min'): rwp_tau(norms, in_set, 0.05, 0.1)
    with pytest.raises(ValueError, match=r'p must lie in \(0, 1\]'): rw_multipliers(in_set, 1.5, generator=torch.Generator())


def test_det_scale_restores_last_layer_norm():
    X, Y, _, _ = digits()
    x, y = X[:BATCH], Y[:BATCH]
    model = pretrained_mlp()
    s = CAPSkip(model, budget=0.3, mode='masked', reweight='det_scale').step(x, y)
    head = find_head(model)
    dense = [g for n, g in autograd_grads(model, x, y, torch.ones(BATCH)).items() if n in head_names(model)]
    got = torch.cat([head.weight.grad.flatten(), head.bias.grad.flatten()])
    want = torch.cat([t.flatten() for t in dense])
    assert s.drop.any() and abs(got.norm() / want.norm() - 1) < 1e-5
    factor = s.applied[~s.drop].unique()
    assert len(factor) == 1 and 1 / (1 + 0.3) - 1e-5 <= factor.item() <= 1 / (1 - 0.3) + 1e-5
    # every layer gets the selected gradient times the factor
    ref = autograd_grads(model, x, y, s.applied)
    assert grad_errors(model_grads(model), ref)[0] <= 1e-5


@pytest.mark.parametrize('mode', ['masked', 'reforward', 'reuse'])
def test_det_lastfix_last_layer_dense_deeper_selected(mode):
    X, Y, _, _ = digits()
    x, y = X[:BATCH], Y[:BATCH]
    model = pretrained_mlp()
    s = CAPSkip(model, budget=0.5, mode=mode, reweight='det_lastfix').step(x, y)
    assert s.drop.any() and s.distortion.item() == 0
    got = model_grads(model)
    dense = autograd_grads(model, x, y, torch.ones(BATCH))
    selected = autograd_grads(model, x, y, (~s.drop).float())
    head = head_names(model)
    part = lambda d, in_head: {n: g for n, g in d.items() if (n in head) == in_head}
    assert len(head) == 2 and len(part(got, False)) == 4
    assert grad_errors(part(got, True), part(dense, True))[0] <= 1e-5           # final layer: the dense gradient
    assert grad_errors(part(got, False), part(selected, False))[0] <= 1e-5      # deeper layers: the selected one
    assert grad_errors(part(got, True), part(selected, True))[0] > 1e-3         # and the two differ (the fix did something)
