"`reuse` on every row-independent layout (issue 9 §3): the batch at any position or merged with another dim, exact and really skipped; only true row mixing is refused, with the fix for its cause."
import pytest
import torch
import torch.nn as nn

from capskip.engine import Engine, HeadCapture, RowDependenceError
from capskip.engine import _aot
from capskip.engine.check import autograd_grads, grad_errors
from capskip.engine.layouts import graph_layouts, sym_expr
from capskip.engine.reuse import cached_traces
from test_engine import SeqFirst, engine_grads

CASES = {'k=3': torch.tensor([1., 0, 1, 0, 0, 1]), 'k=1 weighted': torch.tensor([0., 0, 0, 0, 2, 0]),
         'k=5 weighted': torch.tensor([0.5, 1, 1, 2, 0, 1]), 'k=B': None}


class BatchFirstMHA(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True, dropout=dropout)
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 5)

    def forward(self, x):
        h = self.embed(x)
        return self.fc(self.norm(h + self.attn(h, h, h, need_weights=False)[0]).mean(1))


class SeqFirstFedRight(SeqFirst):
    "The sequence-first encoder fed what it expects, [N, B, C]: rows independent."
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x).transpose(0, 1)).transpose(0, 1).mean(1))


def small_torchvision_vit():
    "torchvision's VisionTransformer (nn.MultiheadAttention, batch_first=True, as vit_b_16) at a small size."
    from torchvision.models.vision_transformer import VisionTransformer
    return VisionTransformer(image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                             num_classes=5, dropout=0.1, attention_dropout=0.1)


class ChannelsLastConv(nn.Module):
    "A convolution fed a transposed view (channels-last memory, as PVT-v2's spatial reduction does)."
    def __init__(self):
        super().__init__()
        self.embed, self.sr, self.fc = nn.Linear(8, 12), nn.Conv2d(12, 12, 2, stride=2), nn.Linear(12, 5)

    def forward(self, x):                                      # x: [B, 16 tokens, 8]
        t = self.embed(x)
        img = t.transpose(1, 2).reshape(x.shape[0], 12, 4, 4)
        r = self.sr(img).reshape(x.shape[0], 12, -1).transpose(1, 2)
        return self.fc(r.mean(1))


MODELS = {'mha_batch_first': BatchFirstMHA, 'mha_dropout': lambda: BatchFirstMHA(0.2), 'seq_first_fed_right': SeqFirstFedRight,
          'torchvision_vit': small_torchvision_vit, 'channels_last_conv': ChannelsLastConv}


def inputs(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 16, 16, generator=g) if name == 'torchvision_vit' else torch.randn(6, 16 if name == 'channels_last_conv' else 7, 8, generator=g)
    return x, torch.randint(0, 5, (6,), generator=g)


