"""CAPSkip's epoch protocol (warm-up, dense tail, budget ramp) and InfoBatch's final batch: which epochs skip, with what
budget, checked against plain autograd; the counters say so."""
import pytest
import torch

from capskip.policies import create_policy
from capskip.policies.capskip import capskip_epoch_budget, tail_start
from test_policies_helpers import BATCH, autograd_grads, digits, grad_errors, model_grads, pretrained_mlp


@pytest.mark.parametrize('epochs, warmup, tail, ramp', [(16, 3, 0.125, 4), (200, 3, 0.125, 0), (10, 0, 0.0, 5), (4, 1, 0.25, 0)])
def test_epoch_budget_against_its_definition(epochs, warmup, tail, ramp):
    b = 0.5
    for e in range(epochs):
        got = capskip_epoch_budget(e, epochs, b, warmup, tail, ramp)
        dense = e < warmup or (tail > 0 and e >= int((1 - tail) * epochs))        # InfoBatch's cut: int(δ·E)
        if dense: assert got is None, e
        else: assert got == pytest.approx(b * min(1.0, (e - warmup + 1) / ramp) if ramp else b), e
    if tail: assert epochs - tail_start(epochs, tail) == round(tail * epochs)     # 12.5% of 200 = the last 25


@pytest.mark.parametrize('mode', ['masked', 'reforward', 'reuse'])
def test_dense_epochs_give_the_dense_gradient_and_active_ones_skip(mode):
    X, Y, _, _ = digits()
    model = pretrained_mlp()
    pol = create_policy('capskip', model, mode=mode, seed=3, budget=0.5, warmup_epochs=1, tail_fraction=0.25, ramp_epochs=2)
    counters = []
    for epoch in range(4):
        plan = pol.plan_epoch(epoch, 4, 4 * BATCH, BATCH)
        rows = plan.batches[0]
        model.zero_grad(set_to_none=True)
        s = pol.step(X[rows], Y[rows], rows)
        got = model_grads(model)
        keep = (s.applied > 0).float()
        worst, _ = grad_errors(got, autograd_grads(model, X[rows], Y[rows], keep))     # the selected (masked-loss) gradient
        assert worst < 1e-5, (epoch, worst)
        if epoch in (0, 3):                                                         # warm-up and tail: the dense gradient
            assert bool(keep.all())
            assert grad_errors(got, autograd_grads(model, X[rows], Y[rows]))[0] < 1e-5
        for r in plan.batches[1:]: pol.step(X[r], Y[r], r)
        counters.append(pol.counters())
    pol.close()
    assert [c['capskip_active'] for c in counters] == [0.0, 1.0, 1.0, 0.0]
    assert [c['budget'] for c in counters] == [0.0, 0.25, 0.5, 0.0]                # the ramp: b/2, then b
    assert counters[0]['rows_backprop'] == counters[0]['rows_forwarded'] == 4 * BATCH
    assert counters[2]['rows_backprop'] < counters[2]['rows_forwarded']


def test_protocol_is_rechecked_from_the_epoch_after_a_restore(tmp_path):
    model = pretrained_mlp()
    a = create_policy('capskip_rw', model, mode='masked', seed=1, budget=1.0, warmup_epochs=3, tail_fraction=0.125)
    a.plan_epoch(0, 16, 256, BATCH)
    torch.save(a.state_dict(), tmp_path / 'p.pt')
    b = create_policy('capskip_rw', model, mode='masked', seed=1, budget=1.0, warmup_epochs=3, tail_fraction=0.125)
    b.load_state_dict(torch.load(tmp_path / 'p.pt', weights_only=True))
    for e, active in ((2, False), (3, True), (13, True), (14, False)):
        b.plan_epoch(e, 16, 256, BATCH)
        assert (b.rule() is not None) == active, e
    a.close(); b.close()


@pytest.mark.parametrize('bad, message', [({'warmup_epochs': -1}, 'warmup_epochs'), ({'ramp_epochs': 2.5}, 'ramp_epochs'),
                                          ({'tail_fraction': 1.0}, 'tail_fraction'), ({'tail_fraction': True}, 'tail_fraction')])
def test_protocol_options_are_checked(bad, message):
    with pytest.raises(ValueError, match=message):
        create_policy('capskip', pretrained_mlp(), **bad)


@pytest.mark.parametrize('name', ['infobatch', 'infobatch_capskip', 'random_rescale'])
def test_infobatch_keeps_its_final_batch_by_default_and_counts_it(name):
    model = pretrained_mlp()
    kept = create_policy(name, model, mode='masked', seed=0)
    merged = create_policy(name, model, mode='masked', seed=0, final_batch='merge')
    n = 5 * BATCH + 3                                      # equal stored losses in epoch 0: nothing pruned, a 3-row tail
    sizes = [len(b) for b in kept.plan_epoch(0, 4, n, BATCH).batches]
    assert sizes == [BATCH] * 5 + [3] and kept.counters()['final_batch_rows'] == 3
    assert [len(b) for b in merged.plan_epoch(0, 4, n, BATCH).batches] == [BATCH] * 4 + [BATCH + 3]
    kept.close(); merged.close()
