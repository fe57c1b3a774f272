"Shared fixtures for the policy tests: the digits data, a tiny MLP, reference gradients (no tests here)."
import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn

ENGINE_MODES = ['masked', 'reforward', 'reuse']   # 'reuse' is the target mode: it must pass, never skipped
BATCH = 64


@functools.lru_cache(maxsize=None)
def digits():
    "Train and test tensors of scikit-learn's 8×8 digits via capskip.data (1257 / 360 rows)."
    from capskip.data import digits_splits
    s = digits_splits(img_size=8, seed=0)
    xtr, ytr, _ = s.train.fetch(torch.arange(len(s.train)))
    xte, yte, _ = s.test.fetch(torch.arange(len(s.test)))
    return xtr, ytr, xte, yte


def tiny_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 10))


@functools.lru_cache(maxsize=None)
def _pretrained_state(steps: int = 150):
    X, Y, _, _ = digits()
    model = tiny_mlp(0)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(Y), (BATCH,), generator=g)
        F.cross_entropy(model(X[idx]), Y[idx]).backward(); opt.step(); opt.zero_grad()
    return copy.deepcopy(model.state_dict())


def pretrained_mlp() -> nn.Module:
    "A tiny MLP trained for 150 Adam steps (most rows classified correctly, so CAPSkip has candidates)."
    model = tiny_mlp(0)
    model.load_state_dict(_pretrained_state())
    return model


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def reference_grads(model: nn.Module, x, y, row_weights, label_smoothing: float = 0.0, denominator=None):
    "Plain autograd of (1/B) Σ w_i CE(z_i, y_i) on a copy of `model`."
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    losses = F.cross_entropy(ref(x), y, reduction='none', label_smoothing=label_smoothing)
    (losses * row_weights.float()).sum().div(len(y) if denominator is None else denominator).backward()
    return grads(ref)


def max_rel_err(got, ref) -> float:
    "Max over parameters of ‖got − ref‖ / ‖ref‖ (absolute where ‖ref‖ = 0)."
    out = 0.0
    for a, b in zip(got, ref):
        den = b.norm().item()
        out = max(out, (a - b).norm().item() / (den if den > 0 else 1.0))
    return out


def head_of(model: nn.Module) -> nn.Linear:
    return [m for m in model.modules() if isinstance(m, nn.Linear)][-1]


def assert_really_reused(model: nn.Module) -> None:
    "In mode='reuse', the engine traced the model and did not fall back to re-forwarding or full-batch backward."
    from capskip import _aot
    entries = [e for v in _aot._TRACES.get(model, {}).values() for e in v]
    assert entries, 'no reuse trace was made for this model'
    assert all(not isinstance(e, str) and e.fallback_reason is None for e in entries), entries
