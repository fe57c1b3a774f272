"The head is found from the forward and verified (issue 9 §1); soft targets and no_grad in the engine (§6)."
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from capskip.engine import Engine, find_head
from capskip.engine.check import autograd_grads, grad_errors, model_grads
from capskip.engine.head import HeadError, locate_head

MODES = ['dense', 'masked', 'reforward', 'reuse']


class WrongOrder(nn.Module):
    "The issue's model: `fc` registered before `proj`, the forward fc(relu(proj(x))); `after` is applied to the logits."
    def __init__(self, after=None):
        super().__init__()
        self.fc, self.proj = nn.Linear(16, 5), nn.Linear(8, 16)
        self.after = after

    def forward(self, x):
        z = self.fc(torch.relu(self.proj(x)))
        return z if self.after is None else self.after(z)


class Temperature(nn.Module):
    def forward(self, z): return z / 2.0


def data(B=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 8, generator=g), torch.randint(0, 5, (B,), generator=g)


@pytest.mark.parametrize('mode', MODES)
def test_the_head_is_found_from_the_forward(mode):
    torch.manual_seed(0)
    model = WrongOrder()
    x, y = data()
    engine = Engine(model, mode)
    assert find_head(model) is model.proj                                # the old rule: last registered Linear
    w = (torch.arange(6) % 2).float()
    ref = autograd_grads(model, x, y, w, seed=1)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    fwd = engine.forward(x)
    assert engine.head is model.fc
    torch.testing.assert_close(fwd.features, torch.relu(model.proj(x)).detach())   # the head's input, not x
    assert engine.loss_backward(fwd, y, w) == 3
    assert grad_errors(model_grads(model), ref)[0] <= 1e-5
    engine.close()


@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('after, follows', [(nn.Softmax(dim=1), '`after` (Softmax)'), (Temperature(), '`after` (Temperature)')])
def test_anything_after_the_head_is_refused(mode, after, follows):
    torch.manual_seed(0)
    x, _ = data()
    with pytest.raises(HeadError) as err:
        Engine(WrongOrder(after), mode).forward(x)
    msg = str(err.value)
    assert '`fc` (Linear)' in msg and follows in msg and 'return the raw logits' in msg and 'head=' in msg
    assert isinstance(err.value, ValueError)


def test_an_explicit_head_is_verified_too():
    torch.manual_seed(0)
    model = WrongOrder()
    x, _ = data()
    with pytest.raises(HeadError, match=r'`proj` \(Linear\): it is followed by relu, `fc` \(Linear\)'):
        Engine(model, 'masked', head=model.proj).forward(x)
    engine = Engine(model, 'masked', head=model.fc)
    assert engine.forward(x).features.shape == (6, 16) and engine.head is model.fc


def test_views_and_casts_after_the_head_are_accepted():
    class Viewed(WrongOrder):
        def forward(self, x): return super().forward(x)[:, None].squeeze(1).float().reshape(x.shape[0], 5)
    torch.manual_seed(0)
    model = Viewed()
    assert locate_head(model, data()[0]) is model.fc


def test_model_returning_a_tuple_is_refused():
    class Pair(WrongOrder):
        def forward(self, x): return super().forward(x), x
    with pytest.raises(HeadError, match='returns a tuple'):
        Engine(Pair(), 'reuse').forward(data()[0])


def test_head_is_verified_once_per_signature_and_leaves_no_trace(monkeypatch):
    import capskip.engine.head as head
    calls = []
    real = head.head_call
    monkeypatch.setattr(head, 'head_call', lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 5))
    x, y = data()
    engine = Engine(model, 'masked')
    state = torch.random.get_rng_state()
    engine.forward(x)
    engine.forward(x[:4])
    assert len(calls) == 1
    model.eval(); engine.forward(x); model.train()
    assert len(calls) == 2                                               # eval mode is another signature
    torch.manual_seed(3); a = model(x)
    torch.manual_seed(3); engine.capture.verified.clear(); engine.capture.verify(x); b = model(x)
    torch.testing.assert_close(a, b)                                     # the verification draws no random numbers


@pytest.mark.parametrize('mode', MODES)
def test_soft_targets_give_the_soft_cross_entropy_gradient(mode):
    "Mixup-style probability targets [B, C] with label smoothing: gradient = autograd of F.cross_entropy(probs)."
    torch.manual_seed(0)
    model = WrongOrder()
    x, y = data()
    lam = torch.rand(6, 1, generator=torch.Generator().manual_seed(2))
    soft = lam * F.one_hot(y, 5).float() + (1 - lam) * F.one_hot(y.roll(1), 5).float()
    w = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 1.0])
    ref = autograd_grads(model, x, soft, w, label_smoothing=0.1, seed=1)
    model.zero_grad(set_to_none=True)
    engine = Engine(model, mode)
    torch.manual_seed(1)
    assert engine.loss_backward(engine.forward(x), soft, w, label_smoothing=0.1) == 4
    assert grad_errors(model_grads(model), ref)[0] <= 1e-5


@pytest.mark.parametrize('mode', MODES)
def test_a_forward_without_autograd_cannot_be_back_propagated(mode):
    torch.manual_seed(0)
    model = WrongOrder()
    x, y = data()
    engine = Engine(model, mode)
    with torch.no_grad():
        fwd = engine.forward(x)
    with pytest.raises(RuntimeError, match='without autograd'):
        engine.loss_backward(fwd, y)
    assert all(p.grad is None for p in model.parameters())
    engine.loss_backward(engine.forward(x), y)                           # with gradients on, it works
