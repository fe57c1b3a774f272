"""`capskip.sequence`: both row Grams and the selector against a float64 brute force over explicit per-row blocks
(values, dropped set, realised bound), autograd, float32 tolerance, no host read (meta device), and bad input."""
import math

import pytest
import torch
import torch.nn.functional as F

from capskip.sequence import (block_gram, candidate_rule, distortion_curves, gram_costs, pick_method, row_grads_reference,
                              select_blocks_reference, select_from_gram, select_sequences, sequence_candidates,
                              sequence_gram, token_gram)


def lm_batch(B, L, V, d, seed, ignored=0.3, dtype=torch.float64):
    "Seeded logits [B, L, V] (per-row temperature), labels with ~`ignored` −100 (row 1 entirely when B > 1), features."
    g = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(B, L, V, generator=g, dtype=dtype) * torch.rand(B, 1, 1, generator=g, dtype=dtype)
    y = torch.randint(0, V, (B, L), generator=g)
    y = torch.where(torch.rand(B, L, generator=g) < ignored, torch.full_like(y, -100), y)
    if B > 1: y[1] = -100
    return z, y, torch.randn(B, L, d, generator=g, dtype=dtype)


def errors(K, G):
    "Zero-gradient-safe metrics: max |K − K_ref| / max |K_ref| and ‖K − K_ref‖ / ‖K_ref‖ (0 when K_ref is 0 and K too)."
    Kr = G.flatten(1) @ G.flatten(1).T
    scale_max, scale = Kr.abs().max(), Kr.norm()
    diff = (K.double() - Kr)
    if scale == 0: return float(diff.abs().max()), float(diff.norm())
    return float(diff.abs().max() / scale_max), float(diff.norm() / scale)


SHAPES = [(1, 1, 2, 1), (1, 6, 5, 3), (3, 4, 7, 2), (5, 3, 11, 4), (8, 5, 9, 3), (4, 9, 17, 1)]


@pytest.mark.parametrize('seed', range(12))
def test_grams_match_the_float64_blocks(seed):
    B, L, V, d = SHAPES[seed % len(SHAPES)]
    z, y, h = lm_batch(B, L, V, d, seed, ignored=[0.0, 0.3, 0.8][seed % 3])
    bias = seed % 2 == 0
    G = row_grads_reference(z, y, h, bias)
    for K in (token_gram(z, y, h, bias, chunk=3), block_gram(z, y, h, bias, chunk=4), sequence_gram(z, y, h, bias)):
        e_max, e_rel = errors(K, G)
        assert e_max < 1e-12 and e_rel < 1e-12, (e_max, e_rel)
    K, grad = block_gram(z, y, h, bias, chunk=5, return_grad=True)
    assert (grad - G.sum(0)).abs().max() <= 1e-14 * max(1.0, float(G.sum(0).abs().max()))


def test_row_blocks_are_autograd_gradients_of_the_hf_loss():
    z, y, h = lm_batch(4, 6, 7, 3, seed=3)
    head = torch.nn.Linear(3, 7).double()
    G, N = row_grads_reference(z, y, h), (y != -100).sum()
    for i in range(4):
        head.zero_grad()
        logits = head(h[i]) + (z[i] - head(h[i])).detach()      # value z[i], gradient through the head
        (F.cross_entropy(logits, y[i], ignore_index=-100, reduction='sum') / N).backward()
        g = torch.cat([head.weight.grad, head.bias.grad[:, None]], 1)
        scale = max(float(G.abs().max()), 1e-300)
        assert float((g - G[i]).abs().max()) / scale < 1e-13
    assert float(G[1].abs().max()) == 0.0                        # an unlabelled row has no gradient


