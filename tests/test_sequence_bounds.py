"""The certified top-k Gram (`capskip.sequence_bounds`): bounds against a float64 brute force, the rule's guarantee on
the exact blocks, exactness at k ≥ V, the fp32 path at a wide vocabulary."""
import pytest
import torch

from capskip.sequence import block_gram, row_grads_reference, select_sequences
from capskip.sequence_bounds import (parse_gram, select_from_bounds, select_sequences_topk, select_sequences_with,
                                     topk_gram_bounds)


def batch(seed, B=5, L=6, V=23, d=4, scale=3.0, dtype=torch.float64, ties=False):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, L, V, generator=g, dtype=torch.float64) * scale
    if ties: z = z.round()
    y = torch.randint(0, V, (B, L), generator=g)
    y[torch.rand(B, L, generator=g) < 0.25] = -100
    h = torch.randn(B, L, d, generator=g, dtype=torch.float64) + 1.0
    return z.to(dtype), y, h.to(dtype)


def exact_gram(z, y, h, bias):
    G = row_grads_reference(z, y, h, bias)
    return G, torch.einsum('ivd,jvd->ij', G, G)


@pytest.mark.parametrize('seed', range(6))
def test_bounds_bracket_the_float64_gram_and_meet_at_k_equal_v(seed):
    z, y, h = batch(seed, ties=seed % 2 == 0)
    bias = seed % 3 != 0
    _, K = exact_gram(z, y, h, bias)
    tol = 1e-12 * K.abs().max()
    widths = []
    for k in (1, 4, 22, 23, 40):
        lo, up = topk_gram_bounds(z, y, h, bias, k=k)
        assert bool((lo <= K + tol).all()) and bool((K <= up + tol).all()), k
        widths.append(float((up - lo).abs().sum()))
        if k >= 23: assert float((up - lo).abs().max()) <= tol and float((lo - K).abs().max()) <= tol
    assert widths[0] > 1e-6 * float(K.abs().sum()) and widths[0] >= widths[1] >= widths[2]   # the control: k = 1 is loose


