"Engine interface, eager modes (dense, masked, reforward), the loss gradient, the executor registry and the row-independence probe."
import ast
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip.engine
from capskip.core import ce_residuals
from capskip.engine import EXECUTORS, MODES, Engine, RowDependenceError, ce_grad_logits, find_head
from capskip.engine.check import autograd_grads, grad_errors, model_grads
from capskip.engine.executors import Dense, Masked, Reforward
from capskip.engine.probe import probe_modules, row_confined
from capskip.engine.reuse import Reuse


def tiny_cnn(num_classes: int = 5, p: float = 0.0, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.GELU(),
                         nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.GroupNorm(2, 8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(p), nn.Linear(8, num_classes))


class SeqFirst(nn.Module):
    "A transformer encoder with batch_first=False fed [B, N, C]: attention mixes the batch rows."
    def __init__(self):
        super().__init__()
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=False),
                                             1, enable_nested_tensor=False)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def bn_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def batch(B: int = 8, C: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 3, 8, 8, generator=g), torch.randint(0, C, (B,), generator=g)


def engine_grads(engine, x, y, w=None, ls=0.0, seed=1):
    engine.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    kept = engine.loss_backward(engine.forward(x), y, w, label_smoothing=ls)
    return kept, model_grads(engine.model)


def test_ce_grad_logits_matches_autograd_float64():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 4, (7,), generator=g)
    w = torch.rand(7, dtype=torch.float64, generator=g)
    (F.cross_entropy(z, t, reduction='none', label_smoothing=0.2) * w).sum().div(5.0).backward()
    got = ce_grad_logits(z, t, w, denominator=5.0, label_smoothing=0.2)
    assert got.dtype == torch.float64                         # float64 logits: a float64 gradient, not float32's 1e-8
    torch.testing.assert_close(got, z.grad, rtol=1e-14, atol=1e-16)
    z.grad = None
    F.cross_entropy(z, t).backward()                          # defaults: weights 1, denominator B
    torch.testing.assert_close(ce_grad_logits(z, t), z.grad, rtol=1e-14, atol=1e-16)
    zh = z.detach().to(torch.bfloat16)                        # narrower logits: a float32 gradient
    assert ce_grad_logits(zh, t).dtype == torch.float32


@pytest.mark.parametrize('mode', ['dense', 'masked', 'reforward'])
def test_eager_modes_match_autograd(mode):
    model = tiny_cnn()
    x, y = batch()
    w = torch.rand(8, generator=torch.Generator().manual_seed(1)) * (torch.arange(8) % 3 != 0)
    ref = autograd_grads(model, x, y, w, label_smoothing=0.1)
    engine = Engine(model, mode)
    kept, got = engine_grads(engine, x, y, w, ls=0.1)
    assert kept == int((w > 0).sum()) == 5
    assert grad_errors(got, ref)[0] <= 1e-5


def test_features_are_the_head_input_from_the_same_forward():
    model = tiny_cnn()
    x, _ = batch()
    fwd = Engine(model, 'masked').forward(x)
    body = model[:-1]
    torch.testing.assert_close(fwd.features, body(x).detach())
    assert not fwd.features.requires_grad and fwd.logits.shape == (8, 5)
    torch.testing.assert_close(model[-1](fwd.features), fwd.logits.detach())


def test_k0_leaves_zero_gradients_and_backward_accumulates():
    model = tiny_cnn()
    x, y = batch()
    engine = Engine(model, 'reforward')
    kept, zero = engine_grads(engine, x, y, torch.zeros(8))
    assert kept == 0 and all(float(g.abs().max()) == 0.0 for g in zero.values())
    ref = autograd_grads(model, x, y)
    model.zero_grad(set_to_none=True)
    for _ in range(2):                                        # two backward calls add up in .grad
        engine.loss_backward(engine.forward(x), y)
    got = {n: g / 2 for n, g in model_grads(model).items()}
    assert grad_errors(got, ref)[0] <= 1e-5


def test_bad_arguments_are_named():
    model = tiny_cnn()
    x, y = batch()
    with pytest.raises(ValueError, match='mode must be one of'): Engine(model, 'fast')
    with pytest.raises(TypeError, match='nn.Module'): Engine(lambda t: t, 'masked')
    with pytest.raises(ValueError, match='no nn.Linear'): Engine(nn.Sequential(nn.Conv2d(3, 3, 1)), 'masked')
    with pytest.raises(ValueError, match='submodule'): Engine(model, 'masked', head=nn.Linear(8, 5))
    engine = Engine(model, 'masked')
    fwd = engine.forward(x)
    with pytest.raises(ValueError, match='keep must be a bool'): engine.backward(fwd, torch.zeros(8, 5), torch.ones(8))
    with pytest.raises(ValueError, match='grad_logits must have the logits shape'):
        engine.backward(fwd, torch.zeros(8, 4), torch.ones(8, dtype=torch.bool))
    with pytest.raises(ValueError, match='row_weights must have shape'): engine.loss_backward(fwd, y, torch.ones(7))
    with pytest.raises(ValueError, match='targets must be'): engine.loss_backward(fwd, y[:4])
    with pytest.raises(ValueError, match='label_smoothing'): engine.loss_backward(fwd, y, label_smoothing=1.5)
    engine.loss_backward(fwd, y)
    with pytest.raises(RuntimeError, match='already back-propagated'): engine.loss_backward(fwd, y)
    with pytest.raises(ValueError, match='non-empty batch'): engine.forward(torch.zeros(0, 3, 8, 8))


def test_find_head_is_last_linear():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    assert find_head(model) is model[2]