@pytest.mark.parametrize('seed', range(16))
def test_selection_matches_the_block_oracle(seed):
    g = torch.Generator().manual_seed(1000 + seed)
    B, L, V, d = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 11), (1, 7), (2, 9), (1, 5)))
    z, y, h = lm_batch(B, L, V, d, seed, ignored=float(torch.rand(1, generator=g)) * 0.7)
    bias, budget = seed % 2 == 0, [0.05, 0.2, 0.5, 0.9][seed % 4]
    w = None if seed % 3 == 0 else torch.where(torch.rand(B, generator=g) < 0.2, 0.0, 2 * torch.rand(B, generator=g)).double()
    G = row_grads_reference(z, y, h, bias)
    Gw = G * (torch.ones(B, dtype=torch.float64) if w is None else w)[:, None, None]
    total = float(Gw.sum(0).norm())
    for method in ('token', 'block'):
        for rule in ('all', 'token_acc:0.5', 'all_correct'):
            sel = select_sequences(z, y, h, budget, rule, w, bias, eps=0.0, method=method)
            drop, dist = select_blocks_reference(G, sequence_candidates(z, y, rule), budget, w)
            assert sel.drop.tolist() == drop.tolist(), (method, rule)
            realised = float(Gw[sel.drop].sum(0).norm())
            assert realised <= budget * total * (1 + 1e-12) + 1e-300
            assert abs(float(sel.distortion) - dist) <= 1e-6
            assert torch.allclose(sel.row_norms.double(), G.flatten(1).norm(dim=1), rtol=1e-6, atol=1e-30)


def test_all_ignored_and_unlabelled_rows():
    z, y, h = lm_batch(3, 4, 5, 2, seed=7)
    y_none = torch.full_like(y, -100)
    for method in ('token', 'block'):
        assert float(sequence_gram(z, y_none, h, method=method).abs().max()) == 0.0
        sel = select_sequences(z, y_none, h, 0.09, 'all_correct', method=method)
        assert sel.drop.all() and float(sel.distortion) == 0.0      # every row has G_i = 0: skipping changes nothing
    sel = select_sequences(z, y, h, 0.0, 'all_correct')              # budget 0: only zero rows may go
    assert sel.drop[1] and float(sel.dropped_norm) <= 1e-6 * max(float(sel.total_norm), 1e-30)


def test_float32_inputs_within_measured_roundoff():
    z, y, h = lm_batch(6, 16, 50, 8, seed=3)
    G = row_grads_reference(z, y, h)
    for f in (token_gram, block_gram):
        e_max, e_rel = errors(f(z.float(), y, h.float()), G)
        assert e_max < 1e-5 and e_rel < 1e-5, (f.__name__, e_max, e_rel)   # measured ~2e-7
    K16 = block_gram(z.bfloat16(), y, h.bfloat16())                      # bf16 inputs are computed in fp32
    assert K16.dtype == torch.float64 and torch.isfinite(K16).all()


def test_confident_tokens_keep_their_residual_in_float32():
    z = torch.tensor([[[20.0, 0.0, 0.0]]]); y = torch.tensor([[0]]); h = torch.ones(1, 1, 1)
    K = block_gram(z, y, h, bias=False)
    e = math.exp(-20)
    exact = 6 * e * e / (1 + 2 * e) ** 2                                  # ‖r‖² = (2e)² + e² + e², over (1 + 2e)²
    assert abs(float(K[0, 0]) / exact - 1) < 1e-4                         # softmax − 1 in fp32 would lose the label entry


def test_no_host_read_on_the_meta_device():
    z, y, h = lm_batch(4, 5, 7, 3, seed=2, dtype=torch.float32)
    meta = [t.to('meta') for t in (z, y, h)]
    for method in ('token', 'block'):
        sel = select_sequences(*meta, 0.09, 'token_acc:0.5', torch.ones(4, device='meta'), method=method)
        assert all(t.device.type == 'meta' for t in sel)


