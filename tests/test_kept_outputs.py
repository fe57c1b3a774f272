"""A module output that outlives the forward (`capskip.engine.probe.kept_outputs`, `nbs/01c_probe.ipynb`): a forward
hook that keeps a hidden state for an auxiliary loss, or a module that stores one on itself. `dense` and `masked`
back-propagate that loss exactly; `reuse` and `reforward`, which back-propagate the logits alone, refuse the model in
one line. Before, `reforward` left the auxiliary term's part out of the gradient with no word, and `reuse` fell back
to `reforward` (warning about its trace, not the loss) and did the same."""
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from capskip.engine.check import grad_errors, model_grads
from capskip.skip import CAPSkip

TOL = 1e-12     # float64 against float64 autograd: round-off is near 1e-16, a lost term's gradient is of order 0.1-1


class Net(nn.Module):
    "Two hidden layers and a head; `store=True` keeps the second layer's output on the module (`self.hidden`)."
    def __init__(self, store=False):
        super().__init__()
        self.a, self.b, self.fc, self.store = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 4), store
    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        if self.store: self.hidden = h
        return self.fc(h)


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(12, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (12,), generator=g)


def net(store=False):
    torch.manual_seed(0)
    return Net(store).double()


def hooked_step(model, forward, loss_of, X, Y):
    "One step whose loss adds 0.1·mean(h²) of layer b's output, kept by a forward hook."
    box = []
    handle = model.b.register_forward_hook(lambda m, i, o: box.append(o))
    try: z = forward(X)
    finally: handle.remove()
    (loss_of(z, Y) + 0.1 * box[-1].pow(2).mean()).backward()


@pytest.mark.parametrize('mode', ['dense', 'masked'])
def test_a_hooked_auxiliary_loss_is_exact_where_the_forward_has_autograd(mode):
    X, Y = data()
    model, ref = net(), net()
    skip = CAPSkip(model, budget=0.5, mode=mode)
    hooked_step(model, skip, skip.loss, X, Y)
    applied = skip.last.applied
    hooked_step(ref, ref, lambda z, y: (F.cross_entropy(z, y, reduction='none') * applied).sum() / len(y), X, Y)
    top, rel = grad_errors(model_grads(model), model_grads(ref))
    assert top < TOL and rel < TOL, (mode, top, rel)


@pytest.mark.parametrize('mode', ['reuse', 'reforward'])
@pytest.mark.parametrize('how', ['hook', 'attribute'])
def test_skipping_modes_refuse_a_kept_output(mode, how):
    X, Y = data()
    model = net(store=how == 'attribute')
    skip = CAPSkip(model, budget=0.5, mode=mode)
    where = 'the output of module b (Linear)' if how == 'hook' else 'attribute Net.hidden'
    with pytest.raises(ValueError, match=re.escape(where) + r" outlive\(s\) the forward .*use mode='masked'") as e:
        if how == 'hook': hooked_step(model, skip, skip.loss, X, Y)
        else: skip.loss(skip(X), Y).backward()
    assert '\n' not in str(e.value)


@pytest.mark.parametrize('mode', ['reuse', 'reforward'])
def test_a_detached_copy_is_not_refused_and_skipping_stays_exact(mode):
    X, Y = data()
    model, ref = net(), net()
    seen = []
    model.b.register_forward_hook(lambda m, i, o: seen.append(o.detach()))   # only read: logged
    skip = CAPSkip(model, budget=0.5, mode=mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        skip.loss(skip(X), Y).backward()
    said = [str(w.message) for w in caught]
    if mode == 'reuse':     # the list the hook appends to is state the forward changes at every call: reforward runs it
        assert any('changes, at every call, Python state it reads (len(model.b.<forward hook 0>.<closure 0>) == ' in m
                   and 'seen.append' in m and 'falling back to mode="reforward"' in m
                   for m in said), said
    else: assert said == []
    applied = skip.last.applied
    assert int((applied > 0).sum()) < len(Y)
    (F.cross_entropy(ref(X), Y, reduction='none') * applied).sum().div(len(Y)).backward()
    top, rel = grad_errors(model_grads(model), model_grads(ref))
    assert top < TOL and rel < TOL, (mode, top, rel)
    with torch.no_grad(): real = ref.b(torch.tanh(ref.a(X)))
    n = len(seen)
    skip.loss(skip(X), Y).backward()                                    # a later step
    logged = [t for t in seen[n:] if t.shape == real.shape]
    assert len(logged) == 1 and torch.equal(logged[0], real)            # the real forward, every step


def test_a_hook_added_after_the_first_steps_is_probed():
    X, Y = data()
    model = net()
    skip = CAPSkip(model, budget=0.5, mode='reforward')
    skip.loss(skip(X), Y).backward()                                    # probed and passed: nothing kept
    with pytest.raises(ValueError, match='the output of module b'):
        hooked_step(model, skip, skip.loss, X, Y)                       # a new hook: the module state changed


@pytest.mark.parametrize('mode', ['reuse', 'reforward'])
def test_the_deprecated_weight_norm_is_named_and_its_successor_runs_exactly(mode):
    X, Y = data()
    legacy = net()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')                                 # its deprecation warning
        torch.nn.utils.weight_norm(legacy.b)
    skip = CAPSkip(legacy, budget=0.5, mode=mode)
    with pytest.raises(ValueError, match=r'attribute b\.weight outlive.*parametrizations\.weight_norm keeps nothing'):
        skip.loss(skip(X), Y).backward()
    model, ref = net(), net()
    for m in (model, ref): torch.nn.utils.parametrizations.weight_norm(m.b)
    skip = CAPSkip(model, budget=0.5, mode=mode)
    skip.loss(skip(X), Y).backward()
    (F.cross_entropy(ref(X), Y, reduction='none') * skip.last.applied).sum().div(len(Y)).backward()
    top, rel = grad_errors(model_grads(model), model_grads(ref))
    assert top < TOL and rel < TOL, (mode, top, rel)
