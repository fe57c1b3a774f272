"CAPSkip drop-in class and policy interface: exact gradients per engine mode, step-by-step equality with a masked-loss loop, registry."

import pytest
import torch
import torch.nn.functional as F

import capskip
from capskip.policies import CAPSkip, EpochPlan, Policy, StepStats, create_policy, list_policies
from capskip.selector import residuals, select
from test_policies_helpers import (BATCH, ENGINE_MODES, assert_really_reused, autograd_grads, digits, find_head,
                                   grad_errors, model_grads, pretrained_mlp, tiny_mlp)

CONTRACT_NAMES = ['dense', 'capskip', 'capskip_masked', 'capskip_rw', 'capskip_rwp', 'capskip_det_scale',
                  'capskip_det_lastfix', 'infobatch', 'infobatch_capskip', 'infobatch_capskip_unweighted',
                  'infobatch_capskip_exclude', 'ib_then_capskip', 'ib_plus_capskip_late', 'selective_backprop',
                  'random_rescale']


def reference_drop(model, x, y, budget, weights=None, label_smoothing=0.0):
    "CAPSkip's mask computed independently: a plain forward, the selector on the head's input."
    feats = {}
    hook = find_head(model).register_forward_hook(lambda m, i, o: feats.__setitem__('h', i[0].detach()))
    with torch.no_grad(): logits = model(x)
    hook.remove()
    return select(residuals(logits, y, label_smoothing), feats['h'], logits.argmax(1) == y, budget, weights=weights).drop


@pytest.mark.parametrize('mode', ENGINE_MODES)
@pytest.mark.parametrize('weighted_input', [False, True])
def test_capskip_step_equals_masked_loss(mode, weighted_input):
    X, Y, _, _ = digits()
    model = pretrained_mlp()
    x, y = X[:BATCH], Y[:BATCH]
    w = torch.where(torch.arange(BATCH) % 3 == 0, 2.0, 1.0) if weighted_input else None
    skip = CAPSkip(model, budget=0.2, mode=mode, label_smoothing=0.1)
    s = skip.step(x, y, w)
    drop = reference_drop(model, x, y, 0.2, w, 0.1)
    assert torch.equal(s.drop, drop) and 0 < s.kept < BATCH
    ref = autograd_grads(model, x, y, (torch.ones(BATCH) if w is None else w) * (~drop).float(), 0.1)
    assert grad_errors(model_grads(model), ref)[0] <= 1e-5
    assert s.distortion.item() <= 0.2 * (1 + 1e-5)
    if mode == 'reuse': assert_really_reused(model)
    c = skip.counters()
    assert c['rows_forwarded'] == BATCH and c['rows_backprop'] == s.kept and c['steps'] == 1
    assert skip.counters()['rows_forwarded'] == 0          # read once, then reset


@pytest.mark.parametrize('mode', ['reforward', 'reuse'])
def test_capskip_masked_policy_equals_capskip(mode):
    "capskip_masked gives CAPSkip's gradients, but its backward runs over every row (observed at the first layer)."
    X, Y, _, _ = digits()
    x, y, idx = X[:BATCH], Y[:BATCH], torch.arange(BATCH)
    out = {}
    for name, m in (('capskip_masked', 'reuse'), ('capskip', mode)):
        model = pretrained_mlp()
        rows = []
        if name == 'capskip_masked' or m != 'reuse':   # rows reaching the first layer's output in the backward (a plain tensor hook)
            def count_rows(mod, inputs, out, rows=rows):
                if out.requires_grad: out.register_hook(lambda g: rows.append(g.shape[0]))
            model[1].register_forward_hook(count_rows)
        pol = create_policy(name, model, mode=m, budget=0.2)
        s = pol.step(x, y, idx)
        out[name] = (model_grads(model), s, rows)
    (g_masked, s_masked, rows_masked), (g_cap, s_cap, rows_cap) = out['capskip_masked'], out['capskip']
    assert grad_errors(g_cap, g_masked)[0] <= 1e-5 and s_cap.kept == s_masked.kept < BATCH
    assert rows_masked == [BATCH]                              # full backward
    if mode == 'reforward': assert rows_cap == [s_cap.kept]    # only the kept rows