def test_dispatcher_picks_the_cheaper_formula():
    assert pick_method(8, 512, 50257, 768) == 'block' and pick_method(1, 64, 50257, 768) == 'token'
    for B, L, V, d in [(2, 3, 5, 4), (16, 128, 1000, 64), (1, 8, 50257, 768)]:
        c = gram_costs(B, L, V, d)
        assert pick_method(B, L, V, d) == min(c, key=lambda k: (c[k], k != 'block'))
    assert gram_costs(2, 3, 5, 4, bias=False) == {'token': 36 * 9, 'block': 6 * 20 + 4 * 20}


def test_candidate_rules():
    z = torch.tensor([[[2., 0.], [0., 2.]], [[2., 0.], [2., 0.]], [[0., 2.], [0., 2.]]])
    y = torch.tensor([[0, 0], [0, 0], [-100, -100]])
    assert sequence_candidates(z, y, 'all_correct').tolist() == [False, True, True]
    assert sequence_candidates(z, y, 'token_acc:0.75').tolist() == [False, True, True]
    assert sequence_candidates(z, y, 'token_acc:0.5').tolist() == [True, True, True]
    assert sequence_candidates(z, y, 'all').tolist() == [True, True, True]



@pytest.mark.parametrize('V,dtype', [(9, torch.float32), (9, torch.bfloat16), (9, torch.float64), (1 << 19, torch.float32)])
def test_token_correct_is_argmax_with_its_ties(V, dtype):
    "token_correct's amax path gives argmax's answer: ties at the maximum (the first column wins), rows of equal logits, every token correct, labels out of range or int32, chunks of the argmax rows (2²¹ logits: 4 rows at V = 2¹⁹)."
    from capskip.sequence import token_correct
    g = torch.Generator().manual_seed(V)
    z = torch.randint(-2, 3, (3, 7, V), generator=g).to(dtype)
    z[0, :3] = 0.0                                                       # equal logits: argmax is column 0
    y = torch.randint(0, V, (3, 7), generator=g)
    y[0, :2] = 0; y[1, :2] = -100; y[1, 2] = V + 5; y[1, 3] = -7           # out-of-range labels are never correct
    y[2] = z[2].float().argmax(-1)                                       # a row whose every token is correct
    for zz, yy in ((z, y), (z, y.int()), (z[:, :-1], y[:, 1:]), (z.transpose(0, 1), y.T)):   # also slices: not contiguous
        n, c = token_correct(zz, yy)
        m = yy != -100
        assert n.tolist() == m.sum(1).tolist()
        assert c.tolist() == ((zz.argmax(-1) == yy) & m).sum(1).tolist()
    n, c = token_correct(z, y)
    assert int(c[2]) == 7 and int(c[0]) >= 2


def test_distortion_curves_hold_the_selection():
    z, y, h = lm_batch(8, 6, 9, 3, seed=5)
    for rule, c in distortion_curves(z, y, h, ('all', 'token_acc:0.5', 'all_correct'), budget=0.3).items():
        n, m = int(c.n_candidates), int(c.selection.m)
        assert torch.isnan(c.distortion[n + 1:]).all() and not torch.isnan(c.distortion[:n + 1]).any()
        assert float(c.distortion[m]) <= 0.3 + 1e-6 and float(c.dropped_at_budget) == m / 8
        later = c.distortion[m + 1:n + 1]
        assert (later > 0.3).all()                                    # m is the longest feasible prefix


