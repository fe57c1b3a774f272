"""The accelerate recipe (issue 21, item 2) against the real `accelerate` package: `accelerator.backward(skip.loss(skip(x), y))`
inside `accelerator.accumulate(model)` gives plain autograd's gradient of the kept rows — in fp32, under
`mixed_precision="bf16"`, and on two gloo processes (`MULTI_CPU`, the CAPSkip built on the model `prepare` returned) —
while `reuse` really skips rows (kept < batch, a traced graph cached, no fallback warning)."""
import copy
import textwrap

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState

import capskip
from capskip.engine.check import grad_errors, model_grads
from capskip.engine.reuse import cached_traces
from capskip.integrations.accelerate import step_metrics
from capskip.testing import digits_tensors, trained_digits_mlp

from test_ddp import rank_results

pytestmark = pytest.mark.filterwarnings('error::RuntimeWarning')       # reuse's fallback to a full backward warns


@pytest.fixture(scope='module')
def digits():
    X, Y, _, _ = digits_tensors()
    return trained_digits_mlp(), X[:64], Y[:64]


def run(base, x, y, mixed_precision='no', **options):
    "One optimizer step of the recipe over two accumulated micro-batches of 32; (gradient at the step, micro-batches, model, metrics)."
    AcceleratorState._reset_state(reset_partial_state=True)   # accelerate's state is a process singleton (its own tests reset it)
    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision=mixed_precision, cpu=True)
    model = copy.deepcopy(base)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    skip = capskip.CAPSkip(model, **options)
    seen, metrics = [], []
    for xb, yb in data:
        with accelerator.accumulate(model):
            accelerator.backward(skip.loss(skip(xb), yb))
            seen.append((xb, yb, skip.last.applied))
            metrics.append(step_metrics(skip))
            if accelerator.sync_gradients: grads = model_grads(model)
            optimizer.step(); optimizer.zero_grad()
    AcceleratorState._reset_state(reset_partial_state=True)
    return grads, seen, model, metrics


def reference(base, seen, denominator, autocast=False):
    twin = copy.deepcopy(base)
    for x, y, applied in seen:
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
            logits = twin(x)
        (F.cross_entropy(logits.float(), y, reduction='none') * applied).sum().div(denominator).backward()
    return model_grads(twin)


def assert_really_skipped(model, seen, batch):
    kept = [int((applied > 0).sum()) for _, _, applied in seen]
    assert all(0 < k < batch for k in kept), kept
    assert [type(t).__name__ for t in cached_traces(model)] == ['Traced']


def test_accumulated_step_is_autograd_of_the_kept_rows(digits):
    base, x, y = digits
    grads, seen, model, metrics = run(base, x, y)
    assert len(seen) == 2
    worst, overall = grad_errors(grads, reference(base, seen, 2 * 32))      # accelerator.backward divides each by 2
    assert worst <= 1e-5 and overall <= 1e-5, (worst, overall)
    assert_really_skipped(model, seen, 32)
    for m, (_, _, applied) in zip(metrics, seen):
        assert m['capskip/kept_fraction'] == pytest.approx(int((applied > 0).sum()) / 32)
        assert 0 < m['capskip/distortion'] <= capskip.DEFAULT_BUDGET + 1e-6 and m['capskip/loss'] > 0
        assert m['capskip/all_rows_fraction'] == 0.0                       # reuse ran the kept rows alone


def test_a_step_whose_backward_ran_every_row_is_in_the_metrics(digits):
    "Dropout in `reforward`: each backward ran every row to replay the masks (exact, nothing saved); `step_metrics` after the backward says so (before: the kept fraction alone; stop 54)."
    base, x, y = digits
    model = torch.nn.Sequential(*base[:-1], torch.nn.Dropout(0.1), base[-1])
    with pytest.warns(RuntimeWarning, match='draws random numbers'):
        _, seen, _, metrics = run(model, x, y, mode='reforward')
    assert all(0 < int((a > 0).sum()) < 32 for _, _, a in seen)
    assert [m['capskip/all_rows_fraction'] for m in metrics] == [1.0, 1.0] and all(m['capskip/kept_fraction'] < 1 for m in metrics)