@pytest.mark.parametrize('mode', ENGINE_MODES)
def test_capskip_end_to_end_matches_masked_loss_loop(mode):
    "A few SGD steps with CAPSkip.step equal, step for step, a plain masked-loss loop with independently computed masks."
    X, Y, _, _ = digits()
    a, b = pretrained_mlp(), pretrained_mlp()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    skip = CAPSkip(a, budget=0.09, mode=mode)
    for i in range(6):
        x, y = X[BATCH * i:BATCH * (i + 1)], Y[BATCH * i:BATCH * (i + 1)]
        s = skip.step(x, y)
        opt_a.step(); opt_a.zero_grad()
        drop = reference_drop(b, x, y, 0.09)
        assert torch.equal(s.drop, drop), i
        (F.cross_entropy(b(x), y, reduction='none') * (~drop).float()).sum().div(BATCH).backward()
        opt_b.step(); opt_b.zero_grad()
        assert grad_errors(dict(a.named_parameters()), dict(b.named_parameters()))[0] <= 1e-5, i
    if mode == 'reuse': assert_really_reused(a)


def test_zero_and_full_keep():
    "k = 0 gives zero gradients; budget 0 is the dense gradient."
    X, Y, _, _ = digits()
    model = pretrained_mlp()
    x, y = X[:BATCH], Y[:BATCH]
    CAPSkip(model, budget=0.0, mode='masked').step(x, y)
    assert grad_errors(model_grads(model), autograd_grads(model, x, y, torch.ones(BATCH)))[0] <= 1e-5
    model.zero_grad(set_to_none=True)
    s = CAPSkip(model, budget=0.5, mode='masked').step(x, y, torch.zeros(BATCH))
    assert s.kept == 0 and all(g.abs().max() == 0 for g in model_grads(model).values())


def test_registry_and_errors():
    assert list_policies() == CONTRACT_NAMES
    model = tiny_mlp()
    for name in CONTRACT_NAMES:
        pol = create_policy(name, model, mode='masked', seed=3)
        assert isinstance(pol, Policy) and pol.name == name
        pol.close()
    assert capskip.CAPSkip is CAPSkip and capskip.create_policy is create_policy
    with pytest.raises(ValueError, match='unknown policy'): create_policy('capskp', model)
    with pytest.raises(TypeError, match='unknown hyper-parameter'): create_policy('capskip', model, budgt=0.1)
    with pytest.raises(ValueError, match='fixes reweight'): create_policy('capskip_rw', model, reweight='rwp')
    with pytest.raises(ValueError, match='budget must be'): CAPSkip(model, budget=-0.1)
    with pytest.raises(ValueError, match='reweight must be'): CAPSkip(model, reweight='rx')
    with pytest.raises(ValueError, match='mode must be one of'): CAPSkip(model, mode='fast')
    pol = create_policy('capskip', model, mode='masked')
    with pytest.raises(ValueError, match='0 <= epoch < num_epochs'): pol.plan_epoch(5, 5, 100, 10)
    with pytest.raises(ValueError, match='weights must be'): pol.step(torch.zeros(4, 64), torch.zeros(4, dtype=torch.long), None, torch.ones(3))
    with pytest.raises(ValueError, match='rank < world_size'): create_policy('dense', model, rank=2, world_size=2)


def test_dense_plan_seeded_and_sharded():
    model = tiny_mlp()
    plans = {s: create_policy('dense', model, seed=s).plan_epoch(0, 3, 1000, 64) for s in (0, 1)}
    again = create_policy('dense', model, seed=0).plan_epoch(0, 3, 1000, 64)
    assert all(torch.equal(a, b) for a, b in zip(plans[0].batches, again.batches))
    assert not torch.equal(plans[0].batches[0], plans[1].batches[0])
    assert sorted(torch.cat(plans[0].batches).tolist()) == list(range(1000))
    assert [len(b) for b in plans[0].batches][-1] == 1000 % 64      # dense keeps its final batch
    shards = [create_policy('dense', model, seed=0, rank=r, world_size=3).plan_epoch(0, 3, 1000, 64) for r in range(3)]
    sizes = [sum(len(b) for b in p.batches) for p in shards]
    assert len(set(sizes)) == 1 and set(torch.cat([torch.cat(p.batches) for p in shards]).tolist()) == set(range(1000))