@pytest.mark.parametrize('call, message', [
    (lambda z, y, h: select_sequences(z[0], y, h), 'logits must be [B, L, V]'),
    (lambda z, y, h: select_sequences(z, y[:, 1:], h), 'shift them first'),
    (lambda z, y, h: select_sequences(z, y.float(), h), 'labels must be an integer tensor'),
    (lambda z, y, h: select_sequences(z, y, h[:, :, :, None]), 'features must be [B, L, d]'),
    (lambda z, y, h: select_sequences(z, y + 50, h), 'must lie in [0, 7) or be -100'),
    (lambda z, y, h: select_sequences(z, y, h, candidates='most'), "unknown candidate rule 'most'"),
    (lambda z, y, h: select_sequences(z, y, h, method='fast'), "method must be 'auto', 'token' or 'block'"),
    (lambda z, y, h: select_sequences(z, y, h, budget=-1.0), 'budget must be a finite number'),
    (lambda z, y, h: select_sequences(z, y, h, weights=torch.ones(2)), 'weights must be a float tensor [B]'),
    (lambda z, y, h: select_sequences(z, y, h, weights=-torch.ones(3, dtype=torch.float64)), 'weights must be ≥ 0'),
    (lambda z, y, h: select_from_gram(torch.ones(3, 2), torch.ones(3, dtype=torch.bool)), 'gram must be a square'),
    (lambda z, y, h: select_from_gram(torch.eye(3), torch.ones(3)), 'correct must be a bool tensor [B]'),
])
def test_bad_input_is_one_clear_line(call, message):
    z, y, h = lm_batch(3, 4, 7, 2, seed=1)
    with pytest.raises((ValueError, TypeError)) as info:
        call(z, y, h)
    assert message in str(info.value) and '\n' not in str(info.value)


def test_block_pass_chunk_width_is_capped_and_exact(monkeypatch):
    "The block pass's own narrower chunk (`_block_chunk`): 1024 columns at GPT-2 width and B=8, capped by `chunk`, and exact when it bites."
    import capskip.sequence as seq
    assert seq._block_chunk(8, 768, 8192) == 1024 and seq._block_chunk(32, 769, 8192) == 256
    assert seq._block_chunk(8, 768, 100) == 100 and seq._block_chunk(10 ** 6, 769, 8192) == 64
    z, y, h = lm_batch(5, 3, 150, 4, seed=7)                  # V = 150: not a multiple of the chunk
    G = row_grads_reference(z, y, h, True)
    calls = []
    orig = seq.residual_chunks
    monkeypatch.setattr(seq, 'residual_chunks', lambda *a: calls.append(a[5]) or orig(*a))   # (z, yc, lse, off, dt, chunk, cap)
    monkeypatch.setattr(seq, '_BLOCK_ELEMENTS', 5 * 5 * 64)   # B·d̃ = 25 → 64 columns: three chunks, the last of 22
    K, grad = block_gram(z, y, h, True, return_grad=True)
    assert calls == [64]                                        # the narrower chunk was used, not VOCAB_CHUNK
    e_max, e_rel = errors(K, G)
    assert e_max < 1e-12 and e_rel < 1e-12, (e_max, e_rel)
    assert (grad - G.sum(0)).abs().max() <= 1e-14 * max(1.0, float(G.sum(0).abs().max()))
    K32 = block_gram(z.float(), y, h.float(), True)             # fp32 control: close but not float64-exact
    e32 = errors(K32, G)[1]
    assert 0 < e32 < 1e-5, e32


def test_wide_logits_leave_no_entry_whose_products_are_subnormal():
    """Logits spread as an initialised LM's (std ≈ √768): every residual entry r of the block pass stays ≥ 2^-102 in
    float32, so its products with factors ≥ 2^-24 are normal numbers (a subnormal product is a microcode path on Intel
    CPUs: with the old floor the exact selector took 18.7x a two-block LM step there,
    nbs/recorded/bench_sequence_xeon_at_d07d124.json); the Gram still matches the float64 brute force."""
    from capskip.sequence import _prepare, exp_floor, residual_chunks
    tiny = torch.finfo(torch.float32).tiny
    assert math.exp(exp_floor(torch.float32)) * 2**-24 >= tiny and math.exp(exp_floor(torch.float64)) * 2**-53 >= torch.finfo(torch.float64).tiny
    assert exp_floor(torch.float16) == exp_floor(torch.bfloat16) == exp_floor(torch.float32)   # half logits are computed in fp32: its floor, not fp16's ≈ −1.1
    g = torch.Generator().manual_seed(3)
    z = 28 * torch.randn(2, 16, 300, generator=g)
    y = torch.randint(0, 300, (2, 16), generator=g)
    h = torch.randn(2, 16, 8, generator=g)
    zz, yc, lse, off, _, _, dt = _prepare(z, y, h, True, -100, None)
    R = torch.cat([R for _, R in residual_chunks(zz, yc, lse, off, dt, 64)], 1)
    assert float(R.abs().min()) * 2**-24 >= tiny
    err_max, err = errors(block_gram(z, y, h), row_grads_reference(z, y, h))
    assert err_max < 1e-5 and err < 1e-5


