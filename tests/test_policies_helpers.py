"Shared settings for the policy tests (no tests here): engine modes, batch size, gradient comparison, the reuse check; models and data come from capskip.testing."
import torch
from torch import nn

from capskip.engine import find_head
from capskip.engine.reuse import cached_traces
from capskip.testing import autograd_grads, digits_tensors, grad_errors, model_grads, tiny_mlp, trained_digits_mlp

ENGINE_MODES = ['masked', 'reforward', 'reuse']   # 'reuse' is the target mode: it must pass, never skipped
BATCH = 64

__all__ = ['ENGINE_MODES', 'BATCH', 'autograd_grads', 'model_grads', 'tiny_mlp', 'digits', 'pretrained_mlp',
           'grad_errors', 'head_names', 'find_head', 'assert_really_reused']


def digits():
    "Train and test tensors of the embedded 8×8 digits (1257 / 360 rows), cached by capskip.testing."
    return digits_tensors(8, 0)


def pretrained_mlp() -> nn.Module:
    "capskip.testing's tiny MLP after 150 Adam steps on the digits (most rows classified correctly, so CAPSkip has candidates)."
    return trained_digits_mlp(150, 0)


def head_names(model: nn.Module) -> set[str]:
    "Names of the final layer's parameters (the head the engine finds)."
    head = {id(p) for p in find_head(model).parameters()}
    return {n for n, p in model.named_parameters() if id(p) in head}


def assert_really_reused(model: nn.Module) -> None:
    "In mode='reuse', the engine traced the model and did not fall back to re-forwarding or full-batch backward."
    entries = cached_traces(model)
    assert entries, 'no reuse trace was made for this model'
    assert all(not isinstance(e, str) and e.fallback_reason is None for e in entries), entries