def test_the_rule_on_bounds_meets_the_budget_on_the_exact_blocks_and_is_exact_at_k_equal_v():
    checked = dropped = 0
    for seed in range(20):
        z, y, h = batch(100 + seed, B=7, scale=0.5 + seed % 4)
        G, _ = exact_gram(z, y, h, True)
        w = torch.rand(7, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 if seed % 2 else None
        Gw = G * (1.0 if w is None else w[:, None, None])
        for budget in (0.1, 0.4):
            exact = select_sequences(z, y, h, budget, weights=w, eps=0.0, method='block')
            for k in (2, 8, 23):
                sel = select_sequences_topk(z, y, h, budget, weights=w, eps=0.0, k=k)
                realised = float(Gw[sel.drop].sum(0).norm() / Gw.sum(0).norm())
                assert realised <= budget * (1 + 1e-9) and float(sel.distortion) >= realised - 1e-6
                if k == 23: assert sel.drop.tolist() == exact.drop.tolist()
                checked, dropped = checked + 1, dropped + int(sel.m)
    assert checked == 120 and dropped > 0


def test_float32_bounds_at_a_wide_vocabulary_hold_to_round_off():
    "fp32 logits over V = 4000 (the chunked path: several row chunks): the bounds bracket the float64 block Gram."
    z, y, h = batch(7, B=3, L=40, V=4000, d=16, scale=2.0, dtype=torch.float32)
    K = block_gram(z.double(), y, h.double())
    lo, up = topk_gram_bounds(z, y, h, k=16)
    tol = 1e-5 * float(K.abs().max())
    assert bool((lo <= K + tol).all()) and bool((K <= up + tol).all())
    assert lo.dtype == torch.float64


def test_head_gradient_of_the_kept_rows_and_the_gram_names():
    z, y, h = batch(3, B=6)
    G, _ = exact_gram(z, y, h, True)
    sel, g = select_sequences_with('topk:4', z, y, h, 0.4, return_grad=True)
    torch.testing.assert_close(g, G[~sel.drop].sum(0), rtol=1e-12, atol=1e-14)
    assert parse_gram('topk') == ('topk', 16) and parse_gram('auto') == ('auto', 0)
    for bad in ('topk:0', 'top', 3, 'exact'):
        with pytest.raises(ValueError, match="gram must be 'auto', 'token', 'block'"): parse_gram(bad)
    with pytest.raises(ValueError, match='correct must be a bool tensor'):
        select_from_bounds(topk_gram_bounds(z, y, h), torch.ones(5, dtype=torch.bool))


def test_sequence_loss_with_a_topk_gram_keeps_the_budget_and_options_check_the_name():
    "`sequence_loss(gram='topk:K')`: the loss of the kept rows, their exact ‖D‖ ≤ b‖G‖ at or under the reported distortion; a bad name is one line."
    from capskip.skip import SkipOptions
    from capskip.steps import sequence_loss
    z, y, h = batch(11, B=8, scale=0.7)
    G, _ = exact_gram(z, y, h, True)
    n = (y != -100).sum()
    for k in (2, 23):
        loss, st = sequence_loss(z, h, y, budget=0.3, gram=f'topk:{k}')
        D = G[st.drop].sum(0)
        realised = float(D.norm() / G.sum(0).norm())
        assert realised <= 0.3 + 1e-9 and float(st.distortion) >= realised - 1e-6   # the statistic is float32
        tok = torch.nn.functional.cross_entropy(z.flatten(0, 1), y.flatten(), reduction='none', ignore_index=-100).view(8, -1)
        torch.testing.assert_close(loss, tok.sum(1)[~st.drop].sum() / n, rtol=1e-12, atol=1e-14)
        if k == 23:
            exact = sequence_loss(z, h, y, budget=0.3, gram='block')[1]
            assert st.drop.tolist() == exact.drop.tolist() and int(st.drop.sum()) > 0   # k ≥ V: the exact rule's rows
    with pytest.raises(ValueError, match="gram must be 'auto'"): SkipOptions(gram='topk:x')
    with pytest.raises(ValueError, match="gram must be 'auto'"): sequence_loss(z, h, y, gram='exact')


@pytest.mark.parametrize('chunk,rows', [(1, 1), (7, 3), (40, 7), (60, 19 * 20), (1 << 23, 19)])
def test_pair_chunks_that_split_rows_give_the_same_bounds(monkeypatch, chunk, rows):
    "pair_sums walks the tokens s in chunks of _CHUNK_ELEMENTS // max(u, T), the top-k search and the softmax the rows in chunks of _PASS_ELEMENTS // V; chunks that end inside a row must add up to one pass."
    import capskip.sequence_bounds as sb
    z, y, h = batch(11, B=4, L=5, V=19)
    whole = topk_gram_bounds(z, y, h, k=3)
    monkeypatch.setattr(sb, '_CHUNK_ELEMENTS', chunk)
    monkeypatch.setattr(sb, '_PASS_ELEMENTS', rows)
    parts = topk_gram_bounds(z, y, h, k=3)
    for a, b in zip(whole, parts): torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    G, K = exact_gram(z, y, h, True)
    tol = 1e-12 * K.abs().max()
    assert bool((parts.lower <= K + tol).all()) and bool((K <= parts.upper + tol).all())


@pytest.mark.parametrize('rows,gather', [(1, 1), (1, 4), (2, 5), (4, 100), (9, 2)])
def test_split_with_blocks_in_row_chunks_is_one_pass_and_gathers_the_cross_terms(monkeypatch, rows, gather):
    "V with blocks (V > 64(k+1)): the block maxima and the softmax pass in chunks of _PASS_ELEMENTS // V rows, the search in batches of _PASS_ELEMENTS // 64(k+1), the cross terms gathered a few rows at a time (_GATHER_ELEMENTS // (k+1)T rows, a partial last group), give one pass's split; cross[s, t] is the float64 ⟨S_t, p_s⟩ − p_s[y_t]; a split without labels, or with other labels, is refused by the pair terms."
    import capskip.sequence_bounds as sb
    g = torch.Generator().manual_seed(7)
    z = torch.randn(9, 1500, generator=g, dtype=torch.float64) * 4
    y = torch.randint(0, 1500, (9,), generator=g)
    whole = sb.top_split(z, 5, torch.float64, y)
    monkeypatch.setattr(sb, '_PASS_ELEMENTS', rows * 1500)
    monkeypatch.setattr(sb, '_GATHER_ELEMENTS', gather * 6 * 9)
    parts = sb.top_split(z, 5, torch.float64, y)
    for a, b in zip(whole, parts): torch.testing.assert_close(a, b, rtol=1e-15, atol=0)
    assert parts.columns.tolist() == sorted(set(parts.index.flatten().tolist()) | set(y.tolist()))
    p = torch.softmax(z, 1)
    S = torch.where(z > parts.theta[:, None], p, 0.0)
    torch.testing.assert_close(parts.cross, (S @ p.T).T - p[:, y], rtol=1e-13, atol=1e-16)
    torch.testing.assert_close(parts.tail_sq, torch.where(z > parts.theta[:, None], 0.0, p).square().sum(1), rtol=1e-13, atol=0)
    h = torch.randn(9, 3, generator=g, dtype=torch.float64)
    with pytest.raises(ValueError, match='take the split with the labels'):
        sb.pair_sums(sb.top_split(z, 5, torch.float64), sb.pair_columns(whole, y), h, y, 9)
    with pytest.raises(ValueError, match='taken with other labels'): sb.pair_columns(whole, (y + 1) % 1500)
    with pytest.raises(ValueError, match='taken with other labels'): sb.pair_columns(whole, y.roll(1))   # the same columns, other tokens' labels


@pytest.mark.parametrize('chunk', [7, 1 << 23])
def test_pair_terms_gather_p_from_the_logits_when_u_times_T_is_over_the_cap(monkeypatch, chunk):
    "Over _CROSS_ELEMENTS (T²) the split keeps no cross terms and the pair terms gather p at U from the logits per chunk of tokens: the same float64 bounds as with them kept, and they still bracket the exact Gram."
    import capskip.sequence_bounds as sb
    z, y, h = batch(11, B=4, L=5, V=19)
    kept = topk_gram_bounds(z, y, h, k=3)
    monkeypatch.setattr(sb, '_CROSS_ELEMENTS', 0)
    monkeypatch.setattr(sb, '_CHUNK_ELEMENTS', chunk)
    sp = sb.top_split(z.reshape(20, 19), 3, torch.float64, y.reshape(20).clamp_min(0))
    assert sp.cross is None and sp.columns is not None
    streamed = topk_gram_bounds(z, y, h, k=3)
    for a, b in zip(kept, streamed): torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    G, K = exact_gram(z, y, h, True)
    tol = 1e-12 * K.abs().max()
    assert bool((streamed.lower <= K + tol).all()) and bool((K <= streamed.upper + tol).all())


def test_pair_columns_hold_every_top_entry_and_label():
    "U holds each token's top-k columns and its label once, sorted; S over U is the top-k values; a label's row in U is its column."
    from capskip.sequence_bounds import pair_columns, top_split
    z, y, _ = batch(3, B=3, L=4, V=17)
    zf, yc = z.reshape(12, 17), y.reshape(12).clamp_min(0)
    sp = top_split(zf, 3, torch.float64)
    U, S, ypos = pair_columns(sp, yc)
    assert bool((U[1:] > U[:-1]).all())
    assert set(U.tolist()) == set(sp.index.flatten().tolist()) | set(yc.tolist())
    dense = torch.zeros(12, 17, dtype=torch.float64).scatter_(1, sp.index, sp.values)
    torch.testing.assert_close(S.to_dense(), dense[:, U], rtol=0, atol=0)
    assert U[ypos].tolist() == yc.tolist()


def test_half_precision_logits_are_bounded_in_float32():
    "bf16 logits: the split and the pair terms run in float32 (the dtype of the top-k values), and the bounds bracket the float64 Gram of those logits."
    z, y, h = batch(5, B=3, L=4, V=29)
    zb = z.to(torch.bfloat16)
    lo, up = topk_gram_bounds(zb, y, h.float(), k=4)
    _, K = exact_gram(zb.double(), y, h.float().double(), True)
    tol = 1e-5 * K.abs().max()
    assert lo.dtype == torch.float64 and bool((lo <= K + tol).all()) and bool((K <= up + tol).all())


@pytest.mark.parametrize('V', [64 * 17, 64 * 17 + 1, 1000, 4099])
def test_block_topk_finds_the_exact_top_values_with_ties_and_minus_infinity(V):
    "The top k + 1 values by block maxima equal torch.topk's, and the columns hold them, with ties, −inf entries and a short last block."
    import math
    from capskip.sequence_bounds import block_topk, top_entries, top_split
    g = torch.Generator().manual_seed(V)
    z = (torch.randn(6, V, generator=g) * 2).round()                          # integers: many ties, also at θ
    z[0, :V // 2] = -math.inf; z[1, -3:] = 9.0                               # masked columns; the maximum in the short last block
    z[2] = 0.0                                                               # every entry tied
    for k in (1, 5, 16):
        top, ix = block_topk(z, k + 1)
        torch.testing.assert_close(top, z.topk(k + 1, dim=1).values, rtol=0, atol=0)
        assert bool((z.gather(1, ix) == top).all()) and bool((ix < V).all())
        assert all(len(set(r)) == k + 1 for r in ix.tolist())                 # distinct columns
        e, ref = top_entries(z, k, torch.float32), z.topk(k + 1, dim=1).values
        assert torch.equal(e.theta, ref[:, k]) and torch.equal(e.top, ref[:, :k])
    sp, p = top_split(z.double(), 5, torch.float64), torch.softmax(z.double(), 1)   # the float64 brute force of S and ‖T‖²
    S = torch.zeros_like(p).scatter_(1, sp.index, sp.values)
    torch.testing.assert_close(S, torch.where(z.double() > sp.theta[:, None], p, 0.0), rtol=1e-14, atol=0)
    torch.testing.assert_close(sp.tail_sq, (p - S).square().sum(1), rtol=1e-13, atol=0)
    torch.testing.assert_close(sp.lse, torch.logsumexp(z.double(), 1), rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize('gram', ['block', 'topk'])
def test_masked_columns_have_probability_zero_and_bad_logits_are_refused_in_one_line(gram):
    "A −Inf logit (a masked vocabulary column) has probability 0: the exact Gram and the top-k bounds match the float64 brute force with those columns masked; NaN, +Inf, or a token whose every logit is −Inf, are refused in one line (the top-k path finds them in its softmax pass, through each token's log-sum-exp, not in a pass of its own)."
    import math
    from capskip.sequence import sequence_gram
    z, y, h = batch(3)
    z[:, :, 5:9] = -math.inf
    y = torch.where((y >= 5) & (y < 9), 0, y)                       # labels on unmasked columns: a finite loss
    _, K = exact_gram(z, y, h, True)
    assert bool(torch.isfinite(K).all())
    tol = 1e-12 * K.abs().max()
    if gram == 'topk':
        lo, up = topk_gram_bounds(z, y, h, k=4)
        assert bool((lo <= K + tol).all()) and bool((K <= up + tol).all())
        lo, up = topk_gram_bounds(z, y, h, k=23)                   # k ≥ V: exact (the masked columns are in no one's top-k)
        torch.testing.assert_close(lo, K, rtol=0, atol=float(tol)); torch.testing.assert_close(up, K, rtol=0, atol=float(tol))
    else: torch.testing.assert_close(sequence_gram(z, y, h, method='block'), K, rtol=1e-10, atol=float(tol))
    select_sequences_with(gram, z, y, h, 0.1)
    for where, bad in (((1, 2, 3), math.nan), ((0, 5, 22), math.inf), ((2, 0), -math.inf)):
        zb = z.clone(); zb[where] = bad
        with pytest.raises(ValueError, match=r'NaN or \+Inf values, or a token whose every logit is -Inf'):
            select_sequences_with(gram, zb, y, h, 0.1)
        if gram == 'topk':                                          # without the check the bounds are not finite: it is the only guard
            assert not bool(torch.isfinite(topk_gram_bounds(zb, y, h, k=4, check_values=False).upper).all())