def test_state_dict_roundtrip_weights_only(tmp_path):
    "Policy state goes through torch.save / torch.load(weights_only=True); rw draws continue identically."
    X, Y, _, _ = digits()
    x, y = X[:BATCH], Y[:BATCH]
    make = lambda: create_policy('capskip_rw', pretrained_mlp(), mode='masked', budget=1.0, seed=5)
    a = make()
    a.step(x, y, torch.arange(BATCH))
    torch.save(a.state_dict(), tmp_path / 'p.pt')
    b, fresh = make(), make()
    b.load_state_dict(torch.load(tmp_path / 'p.pt', weights_only=True))
    sa, sb, sf = (p.step(x, y, torch.arange(BATCH)) for p in (a, b, fresh))
    assert sa.drop.sum() >= 20 and torch.equal(sa.drop, sb.drop)
    assert torch.equal(sa.applied, sb.applied)
    assert not torch.equal(sa.applied, sf.applied)          # without the restore the draws differ: the test has power
    assert isinstance(sa, StepStats) and isinstance(a.plan_epoch(0, 1, 10, 4), EpochPlan)


@pytest.mark.parametrize('mode', ['masked', 'reuse'])
def test_bf16_autocast(mode):
    "Under bf16 autocast the selector runs in fp32 on the same forward's outputs; gradients match a masked-loss autocast step."
    X, Y, _, _ = digits()
    model = pretrained_mlp()
    x, y = X[:BATCH], Y[:BATCH]
    with torch.autocast('cpu', dtype=torch.bfloat16):
        s = CAPSkip(model, budget=0.2, mode=mode).step(x, y)
        ref = autograd_grads(model, x, y, (~s.drop).float())
    assert 0 < s.kept < BATCH and s.distortion.dtype == torch.float32 and s.distortion.item() <= 0.2 * (1 + 1e-3)
    assert grad_errors(model_grads(model), ref)[0] <= 2e-2
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        assert s.correct.item() == (model(x).argmax(1) == y).sum().item()


def test_capskip_state_dict_round_trips_before_the_next_step():
    "A state taken between load_state_dict and the next step (a checkpoint of a checkpoint) continues the draws exactly."
    X, Y, _, _ = digits()
    model, x, y = pretrained_mlp(), X[:BATCH], Y[:BATCH]
    make = lambda seed: CAPSkip(model, budget=1.0, mode='masked', reweight='rw', seed=seed)
    uninterrupted = make(3)
    uninterrupted.step(x, y)
    restored = make(0)
    restored.load_state_dict(uninterrupted.state_dict())
    again = make(0)
    again.load_state_dict(restored.state_dict())            # restored has not stepped since its load
    ref = [uninterrupted.step(x, y) for _ in range(3)]
    got = [again.step(x, y) for _ in range(3)]
    assert all(r.drop.sum() >= 10 for r in ref)
    assert all(torch.equal(r.drop, g.drop) and torch.equal(r.applied, g.applied) for r, g in zip(ref, got))
    fresh = [make(3).step(x, y)]                             # same seed, not restored: other draws
    assert not torch.equal(fresh[0].applied, ref[0].applied)


RANDOM_POLICIES = ['capskip_rw', 'capskip_rwp', 'infobatch', 'infobatch_capskip', 'random_rescale', 'selective_backprop']


def _run_epochs(pol, X, Y, epochs, start, steps_per_epoch=4):
    "Plans and step draws of epochs start..epochs-1 (no optimizer step, so the parameters stay fixed)."
    out = []
    for epoch in range(start, epochs):
        plan = pol.plan_epoch(epoch, epochs, len(Y), BATCH)
        out.append((plan.pruned, [b.clone() for b in plan.batches], plan.weights.clone()))
        for idx in plan.batches[:steps_per_epoch]:
            s = pol.step(X[idx], Y[idx], idx, plan.weights[idx])
            out.append((s.kept, s.should_step, s.applied.cpu().clone(), s.drop.cpu().clone()))
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor): return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)): return type(a) is type(b) and len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a == b


