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


class ClassScale(nn.Module):
    "A scale per class: the head's gradient is no longer one number times the selector's (tests/test_scaled_heads.py has the accepted scalar)."
    def forward(self, z): return z * torch.linspace(0.5, 2.0, z.shape[-1])


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
@pytest.mark.parametrize('after, follows', [(nn.Softmax(dim=1), '`after` (Softmax)'), (ClassScale(), '`after` (ClassScale)')])
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


class GatheredHead(nn.Module):
    "A decoder classifier's pooling: the head on every token, its output taken at each row's last positive token."
    def __init__(self, after=None):
        super().__init__()
        self.embed, self.fc, self.after = nn.Linear(4, 8), nn.Linear(8, 3), after

    @staticmethod
    def last(x): return (x[:, :, 0] > 0).long().cumsum(1).argmax(1)

    def forward(self, x):                                                 # x: [B, T, 4]
        z = self.fc(torch.tanh(self.embed(x)))
        if self.after is not None: z = self.after(z)
        return z[torch.arange(x.shape[0]), self.last(x)]


def gathered_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 6, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


@pytest.mark.parametrize('mode', MODES)
def test_a_gathered_head_gives_the_gathered_features_and_the_exact_gradient(mode):
    torch.manual_seed(0)
    model = GatheredHead()
    x, y = gathered_data()
    engine = Engine(model, mode)
    for w in (torch.tensor([1., 0, 1, 1, 0, 0, 1, 0]), torch.tensor([0., 0, 0, 0, 0, 2, 0, 0]), None):
        ref = autograd_grads(model, x, y, w)
        model.zero_grad(set_to_none=True)
        fwd = engine.forward(x)
        want = torch.tanh(model.embed(x))[torch.arange(8), GatheredHead.last(x)].detach()
        torch.testing.assert_close(fwd.features, want)                   # the head's input at the gathered positions
        torch.testing.assert_close(fwd.logits, model(x).detach())
        assert engine.loss_backward(fwd, y, w) == (8 if w is None else int((w > 0).sum()))
        err, glob = grad_errors(model_grads(model), ref)
        assert err <= 1e-5 and glob <= 1e-5, f'{mode} {w}: {err:.2e} {glob:.2e}'
    assert engine.head is model.fc and engine.capture.gathered
    if mode == 'reuse':
        from capskip.engine.reuse import cached_traces
        assert all(not isinstance(e, str) and e.fallback_reason is None for e in cached_traces(model))
    engine.close()
    assert model(x).shape == (8, 3)                                      # the hooks are gone: the model is as it was


class Classes(nn.Module):
    "Code after the head that depends on the number of classes."
    def forward(self, z): return z.view(z.shape[0], z.shape[1], 3)


def test_a_gathered_head_whose_output_cannot_carry_its_input_is_refused_in_one_line():
    x, _ = gathered_data()
    with pytest.raises(HeadError) as err:
        Engine(GatheredHead(Classes()), 'reuse').forward(x)
    msg = str(err.value)
    assert '\n' not in msg and '`fc` (Linear) gathered' in msg and 'cannot be gathered' in msg
    assert 'head(h[torch.arange(B), idx])' in msg
    with pytest.raises(HeadError, match='followed by'):                  # not a gather: refused as before
        Engine(GatheredHead(Temperature()), 'masked').forward(x)


def test_a_model_without_linear_is_refused_naming_the_constructor_the_user_called():
    import torchvision
    import capskip
    model = torchvision.models.squeezenet1_0(num_classes=10)
    with pytest.raises(ValueError) as err:
        capskip.CAPSkip(model)
    msg = str(err.value)
    assert 'SqueezeNet has no nn.Linear' in msg and 'CAPSkip(model, head=' in msg and 'Engine' not in msg
    with pytest.raises(ValueError, match=r'pass Engine\(model, head='):
        Engine(model)


def test_two_engines_on_one_gathered_head_each_get_the_gathered_features():
    "A second Engine (or CAPSkip) on the same model, the first not closed: the head's output is carried once per forward."
    torch.manual_seed(0)
    model = GatheredHead()
    x, y = gathered_data()
    first, second = Engine(model, 'masked'), Engine(model, 'reuse')
    want = torch.tanh(model.embed(x))[torch.arange(8), GatheredHead.last(x)].detach()
    for engine in (first, second, first):
        fwd = engine.forward(x)
        torch.testing.assert_close(fwd.features, want)
        torch.testing.assert_close(fwd.logits, model(x).detach())
    w = torch.tensor([0., 1, 1, 0, 0, 0, 1, 0])
    ref = autograd_grads(model, x, y, w)
    model.zero_grad(set_to_none=True)
    assert second.loss_backward(second.forward(x), y, w) == 3
    assert max(grad_errors(model_grads(model), ref)) <= 1e-5


class TiedByMatmul(nn.Module):
    "A causal LM written by hand with its logits tied to the embedding by a matrix product: no head module."
    def __init__(self, V=20, d=8, functional=False):
        super().__init__()
        self.emb, self.mlp, self.functional = nn.Embedding(V, d), nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d)), functional

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.mlp(h)
        return F.linear(h, self.emb.weight) if self.functional else h @ self.emb.weight.T


@pytest.mark.parametrize('functional', [False, True])
def test_logits_from_a_matrix_product_outside_any_module_get_a_refusal_that_says_to_make_it_a_module(functional):
    ids = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(HeadError) as err:
        Engine(TiedByMatmul(functional=functional), 'masked').forward(ids)
    msg = str(err.value)
    assert '\n' not in msg and 'matrix product outside any module (mm' in msg and 'nn.Linear(d, V, bias=False)' in msg
    assert 'mlp.2' not in msg                                             # not a wrong head named as if it were one
    explicit = TiedByMatmul()
    with pytest.raises(HeadError, match='matrix product outside any module'):    # head= names a module that is not it
        Engine(explicit, 'masked', head=explicit.mlp[2]).forward(ids)   # (a true head module named wrongly: test_an_explicit_head_is_verified_too)
