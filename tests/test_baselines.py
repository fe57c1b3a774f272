"Selective-Backprop (percentile keep, pooled steps of exactly B rows, priming) and the random + rescale control."
import copy

import pytest
import torch
from scipy.stats import percentileofscore

from capskip.policies.baselines import LossHistory, percentile_rank, random_rescale_prune, sb_keep_probability
from capskip.policies.infobatch import infobatch_prune
from capskip.policies import create_policy
from test_policies_helpers import BATCH, ENGINE_MODES, autograd_grads, digits, grad_errors, model_grads, pretrained_mlp


def test_percentile_matches_scipy():
    g = torch.Generator().manual_seed(0)
    hist = torch.randint(0, 30, (500,), generator=g).float()
    vals = torch.cat([hist[:100], torch.tensor([-5.0, 100.0, 3.5])])
    ref = torch.tensor([percentileofscore(hist.numpy(), v, kind='rank') / 100 for v in vals.tolist()], dtype=torch.float32)
    assert torch.allclose(percentile_rank(vals, hist), ref, atol=1e-6)
    p = sb_keep_probability(torch.tensor([1.0, 10.0, 29.0]), hist, beta=2.0)
    assert (p.diff() > 0).all() and torch.allclose(p, percentile_rank(torch.tensor([1.0, 10.0, 29.0]), hist) ** 2)


def test_history_ring_buffer():
    h = LossHistory(1024)
    h.add(torch.arange(1000.)); h.add(torch.arange(1000., 1100.))
    assert sorted(h.values().tolist()) == list(range(1100 - 1024, 1100))
    h.add(torch.arange(5000.))
    assert sorted(h.values().tolist()) == list(range(5000 - 1024, 5000))
    with pytest.raises(ValueError, match='history must be'): LossHistory(0)


@pytest.mark.parametrize('mode', ENGINE_MODES)
def test_sb_pooled_gradient_is_sum_over_pooled_rows(mode):
    "At every optimizer step the gradient equals (1/B) Σ over the pooled rows (plain autograd), and exactly B rows were pooled."
    X, Y, _, _ = digits()
    model = pretrained_mlp()
    sb = create_policy('selective_backprop', model, mode=mode, seed=1, prime_epochs=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    plan = sb.plan_epoch(0, 1, len(Y), BATCH)
    ref_sum, pooled, steps = None, 0, 0
    for idx in plan.batches[:-1]:
        frozen = copy.deepcopy(model)                          # parameters during this forward
        s = sb.step(X[idx], Y[idx], idx)
        x, y = sb.last_rows
        ref = autograd_grads(frozen, x, y, s.applied, denominator=BATCH)
        ref_sum = ref if ref_sum is None else {n: ref_sum[n] + ref[n] for n in ref}
        pooled += s.kept
        assert pooled <= BATCH
        if s.should_step:
            assert pooled == BATCH and grad_errors(model_grads(model), ref_sum)[0] <= 1e-5
            opt.step(); opt.zero_grad(); ref_sum, pooled, steps = None, 0, steps + 1
    c = sb.counters()
    assert steps >= 3 and c['optimizer_steps'] == steps and c['rows_reforwarded'] > 0
    assert c['rows_forwarded'] == sum(len(b) for b in plan.batches[:-1]) + c['rows_reforwarded']


def test_sb_priming_and_state(tmp_path):
    X, Y, _, _ = digits()
    sb = create_policy('selective_backprop', pretrained_mlp(), mode='masked', seed=2)
    plan = sb.plan_epoch(0, 3, len(Y), BATCH)
    for idx in plan.batches[:4]:
        s = sb.step(X[idx], Y[idx], idx)
        assert s.should_step and s.kept == len(idx)           # dense priming epoch
    sb.plan_epoch(1, 3, len(Y), BATCH)
    for idx in plan.batches[4:8]: sb.step(X[idx], Y[idx], idx)
    torch.save(sb.state_dict(), tmp_path / 'sb.pt')
    other = create_policy('selective_backprop', pretrained_mlp(), mode='masked', seed=2)
    other.load_state_dict(torch.load(tmp_path / 'sb.pt', weights_only=True))
    other.plan_epoch(1, 3, len(Y), BATCH)
    sb.model.load_state_dict(other.model.state_dict())        # same parameters for the comparison
    idx = plan.batches[9]
    a, b = sb.step(X[idx], Y[idx], idx), other.step(X[idx], Y[idx], idx)
    assert torch.equal(a.applied, b.applied) and a.should_step == b.should_step


def test_random_rescale_matches_infobatch_count_and_is_uniform():
    scores = torch.rand(30_000, generator=torch.Generator().manual_seed(3))
    pr, wr = random_rescale_prune(scores, 0.5, torch.Generator().manual_seed(10))
    pi, wi = infobatch_prune(scores, 0.5, torch.Generator().manual_seed(11))
    n_cand = int((scores < scores.mean()).sum())
    assert int((wr != 1).sum()) == n_cand == int((wi != 1).sum())
    assert set(wr[(wr != 1)].unique().tolist()) == {0.0, 2.0}
    high = scores >= scores.mean()
    assert abs(pr[high].float().mean().item() - pr[~high].float().mean().item()) < 0.02
    assert abs(pr.sum().item() / n_cand - 0.5) < 0.02