@pytest.mark.parametrize('name', RANDOM_POLICIES)
def test_restored_policy_draws_what_the_uninterrupted_one_draws(name, tmp_path):
    "After load_state_dict (through torch.save / weights_only=True) the next plans and per-step draws equal the uninterrupted run's."
    X, Y, _, _ = digits()
    make = lambda: create_policy(name, pretrained_mlp(), mode='masked', seed=7, budget=1.0) if name.startswith('capskip') \
        else create_policy(name, pretrained_mlp(), mode='masked', seed=7)
    uninterrupted = make()
    _run_epochs(uninterrupted, X, Y, 2, 0)                   # epoch 0, then checkpoint
    torch.save(uninterrupted.state_dict(), tmp_path / 'state.pt')
    restored, fresh = make(), make()
    restored.load_state_dict(torch.load(tmp_path / 'state.pt', weights_only=True))
    ref = _run_epochs(uninterrupted, X, Y, 3, 1)
    assert _same(_run_epochs(restored, X, Y, 3, 1), ref)
    assert not _same(_run_epochs(fresh, X, Y, 3, 1), ref)   # without the restore they differ: the test has power


@pytest.mark.parametrize('mode', ['masked', 'reforward'])
@pytest.mark.parametrize('name', ['dense', 'capskip', 'capskip_det_lastfix', 'infobatch_capskip', 'selective_backprop'])
def test_one_softmax_per_step(name, mode):
    "A step runs one softmax (the residuals, for the rule and the backward) and one log-softmax (the per-row losses)."
    from collections import Counter
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self): super().__init__(); self.ops = Counter()
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    X, Y, _, _ = digits()
    pol = create_policy(name, pretrained_mlp(), mode=mode, seed=0, **({'prime_epochs': 0} if name == 'selective_backprop' else {}))
    plan = pol.plan_epoch(0, 2, len(Y), BATCH)
    idx = plan.batches[0]
    pol.step(X[idx], Y[idx], idx, plan.weights[idx])          # warm-up (reforward's row-independence probe)
    idx = plan.batches[1]
    with CountOps() as counted: pol.step(X[idx], Y[idx], idx, plan.weights[idx])
    assert {op: n for op, n in counted.ops.items() if 'softmax' in op} == {'_softmax': 1, '_log_softmax': 1}


@pytest.mark.parametrize('mode', ENGINE_MODES)
def test_capskip_step_with_soft_targets_equals_the_soft_masked_loss(mode):
    "Mixup-style targets [B, C]: candidates are rows whose top class is the target's; the gradient is autograd of the soft CE over kept rows."
    from capskip.core import target_classes
    X, Y, _, _ = digits()
    model = pretrained_mlp()
    x, y = X[:BATCH], Y[:BATCH]
    g = torch.Generator().manual_seed(0)
    lam = 0.7 + 0.3 * torch.rand(BATCH, 1, generator=g)                 # the image's own class stays dominant
    y_soft = lam * F.one_hot(y, 10).float() + (1 - lam) * F.one_hot(y[torch.randperm(BATCH, generator=g)], 10).float()
    skip = CAPSkip(model, budget=0.2, mode=mode, label_smoothing=0.1)
    s = skip.step(x, y_soft)
    feats = {}
    hook = find_head(model).register_forward_hook(lambda m, i, o: feats.__setitem__('h', i[0].detach()))
    with torch.no_grad(): logits = model(x)
    hook.remove()
    drop = select(residuals(logits, y_soft, 0.1), feats['h'], logits.argmax(1) == target_classes(y_soft), 0.2).drop
    assert torch.equal(s.drop, drop) and 0 < s.kept < BATCH
    ref = autograd_grads(model, x, y_soft, (~drop).float(), 0.1)
    assert grad_errors(model_grads(model), ref)[0] <= 1e-5
    with pytest.raises(ValueError, match=r'\[B, C\] class probabilities'): skip.step(x, y_soft[:, None])