@pytest.mark.parametrize('mode', ['reforward', 'reuse'])
def test_batchnorm_in_train_mode_is_refused_and_stats_restored(mode):
    model = bn_cnn()
    x, _ = batch()
    before = model[1].running_mean.clone()
    with pytest.raises(RowDependenceError) as err:
        Engine(model, mode).forward(x)
    msg = str(err.value)
    assert 'BatchNorm2d' in msg and 'mode="masked"' in msg and 'batchnorm_to_groupnorm' in msg
    assert isinstance(err.value, ValueError)
    torch.testing.assert_close(model[1].running_mean, before)   # the probe does not leave NaN statistics
    model.eval()                                                 # fixed statistics: rows are independent
    Engine(model, 'reforward').forward(x)


@pytest.mark.parametrize('mode', ['reforward', 'reuse'])
def test_sequence_first_transformer_is_refused(mode):
    torch.manual_seed(0)
    model = SeqFirst()
    with pytest.raises(RowDependenceError, match='self_attn'):
        Engine(model, mode).forward(torch.randn(4, 6, 16))


def test_row_confined_layouts():
    bad = torch.zeros(3, 4, 2, dtype=torch.bool); bad[:, 0] = True
    assert row_confined(bad, 4)                                  # [N, B, C], row 0
    flat = torch.zeros(12, 2, dtype=torch.bool); flat[:3] = True
    assert row_confined(flat, 4)                                 # [B·N, C], row 0's tokens
    flat[4] = True
    assert not row_confined(flat, 4)
    assert not row_confined(torch.ones(5, dtype=torch.bool), 4)  # input-dependent, no batch dim


class _IdsMix(nn.Module):
    "Token ids embedded, then a batch-wide mean subtracted: rows mix after the embedding."
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(10, 4), nn.Linear(8, 2)
    def forward(self, ids):
        h = self.emb(ids).flatten(1)
        return self.fc(h - h.mean(0))


def test_probe_takes_integer_token_ids():
    "Integer inputs are probed through the first floating value the model computes (the embedding output)."
    ids = torch.randint(0, 10, (6, 2), generator=torch.Generator().manual_seed(0))
    probe_modules(nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 2)), ids)   # row-independent: passes
    with pytest.raises(RowDependenceError):
        probe_modules(_IdsMix(), ids)


def test_masked_forward_under_no_grad_is_a_clear_error():
    model = tiny_cnn()
    x, y = batch()
    engine = Engine(model, 'masked')
    with torch.no_grad():
        fwd = engine.forward(x)
    with pytest.raises(RuntimeError, match='without autograd'):
        engine.loss_backward(fwd, y)


def test_ce_grad_logits_reuses_given_residuals():
    g = torch.Generator().manual_seed(4)
    z, t, w = torch.randn(6, 5, generator=g), torch.randint(0, 5, (6,), generator=g), torch.rand(6, generator=g)
    r = ce_residuals(z, t, 0.1)
    assert torch.equal(ce_grad_logits(z, t, w, 3.0, 0.1, residuals=r), ce_grad_logits(z, t, w, 3.0, 0.1))
    assert torch.equal(ce_grad_logits(z, t, w, 3.0, 0.1, residuals=torch.zeros(6, 5)), torch.zeros(6, 5))  # not recomputed
    with pytest.raises(ValueError, match='residuals must have the logits shape'):
        ce_grad_logits(z, t, residuals=r[:3])
    with pytest.raises(ValueError, match='denominator must be > 0'): ce_grad_logits(z, t, denominator=0)


@pytest.mark.parametrize('mode', ['masked', 'reforward', 'reuse'])
def test_loss_backward_with_the_selector_residuals_is_the_same_step(mode):
    model = tiny_cnn()
    x, y = batch()
    w = (torch.arange(8) % 3 != 0).float()
    engine = Engine(model, mode)
    _, plain = engine_grads(engine, x, y, w, ls=0.1)
    model.zero_grad(set_to_none=True)
    fwd = engine.forward(x)
    kept = engine.loss_backward(fwd, y, w, label_smoothing=0.1, residuals=ce_residuals(fwd.logits, y, 0.1))
    assert kept == 5 and grad_errors(model_grads(model), plain)[0] == 0.0


def test_executor_registry_maps_each_mode_to_one_class():
    assert tuple(EXECUTORS.list()) == MODES
    assert [EXECUTORS[m] for m in MODES] == [Dense, Masked, Reforward, Reuse]
    model = tiny_cnn()
    for mode in MODES:
        engine = Engine(model, mode)
        assert type(engine.executor) is EXECUTORS[mode] and engine.executor.mode == mode
        engine.close()
    reuse = Engine(model, 'reuse').executor
    assert type(reuse.fallback) is Reforward and reuse.fallback.capture is reuse.capture and reuse.fallback.probe is reuse.probe


def test_engine_modules_import_only_downward():
    "No engine module imports the package's own __init__ or a higher layer; no import hides inside a function."
    higher = ('policies', 'runs', 'analysis', 'bench', 'cli', 'testing', '_docs')
    for path in sorted(Path(capskip.engine.__file__).parent.glob('*.py')):
        tree = ast.parse(path.read_text())
        top = set(tree.body)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)): continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or '']
            for name in names:
                parts = name.split('.')
                if isinstance(node, ast.ImportFrom) and node.level:
                    assert not (node.level == 1 and name == ''), f'{path.name} imports the engine package itself'
                    if node.level == 2: assert parts[0] not in higher, f'{path.name} imports capskip.{name}'
                    if node.level == 1: assert node in top, f'{path.name}: lazy import of .{name}'
                else:
                    assert not name.startswith('capskip'), f'{path.name}: absolute import {name}'