@pytest.mark.parametrize('rows', [1, 3, 1 << 20])
def test_token_losses_in_row_chunks_are_the_float64_cross_entropy(monkeypatch, rows):
    "token_losses (the loss without a graph: CAPSkip.step, evaluation) walks the tokens in chunks of PASS_ELEMENTS // V rows; chunks that end inside a sequence, a partial last chunk, ignored tokens, bf16 and std-28 logits give float64 F.cross_entropy's values, and sequence_loss's statistics under no_grad equal them."
    import capskip.steps as steps
    monkeypatch.setattr(steps, 'PASS_ELEMENTS', rows * 37)
    g = torch.Generator().manual_seed(5)
    z = torch.randn(3, 7, 37, generator=g) * 28
    y = torch.randint(0, 37, (3, 7), generator=g); y[0, :3] = -100; y[2] = -100
    for zz in (z, z.double(), z.to(torch.bfloat16)):
        ref = F.cross_entropy(zz.double().flatten(0, 1), y.flatten(), reduction='none', ignore_index=-100).view(3, 7)
        got = steps.token_losses(zz, y)
        assert got.dtype == (torch.float64 if zz.dtype == torch.float64 else torch.float32)
        tol = 1e-12 if zz.dtype == torch.float64 else 1e-5 * float(ref.abs().max())
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=tol)
        assert got[0, :3].tolist() == [0.0] * 3 and got[2].tolist() == [0.0] * 7
    ref = F.cross_entropy(z.double().flatten(0, 1), y.flatten(), reduction='none', ignore_index=-100).view(3, 7)
    with torch.no_grad(): st = steps.sequence_loss(z, torch.randn(3, 7, 4, generator=g), y, budget=0.0)[1]
    torch.testing.assert_close(st.losses.double(), ref.sum(1), rtol=0, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize('rows', [None, [0, 2, 3]])
def test_the_kept_rows_gradient_from_the_splits_softmax_sums_is_the_same_numbers(monkeypatch, rows):
    "sequence_grad_logits given `softmax` (each token's max logit and Σ exp(z − max), from the top-k Gram's split: no max or sum sweep of its own) gives bit for bit the gradient it computes alone, in chunks that end inside a sequence, for all rows or some; the split's log-sum-exp gives token_losses' values; a wrong shape is one line."
    from capskip.engine import facade
    from capskip.sequence_bounds import token_split
    g = torch.Generator().manual_seed(5)
    z = torch.randn(4, 6, 300, generator=g) * 28                       # spread 28: far tails clamped at exp_floor
    y = torch.randint(0, 300, (4, 6), generator=g); y[1, :3] = -100
    sp = token_split(z, y, 8)
    soft = (sp.peak.view(4, 6), sp.total.view(4, 6))
    r = None if rows is None else torch.tensor(rows)
    for chunk in (300 * 7, 1 << 19):                                  # 7 tokens a chunk: chunks end inside a sequence
        monkeypatch.setattr(facade, '_PASS_ELEMENTS', chunk)
        alone, shared = facade.sequence_grad_logits(z, y, rows=r), facade.sequence_grad_logits(z, y, rows=r, softmax=soft)
        assert torch.equal(alone, shared)
    from capskip import steps
    assert torch.equal(steps.token_losses(z, y, lse=sp.lse), steps.token_losses(z, y))
    with pytest.raises(ValueError, match=r'softmax must be \(max logit'):
        facade.sequence_grad_logits(z, y, softmax=(sp.peak, sp.total))   # flat [T], not [B, L]
