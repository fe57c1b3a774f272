"`Engine(..., compile=True)`: every mode through torch.compile gives plain autograd's gradient, with the kept count changing between steps."
import pytest
import torch

from capskip.engine import Engine
from capskip.engine.check import autograd_grads, grad_errors, model_grads
from capskip.testing.models import image_batch, tiny_cnn


# One case goes through inductor, torch.compile's default backend, as users run it; the others through `aot_eager`: the
# same dynamo capture and AOT graphs, without inductor's C++ codegen, which on a fresh machine (cold cache) took about
# 25 s per case on the 2-core VM.
@pytest.mark.parametrize('mode,layout,backend', [('dense', 'nchw', 'aot_eager'), ('reforward', 'nchw', 'aot_eager'),
                                                 ('reuse', 'nchw', 'inductor'), ('reuse', 'channels_last', 'aot_eager')])
def test_compiled_modes_match_autograd(mode, layout, backend, compile_backend):
    compile_backend(backend)                   # capskip's own torch.compile calls name no backend: this case's
    torch._dynamo.reset()
    model = tiny_cnn(num_classes=5, seed=0)
    x, y = image_batch(B=8, num_classes=5, seed=0)
    if layout == 'channels_last':              # saved values in channels-last order: take_rows' strided path under dynamo
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    engine = Engine(model, mode, compile=True)
    g = torch.Generator().manual_seed(0)
    for kept in (8, 5, 3, 6):                  # a different kept count each step: one compiled graph serves all (dynamic)
        w = torch.zeros(8)
        w[torch.randperm(8, generator=g)[:kept]] = torch.rand(kept, generator=g) + 0.5
        if mode == 'dense': w = torch.ones(8)
        model.zero_grad(set_to_none=True)
        fwd = engine.forward(x)
        assert fwd.features.shape == (8, 8) and fwd.logits.shape == (8, 5)
        assert engine.loss_backward(fwd, y, row_weights=w) == int((w > 0).sum())
        err = grad_errors(model_grads(model), autograd_grads(model, x, y, w))[0]
        assert err <= 1e-5, (mode, kept, err)
    assert engine.executor.compile
    engine.close()


def test_compile_is_off_by_default_and_passed_through():
    from capskip import CAPSkip
    model = tiny_cnn(num_classes=5)
    assert not Engine(model, 'reuse').compile
    skip = CAPSkip(model, compile=True)
    assert skip.engine.compile and skip.engine.executor.fallback.compile    # re-forward fallback compiled alike
    skip.close()