@pytest.mark.parametrize('name', list(MODELS))
def test_reuse_is_exact_and_really_skips_rows(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    x, y = inputs(name)
    engine = Engine(model, 'reuse')
    for case, w in CASES.items():
        ref = autograd_grads(model, x, y, w, label_smoothing=0.1, seed=7)
        kept, got = engine_grads(engine, x, y, w, ls=0.1, seed=7)          # same seed: the same dropout draws
        assert kept == (6 if w is None else int((w > 0).sum()))
        err, glob = grad_errors(got, ref)
        assert err <= 1e-5 and glob <= 1e-5, f'{name} {case}: {err:.2e}'
    entries = cached_traces(model)
    assert entries and all(not isinstance(e, str) and e.fallback_reason is None for e in entries), entries


def test_merged_layouts_are_found_where_the_old_rule_guessed():
    "MultiheadAttention's saved values carry the batch merged after the tokens ([N·B, C]) and with the heads ([B·H, N, d])."
    torch.manual_seed(0)
    model = BatchFirstMHA()
    traced = _aot.trace(model, HeadCapture(model.fc), inputs('mha_batch_first')[0])
    layouts = {s[2] for s in traced.bw_inputs if s[0] == 'saved'}
    assert ('merged', 0, 7, 1) in layouts                                # tokens outermost: the old rule guessed (1, 7)
    assert any(l[0] == 'merged' and l[2] == 1 and l[3] > 1 for l in layouts)   # each row's entries together
    assert 'take_rows' in traced.bw.code and 'merged_rows' in traced.bw.code


def test_sequence_first_fed_batch_first_is_refused_with_its_own_fix():
    torch.manual_seed(0)
    for mode in ('reforward', 'reuse'):
        with pytest.raises(RowDependenceError) as err:
            Engine(SeqFirst(), mode).forward(torch.randn(4, 6, 16))
        msg = str(err.value)
        assert 'self_attn' in msg and 'batch_first=True' in msg and 'batchnorm_to_groupnorm' not in msg
        assert err.value.cause == 'sequence_first'


def test_batchnorm_refusal_names_batchnorm_even_when_called_functionally():
    "timm's BatchNormAct2d normalises in its own forward, then calls a child: the refusal names the BatchNorm module."
    class BatchNormAct(nn.BatchNorm2d):
        def __init__(self, c):
            super().__init__(c); self.act = nn.ReLU()
        def forward(self, x): return self.act(super().forward(x))
    model = nn.Sequential(nn.Conv2d(3, 8, 3), BatchNormAct(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    with pytest.raises(RowDependenceError) as err:
        Engine(model, 'reuse').forward(torch.randn(4, 3, 8, 8))
    assert 'module 1 (BatchNormAct)' in str(err.value) and err.value.cause == 'batchnorm'
    assert 'batchnorm_to_groupnorm' in str(err.value) and 'batch_first' not in str(err.value)


def test_as_strided_that_only_restrides_keeps_the_rows():
    "torchvision Swin's pooled [B, C, 1, 1] gets channels-last strides by as_strided: rows stay where they were."
    class Restrided(nn.Module):
        def __init__(self):
            super().__init__(); self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8, 5)
        def forward(self, x):
            p = self.conv(x).mean((2, 3), keepdim=True)
            return self.fc(p.as_strided(p.shape, (8, 1, 8, 8)).flatten(1))
    torch.manual_seed(0)
    model = Restrided()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g)
    w = torch.tensor([1., 0, 1, 0, 0, 1])
    ref = autograd_grads(model, x, y, w)
    kept, got = engine_grads(Engine(model, 'reuse'), x, y, w)
    assert kept == 3 and grad_errors(got, ref)[0] <= 1e-5
    assert all(e.fallback_reason is None for e in cached_traces(model))


def test_graph_layouts_propagate_through_views():
    torch.manual_seed(0)
    model = BatchFirstMHA()
    x = inputs('mha_batch_first')[0]
    dyn, ins, fw, bw, xc, _ = _aot._capture(model, HeadCapture(model.fc), x)
    xn = [n for n, v in zip([n for n in fw.graph.nodes if n.op == 'placeholder'], ins) if v is xc][0]
    env = graph_layouts(fw, sym_expr(xn.meta['val'].shape[0]), xn)
    kinds = {l[0] for l in env.values() if isinstance(l, tuple)}
    assert 'unknown' not in kinds and {'batch', 'merged', 'static', 'sym'} <= kinds


class RowGather(nn.Module):
    "A per-row gather in the forward, then the head: `h[arange(B), idx]` (flat=True: the same through `arange(B) * T + idx`; flat='step': through `arange(0, B·T, T) + idx`)."
    def __init__(self, flat=False):
        super().__init__()
        self.embed, self.fc, self.flat = nn.Linear(4, 8), nn.Linear(8, 3), flat

    def forward(self, x):                                                 # x: [B, T, 4]
        h = torch.tanh(self.embed(x))
        idx = (x[:, :, 0] > 0).long().cumsum(1).argmax(1)
        rows = torch.arange(x.shape[0], device=x.device)
        if self.flat == 'step':
            first = torch.arange(0, x.shape[0] * h.shape[1], h.shape[1], device=x.device)   # each row's first flat position
            return self.fc(h.reshape(-1, h.shape[-1])[first + idx])
        if self.flat: return self.fc(h.reshape(-1, h.shape[-1])[rows * h.shape[1] + idx])
        return self.fc(h[rows, idx])


GATHER_KEEPS = {'k=3': torch.tensor([0., 0, 1, 0, 0, 0, 1, 1]), 'k=1': torch.tensor([0., 0, 0, 0, 0, 0, 0, 3]),
                'k=5 weighted': torch.tensor([2., 0, 1, 0.5, 1, 0, 1, 0]), 'k=B': None}


def sliced_rows(monkeypatch) -> list:
    import capskip.engine.reuse as reuse
    seen, real = [], reuse._bw_args
    monkeypatch.setattr(reuse, '_bw_args', lambda tr, specs, saved, tangent, rows:
                        seen.append((tangent.shape[0], rows is not None)) or real(tr, specs, saved, tangent, rows))
    return seen


def test_a_per_row_gather_in_the_forward_is_exact_in_reuse_on_the_kept_rows(monkeypatch):
    "The saved arange(B) of the gather's backward is renumbered for the kept rows, not row-sliced (it kept rows 6, 7 of 8)."
    torch.manual_seed(0)
    model = RowGather()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    seen = sliced_rows(monkeypatch)
    engine = Engine(model, 'reuse')
    for case, w in GATHER_KEEPS.items():
        ref = autograd_grads(model, x, y, w)
        seen.clear()
        kept, got = engine_grads(engine, x, y, w)
        assert kept == (8 if w is None else int((w > 0).sum()))
        err, glob = grad_errors(got, ref)
        assert err <= 1e-5 and glob <= 1e-5, f'{case}: {err:.2e} {glob:.2e}'
        assert seen == [(8 if kept == 8 else max(kept, 2), kept < 8)], (case, seen)   # sliced: only the kept rows
    traced, = cached_traces(model)
    assert traced.fallback_reason is None and ('arange', 0) in {s[2] for s in traced.bw_inputs if s[0] == 'saved'}


@pytest.mark.parametrize('flat', [True, 'step'])
def test_an_index_computed_from_the_row_numbers_runs_the_backward_over_all_rows_exactly(flat):
    "`arange(B) * T + idx` or `arange(0, B·T, T) + idx` holds the original row numbers: sliced it would scatter to the wrong rows, so it is not sliced (the stepped one was, and its backward failed with an index out of bounds)."
    torch.manual_seed(0)
    model = RowGather(flat=flat)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    w = GATHER_KEEPS['k=3']
    ref = autograd_grads(model, x, y, w)
    with pytest.warns(RuntimeWarning, match='row numbers'):
        kept, got = engine_grads(Engine(model, 'reuse'), x, y, w)
    assert kept == 3 and max(grad_errors(got, ref)) <= 1e-5
    traced, = cached_traces(model)
    assert 'computes with the row numbers' in traced.fallback_reason


def test_row_numbers_keep_their_layout_through_views_and_are_renumbered():
    from capskip.engine.layouts import renumbered
    torch.manual_seed(0)
    model = RowGather()
    x = torch.randn(6, 5, 4)
    dyn, ins, fw, bw, xc, _ = _aot._capture(model, HeadCapture(model.fc), x)
    xn = [n for n, v in zip([n for n in fw.graph.nodes if n.op == 'placeholder'], ins) if v is xc][0]
    env = graph_layouts(fw, sym_expr(xn.meta['val'].shape[0]), xn)
    aranges = [n for n in fw.graph.nodes if n.target is torch.ops.aten.arange.default]
    assert aranges and all(env[n] == ('arange', 0) for n in aranges)
    index = [n for n in fw.graph.nodes if n.target is torch.ops.aten.index.Tensor]
    assert index and all(env[n] == ('batch', 0) for n in index)       # gathered by the numbers: ordinary rows
    saved = torch.arange(6)[:, None].expand(6, 5)                        # [B, T] row numbers along dim 0
    torch.testing.assert_close(renumbered(saved, ('arange', 0), 3), torch.arange(3)[:, None].expand(3, 5))
