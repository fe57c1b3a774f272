"InfoBatch: seeded pruning, DistributedSampler shards, the tiny-final-batch guard, stored losses, tail, composites."
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from capskip.policies.infobatch import InfoBatchSampler, epoch_rows, infobatch_prune
from capskip.policies import CAPSkip, create_policy
from test_policies_helpers import BATCH, digits, pretrained_mlp, tiny_mlp


def random_scores(n=3000, seed=0):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def test_seeds_differ_and_reproduce():
    scores = random_scores()
    runs = {seed: [epoch_rows(scores, e, 20, seed) for e in range(3)] for seed in (17, 29, 43)}
    for seed, plans in runs.items():
        again = [epoch_rows(scores, e, 20, seed) for e in range(3)]
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(plans, again))
        assert not torch.equal(plans[0][1], plans[1][1])            # a new draw every epoch
    pruned_sets = [set((runs[s][0][1] == 0).nonzero().squeeze(1).tolist()) for s in runs]
    assert pruned_sets[0] != pruned_sets[1] != pruned_sets[2] != pruned_sets[0]
    # the same holds through the policy interface
    model = tiny_mlp()
    plans = [create_policy('infobatch', model, mode='masked', seed=s) for s in (1, 1, 2)]
    for p in plans: p.scores = scores.clone()
    out = [p.plan_epoch(1, 10, len(scores), 64) for p in plans]
    assert torch.equal(out[0].weights, out[1].weights) and not torch.equal(out[0].weights, out[2].weights)
    assert all(torch.equal(a, b) for a, b in zip(out[0].batches, out[1].batches))


def test_prune_rule_statistics():
    scores = random_scores(20_000)
    below = scores < scores.mean()
    pruned, w = infobatch_prune(scores, 0.5, torch.Generator().manual_seed(123))  # not the scores' seed
    assert not pruned[~below].any()
    assert abs(pruned[below].float().mean().item() - 0.5) < 0.02
    assert set(w[below & ~pruned].unique().tolist()) == {2.0} and set(w[~below].unique().tolist()) == {1.0}
    assert abs(w[below].mean().item() - 1.0) < 0.04            # expected weight of a prunable row is 1
    assert (w[pruned] == 0).all()
    pruned3, w3 = infobatch_prune(scores, 0.3, torch.Generator().manual_seed(124))
    assert torch.allclose(w3[below & ~pruned3], torch.tensor(1 / 0.7))


@pytest.mark.parametrize('world_size', [2, 3, 4])
def test_shards_equal_across_ranks(world_size):
    samplers = [InfoBatchSampler(1001, 32, 10, seed=5, rank=r, world_size=world_size) for r in range(world_size)]
    for s in samplers:
        s.update(torch.arange(1001), random_scores(1001)); s.set_epoch(2)
    rows = [torch.tensor([i for b in s for i in b]) for s in samplers]
    assert len({len(r) for r in rows}) == 1
    assert all(torch.equal(samplers[0].weights, s.weights) for s in samplers)
    survivors = set((samplers[0].weights > 0).nonzero().squeeze(1).tolist())
    assert set(torch.cat(rows).tolist()) == survivors
    assert sum(len(r) for r in rows) - len(survivors) < world_size  # padding only to the next multiple


@pytest.mark.parametrize('guard', ['merge', 'drop', 'keep'])
def test_tiny_final_batch_guard(guard):
    s = InfoBatchSampler(64 * 5 + 3, 64, 4, seed=0, final_batch=guard)   # equal stored losses: nothing pruned
    sizes = [len(b) for b in s]
    assert s.plan.pruned == 0
    if guard == 'merge': assert sizes == [64] * 4 + [67] and s.plan.info['tiny_batches_merged'] == 1
    if guard == 'drop': assert sizes == [64] * 5 and s.plan.info['rows_dropped_tiny_batch'] == 3
    if guard == 'keep': assert sizes == [64] * 5 + [3]
    pol = create_policy('infobatch', tiny_mlp(), mode='masked')     # the policy keeps it by default, as the paper's runs
    pol.plan_epoch(0, 4, 64 * 5 + 3, 64)
    c = pol.counters()
    assert c['tiny_batches_merged'] == 0 and c['final_batch_rows'] == 3
    pol = create_policy('infobatch', tiny_mlp(), mode='masked', final_batch='merge')   # our guard, an option
    pol.plan_epoch(0, 4, 64 * 5 + 3, 64)
    assert pol.counters()['tiny_batches_merged'] == 1


