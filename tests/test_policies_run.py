"Every policy, selected by name, trains the tiny MLP on the digits data for ~200 steps; counters and guarantees are checked."
import math

import pytest
import torch

from capskip.policies import create_policy, list_policies
from test_policies_helpers import BATCH, assert_really_reused, digits, tiny_mlp

EPOCHS, BUDGET = 16, 0.09
RUN_MODES = ['reforward', 'reuse']   # every policy in the target mode ('reuse') and in an independent one


def train(name: str, mode: str):
    "Train with the runner protocol; return per-epoch counters, per-step records, plans and test accuracy."
    X, Y, Xte, Yte = digits()
    model = tiny_mlp(1)
    pol = create_policy(name, model, mode=mode, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    epochs, steps, plans = [], [], []
    for epoch in range(EPOCHS):
        plan = pol.plan_epoch(epoch, EPOCHS, len(Y), BATCH)
        plans.append(plan)
        rec = []
        for idx in plan.batches:
            w = plan.weights[idx]
            s = pol.step(X[idx], Y[idx], idx, w)
            rec.append(dict(w=w, applied=s.applied.cpu(), drop=s.drop.cpu(), kept=s.kept, forwarded=s.forwarded,
                            distortion=s.distortion.item(), should_step=s.should_step, rows=len(idx)))
            if s.should_step:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step(); opt.zero_grad()
        steps.append(rec)
        epochs.append(pol.counters())
    with torch.no_grad(): acc = (model(Xte).argmax(1) == Yte).float().mean().item()
    if mode == 'reuse' and name not in ('dense', 'capskip_masked'): assert_really_reused(model)   # those two never reuse
    pol.close()
    return epochs, steps, plans, acc


def check_common(name, epochs, steps, plans, acc):
    assert sum(len(r) for r in steps) >= 200, 'a few hundred steps'
    for c, rec, plan in zip(epochs, steps, plans):
        assert c['rows_forwarded'] == sum(r['rows'] for r in rec) + c.get('rows_reforwarded', 0)
        assert c['rows_forwarded'] == sum(r['forwarded'] for r in rec)
        assert c['rows_backprop'] == sum(r['kept'] for r in rec) == sum(int((r['applied'] > 0).sum()) for r in rec)
        assert math.isclose(c['kept_fraction'], c['rows_backprop'] / c['rows_forwarded'])
        assert c['rows_pruned'] == plan.pruned and math.isfinite(c['loss_sum']) and c['steps'] == len(rec)
        assert math.isclose(c['mean_distortion'], sum(r['distortion'] for r in rec) / len(rec), rel_tol=1e-5, abs_tol=1e-7)
    first, last = epochs[0], epochs[-1]
    assert last['loss_sum'] / last['rows_forwarded'] < 0.5 * first['loss_sum'] / first['rows_forwarded'], 'it learns'
    assert acc > 0.8, f'{name}: test accuracy {acc:.3f}'


def pruning_epochs(plans):
    return [p.pruned > 0 for p in plans]


IB_ACTIVE = [False] + [True] * (int(0.875 * EPOCHS) - 1) + [False] * (EPOCHS - int(0.875 * EPOCHS))
HALF = EPOCHS // 2


@pytest.mark.parametrize('mode', RUN_MODES)
@pytest.mark.parametrize('name', list_policies())
def test_policy_runs_with_counters_and_guarantees(name, mode):
    epochs, steps, plans, acc = train(name, mode)
    check_common(name, epochs, steps, plans, acc)
    flat = [r for rec in steps for r in rec]
    kept = [c['kept_fraction'] for c in epochs]
    within_budget = all(r['distortion'] <= BUDGET * (1 + 1e-5) + 1e-6 for r in flat)
    if name == 'dense':
        assert kept == [1.0] * EPOCHS and all(r['distortion'] == 0 for r in flat) and not any(pruning_epochs(plans))
    elif name in ('capskip', 'capskip_masked'):
        assert within_budget and min(kept) < 0.8
        assert all(set(r['applied'].unique().tolist()) <= {0.0, 1.0} for r in flat)
    elif name in ('capskip_rw', 'capskip_rwp'):
        bound = 1 / 0.5 if name == 'capskip_rw' else 1 / 0.1
        assert all(torch.equal(r['applied'][~r['drop']], torch.ones(int((~r['drop']).sum()))) for r in flat)
        assert all(r['applied'].max() <= bound * (1 + 1e-6) for r in flat)
        assert any(((r['applied'] > 1) & r['drop']).any() for r in flat) and min(kept) < 0.95
        if name == 'capskip_rw': assert all(set(r['applied'][r['drop']].tolist()) <= {0.0, 2.0} for r in flat)
    elif name == 'capskip_det_scale':
        for r in flat:
            factors = r['applied'][~r['drop']].unique()
            assert len(factors) == 1 and 1 / (1 + BUDGET) - 1e-4 <= factors.item() <= 1 / (1 - BUDGET) + 1e-4
        assert min(kept) < 0.8
    elif name == 'capskip_det_lastfix':
        assert all(r['distortion'] == 0 for r in flat) and min(kept) < 0.8
    elif name in ('infobatch', 'random_rescale'):
        assert pruning_epochs(plans) == IB_ACTIVE and kept == [1.0] * EPOCHS
        assert all(set(r['w'].unique().tolist()) <= {1.0, 2.0} for r in flat)
        assert any((r['w'] == 2).any() for r in flat)
    elif name == 'infobatch_capskip':
        assert pruning_epochs(plans) == IB_ACTIVE and within_budget and min(kept) < 0.8
    elif name == 'infobatch_capskip_unweighted':
        assert pruning_epochs(plans) == IB_ACTIVE and min(kept) < 0.8
    elif name == 'infobatch_capskip_exclude':
        assert pruning_epochs(plans) == IB_ACTIVE and within_budget and min(kept) < 0.9
        assert not any((r['drop'] & (r['w'] > 1)).any() for r in flat)
    elif name == 'ib_then_capskip':
        assert pruning_epochs(plans) == IB_ACTIVE[:HALF] + [False] * (EPOCHS - HALF)
        assert kept[:HALF] == [1.0] * HALF and max(kept[HALF:]) < 1.0 and within_budget
    elif name == 'ib_plus_capskip_late':
        assert pruning_epochs(plans) == IB_ACTIVE
        assert kept[:HALF] == [1.0] * HALF and max(kept[HALF:]) < 1.0 and within_budget
    elif name == 'selective_backprop':
        assert kept[0] == 1.0 and epochs[0]['optimizer_steps'] == len(steps[0]) and max(kept[1:]) < 0.6
        pooled = 0
        for r in [r for rec in steps[1:] for r in rec]:
            pooled += r['kept']
            if r['should_step']: assert pooled == BATCH; pooled = 0
    else:
        raise AssertionError(f'no checks written for policy {name!r}')