def test_bf16_mixed_precision(digits):
    base, x, y = digits
    grads, seen, model, _ = run(base, x, y, mixed_precision='bf16')
    worst, overall = grad_errors(grads, reference(base, seen, 2 * 32, autocast=True))
    assert worst <= 1e-3 and overall <= 1e-3, (worst, overall)              # bf16 forward on both sides (0.0 measured)
    assert grad_errors(grads, reference(base, seen, 2 * 32))[1] > 3e-3, 'autocast was not in effect'
    assert_really_skipped(model, seen, 32)


def test_step_metrics_before_any_step_names_the_fix(digits):
    with pytest.raises(ValueError, match=r'call skip.loss\(skip\(x\), y\)'):
        step_metrics(capskip.CAPSkip(copy.deepcopy(digits[0])))


# ---------------------------------------------------------------- two processes (accelerate's MULTI_CPU, gloo)
WORKER = textwrap.dedent('''
    import copy, sys, warnings
    import torch
    from accelerate import Accelerator
    import capskip
    from capskip.engine.check import model_grads
    from capskip.engine.reuse import cached_traces
    from capskip.testing import digits_tensors, trained_digits_mlp

    warnings.simplefilter('error', RuntimeWarning)
    out = sys.argv[1]
    X, Y, _, _ = digits_tensors()
    base = trained_digits_mlp()
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    r = accelerator.process_index
    early = capskip.CAPSkip(copy.deepcopy(base))                # built before prepare: refused at its forward
    try:
        early(X[:8]); refusal = 'no error'
    except RuntimeError as err:
        refusal = str(err)
    model = copy.deepcopy(base)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X[:128], Y[:128]), batch_size=32)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    skip = capskip.CAPSkip(model)
    seen, synced = [], []
    for x, y in data:
        with accelerator.accumulate(model):
            accelerator.backward(skip.loss(skip(x), y))
            seen.append((x, y, skip.last.applied))
            synced.append(accelerator.sync_gradients)
            if accelerator.sync_gradients: grads = model_grads(model.module); break
            optimizer.step(); optimizer.zero_grad()
    torch.save({'grads': grads, 'seen': seen, 'synced': synced, 'refusal': refusal, 'wrapper': type(model).__name__,
                'world': accelerator.num_processes, 'backend': torch.distributed.get_backend(),
                'traces': [type(t).__name__ for t in cached_traces(model.module)]}, f'{out}/rank{r}.pt')
    accelerator.wait_for_everyone()
''')


@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    return rank_results(tmp_path_factory.mktemp('accelerate_ddp'), WORKER)


def test_two_processes_sync_the_skipped_gradients(ranks, digits):
    base = digits[0]
    assert [(r['world'], r['backend'], r['wrapper']) for r in ranks] == [(2, 'gloo', 'DistributedDataParallel')] * 2
    assert all(r['synced'] == [False, True] for r in ranks)                  # the first micro-batch under no_sync
    g0, g1 = ranks[0]['grads'], ranks[1]['grads']
    for name in g0: assert torch.equal(g0[name], g1[name]), name
    refs = [reference(base, r['seen'], 2 * 32) for r in ranks]
    mean = {n: (refs[0][n] + refs[1][n]) / 2 for n in refs[0]}
    worst, overall = grad_errors(g0, mean)
    assert worst <= 1e-5 and overall <= 1e-5, (worst, overall)
    assert grad_errors(refs[0], refs[1])[1] > 0.1, 'the ranks saw the same rows: the sync would not show'
    for r in ranks:
        assert all(0 < int((a > 0).sum()) < 32 for _, _, a in r['seen'])
        assert r['traces'] == ['Traced']


def test_a_capskip_built_before_prepare_is_refused(ranks):
    for r in ranks:
        assert 'not inside DistributedDataParallel' in r['refusal'], r['refusal']