def test_sampler_in_a_dataloader_and_tail():
    X, Y = torch.randn(300, 4), torch.randint(0, 3, (300,))
    data = TensorDataset(X, Y, torch.arange(300))
    s = InfoBatchSampler(300, 32, 8, seed=1)
    s.update(torch.arange(300), torch.linspace(0, 1, 300))
    for epoch in range(8):
        s.set_epoch(epoch)
        seen = torch.cat([idx for _, _, idx in DataLoader(data, batch_sampler=s)])
        assert sorted(seen.tolist()) == sorted((s.weights > 0).nonzero().squeeze(1).tolist())
        if epoch >= 7: assert len(seen) == 300 and (s.weights == 1).all()    # int(0.875·8) = 7: tail
        elif epoch >= 1: assert 0 < s.plan.pruned and len(seen) == 300 - s.plan.pruned
        assert torch.equal(s.weights_for(seen), s.weights[seen])
    with pytest.raises(ValueError, match='ratio must be'): InfoBatchSampler(10, 2, 2, ratio=1.0)


def test_policy_stores_losses_and_state_roundtrip(tmp_path):
    X, Y, _, _ = digits()
    pol = create_policy('infobatch', pretrained_mlp(), mode='masked', seed=3)
    plan = pol.plan_epoch(0, 4, len(Y), BATCH)
    idx = plan.batches[0]
    s = pol.step(X[idx], Y[idx], idx, plan.weights[idx])
    assert torch.allclose(pol.scores[idx], s.losses) and (pol.scores[plan.batches[1]] == 1).all()
    torch.save(pol.state_dict(), tmp_path / 'ib.pt')
    other = create_policy('infobatch', pretrained_mlp(), mode='masked', seed=3)
    other.load_state_dict(torch.load(tmp_path / 'ib.pt', weights_only=True))
    a, b = pol.plan_epoch(1, 4, len(Y), BATCH), other.plan_epoch(1, 4, len(Y), BATCH)
    assert torch.equal(a.weights, b.weights) and all(torch.equal(u, v) for u, v in zip(a.batches, b.batches))


def test_weighted_composite_keeps_bound_unweighted_breaks_it():
    "On real batches with InfoBatch weights: weighted CAPSkip's realised weighted distortion ≤ b at every step, unweighted's is not."
    X, Y, _, _ = digits()
    model = pretrained_mlp()
    worst = {}
    for weighted in (True, False):
        skip = CAPSkip(model, budget=0.09, mode='masked', weighted=weighted)
        d = []
        for i in range(len(Y) // BATCH):
            x, y = X[BATCH * i:BATCH * (i + 1)], Y[BATCH * i:BATCH * (i + 1)]
            with torch.no_grad(): loss = torch.nn.functional.cross_entropy(model(x), y, reduction='none')
            d.append(skip.step(x, y, torch.where(loss < loss.mean(), 2.0, 1.0)).distortion.item())
            model.zero_grad()
        worst[weighted] = max(d)
        skip.engine.close()
    assert worst[True] <= 0.09 * (1 + 1e-5)
    assert worst[False] > 0.09 * 1.2


def test_exclude_variant_never_drops_upweighted_rows():
    X, Y, _, _ = digits()
    model = pretrained_mlp()
    skip = CAPSkip(model, budget=0.5, mode='masked', exclude_upweighted=True)
    for i in range(5):
        x, y = X[BATCH * i:BATCH * (i + 1)], Y[BATCH * i:BATCH * (i + 1)]
        w = torch.where(torch.arange(BATCH) % 2 == 0, 2.0, 1.0)
        s = skip.step(x, y, w)
        assert s.drop.any() and not s.drop[w > 1].any() and (s.applied[w > 1] == 2).all()


def test_step_errors_before_any_work():
    X, Y, _, _ = digits()
    model = pretrained_mlp()
    pol = create_policy('infobatch_capskip', model, mode='masked')
    with pytest.raises(RuntimeError, match='call plan_epoch'): pol.step(X[:8], Y[:8], torch.arange(8))
    pol.plan_epoch(0, 2, len(Y), 8)
    with pytest.raises(ValueError, match='row indices'): pol.step(X[:8], Y[:8])
    assert all(p.grad is None for p in model.parameters())       # nothing was back-propagated


def test_dataset_wrapper_in_worker_processes_sees_each_epochs_weights():
    "The weights live in shared memory and are updated in place: persistent DataLoader workers see every epoch's plan."
    from capskip.policies.infobatch import InfoBatchDataset
    X, Y = torch.randn(200, 3), torch.randint(0, 2, (200,))
    s = InfoBatchSampler(200, 16, 6, seed=4)
    s.update(torch.arange(200), torch.linspace(0, 1, 200))
    loader = DataLoader(InfoBatchDataset(TensorDataset(X, Y, torch.arange(200)), s), batch_sampler=s,
                        num_workers=1, persistent_workers=True)
    for epoch in (0, 1, 2):
        s.set_epoch(epoch)
        rows = [(idx, w) for _, _, idx, w in loader]
        idx, w = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        assert torch.equal(w, s.weights[idx]) and (epoch == 0 or (w == 2).any())
    with pytest.raises(ValueError, match='rows'): InfoBatchDataset(TensorDataset(X[:5]), s)
