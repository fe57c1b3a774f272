"""capskip.analysis.stats against independent computations: SciPy's t distribution, NumPy running maxima and interpolation."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy import stats as sps

from capskip.analysis.stats import (Comparison, dense_margin, difference_label, envelope_at, paired_difference,
                                    paired_ratio, ratio_label, regularized_incomplete_beta, running_max_frontier,
                                    student_t_cdf, student_t_quantile, t_interval, time_to_accuracy,
                                    time_to_accuracy_detail, tta_ratio)


@pytest.mark.parametrize('df', [1, 2, 3, 4, 5, 7, 10, 29, 100, 0.5, 2.5, 1e4])
@pytest.mark.parametrize('p', [0.5001, 0.6, 0.9, 0.95, 0.975, 0.995, 0.9995, 0.025, 0.1])
def test_t_quantile_matches_scipy(df, p):
    assert student_t_quantile(p, df) == pytest.approx(sps.t.ppf(p, df), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize('df', [1, 2, 3, 6.5, 40])
@pytest.mark.parametrize('t', [-30.0, -2.0, -0.3, 0.0, 0.7, 4.3, 100.0])
def test_t_cdf_matches_scipy(df, t):
    assert student_t_cdf(t, df) == pytest.approx(sps.t.cdf(t, df), rel=1e-10, abs=1e-14)


@given(x=st.floats(0.0, 1.0), a=st.floats(0.05, 60.0), b=st.floats(0.05, 60.0))
@settings(max_examples=200, deadline=None)
def test_incomplete_beta_matches_scipy(x, a, b):
    from scipy.special import betainc
    assert regularized_incomplete_beta(x, a, b) == pytest.approx(betainc(a, b, x), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize('bad', [0, -1, math.inf, math.nan, True, '3'])
def test_t_quantile_rejects_bad_df(bad):
    with pytest.raises(ValueError, match='degrees of freedom'):
        student_t_quantile(0.975, bad)


@pytest.mark.parametrize('values', [[0.17, 0.05, -0.23], [1.0, 2.0], [0.3, -0.1], [5.0, 5.1, 4.9, 5.3, 5.05]])
def test_t_interval_matches_scipy(values):
    mean, lo, hi = t_interval(values)
    ref_lo, ref_hi = sps.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=sps.sem(values))
    assert mean == pytest.approx(np.mean(values), abs=1e-12)
    assert (lo, hi) == pytest.approx((ref_lo, ref_hi), rel=1e-9, abs=1e-12)


def test_t_interval_needs_two_values():
    with pytest.raises(ValueError, match='at least 2'):
        t_interval([1.0])
    with pytest.raises(ValueError, match='finite'):
        t_interval([1.0, math.nan])


@pytest.mark.parametrize('n', [2, 3, 5])
def test_paired_difference_n_seeds_matches_scipy(n):
    gen = np.random.default_rng(n)
    arm = {s: 70 + gen.normal() for s in range(n)}
    ref = {s: 70 + gen.normal() for s in range(n)}
    c = paired_difference(arm, ref)
    d = np.array([arm[s] - ref[s] for s in range(n)])
    lo, hi = sps.t.interval(0.95, n - 1, loc=d.mean(), scale=sps.sem(d))
    assert (c.estimate, c.lo, c.hi) == pytest.approx((d.mean(), lo, hi), rel=1e-9)
    assert c.n == n and c.kind == 'difference'
    # the two-sided t-test at 5% rejects exactly when the interval excludes 0
    assert (c.label != 'unresolved') == (sps.ttest_rel(list(arm.values()), list(ref.values())).pvalue < 0.05)


@pytest.mark.parametrize('n', [2, 3, 4])
def test_paired_ratio_matches_scipy_in_log_space(n):
    gen = np.random.default_rng(10 + n)
    arm = {s: 100 * gen.uniform(0.8, 1.0) for s in range(n)}
    ref = {s: 100 * gen.uniform(0.95, 1.05) for s in range(n)}
    c = paired_ratio(arm, ref)
    logs = np.log([arm[s] / ref[s] for s in range(n)])
    lo, hi = sps.t.interval(0.95, n - 1, loc=logs.mean(), scale=sps.sem(logs))
    assert (c.estimate, c.lo, c.hi) == pytest.approx((math.exp(logs.mean()), math.exp(lo), math.exp(hi)), rel=1e-9)
    assert c.estimate == pytest.approx(sps.gmean([arm[s] / ref[s] for s in range(n)]), rel=1e-12)
    assert c.label == ratio_label(c.lo, c.hi)


def test_labels_follow_spec_and_never_say_equivalent():
    assert difference_label(0.01, 0.5) == 'better'
    assert difference_label(-0.5, -0.01) == 'worse'
    assert difference_label(-0.01, 0.5) == 'unresolved'
    assert difference_label(0.0, 0.5) == 'unresolved'     # touching 0 does not exclude it
    assert ratio_label(0.5, 0.99) == 'faster'
    assert ratio_label(1.01, 1.2) == 'slower'
    assert ratio_label(0.9, 1.0) == 'unresolved'
    gen = np.random.default_rng(0)
    for _ in range(200):
        a = {s: gen.normal() for s in range(3)}
        b = {s: gen.normal() for s in range(3)}
        assert paired_difference(a, b).label in ('better', 'worse', 'unresolved')
    with pytest.raises(ValueError, match='out of order'):
        difference_label(1.0, 0.0)


def test_unpaired_or_too_few_seeds_are_errors():
    with pytest.raises(ValueError, match=r'seeds \[3\] lack a reference run'):
        paired_difference({1: 1.0, 2: 2.0, 3: 3.0}, {1: 1.0, 2: 2.0})
    with pytest.raises(ValueError, match=r'seeds \[4\] lack an arm run'):
        paired_ratio({1: 1.0, 2: 2.0}, {1: 1.0, 2: 2.0, 4: 3.0})
    with pytest.raises(ValueError, match='at least 2 seed pairs'):
        paired_ratio({1: 1.0}, {1: 2.0})
    with pytest.raises(ValueError, match='finite positive'):
        paired_ratio({1: 1.0, 2: 0.0}, {1: 1.0, 2: 2.0})


# ---- time to accuracy and envelopes against NumPy ----

def _reference_envelope(points, t):
    pts = sorted(points)
    times = np.array([p[0] for p in pts], dtype=np.float64)
    best = np.maximum.accumulate(np.array([p[1] for p in pts], dtype=np.float64))
    return float(np.interp(t, times, best))


def _reference_tta(points, target):
    "Bisection on the (non-decreasing) NumPy-interpolated envelope."
    times = sorted(p[0] for p in points)
    lo, hi = times[0], times[-1]
    if _reference_envelope(points, lo) >= target: return lo
    if _reference_envelope(points, hi) < target: return math.inf
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _reference_envelope(points, mid) < target else (lo, mid)
    return hi


point_lists = st.lists(st.tuples(st.floats(1.0, 1000.0), st.floats(0.0, 100.0)), min_size=1, max_size=8,
                       unique_by=lambda p: round(p[0], 3))


@given(points=point_lists, target=st.floats(0.0, 100.0))
@settings(max_examples=300, deadline=None)
def test_time_to_accuracy_matches_bisection_reference(points, target):
    got, how = time_to_accuracy_detail(points, target)
    want = _reference_tta(points, target)
    if math.isinf(want):
        assert math.isinf(got) and how == 'not reached'
    else:
        assert got == pytest.approx(want, rel=1e-9, abs=1e-7)


@given(points=point_lists, frac=st.floats(0.0, 1.0))
@settings(max_examples=300, deadline=None)
def test_envelope_matches_numpy_interp(points, frac):
    times = [p[0] for p in points]
    t = min(max(times), min(times) + frac * (max(times) - min(times)))
    assert envelope_at(points, t) == pytest.approx(_reference_envelope(points, t), rel=1e-12, abs=1e-9)


def test_frontier_is_running_max_in_time_order():
    pts = [(3.0, 5.0), (1.0, 4.0), (2.0, 3.0), (4.0, 6.0)]
    assert running_max_frontier(pts) == [(1.0, 4.0), (2.0, 4.0), (3.0, 5.0), (4.0, 6.0)]


def test_target_never_reached_is_explicit():
    pts = [(10.0, 50.0), (20.0, 60.0)]
    assert time_to_accuracy(pts, 61.0) == math.inf
    arm = {1: pts, 2: [(10.0, 55.0), (20.0, 65.0)], 3: [(11.0, 55.0), (21.0, 66.0)]}
    ref = {1: [(12.0, 58.0), (22.0, 62.0)], 2: [(12.0, 58.0), (22.0, 64.0)], 3: [(12.0, 59.0), (22.0, 63.0)]}
    res = tta_ratio(arm, ref, 61.0)
    assert res.comparison is None
    assert res.not_reached == {1: ['arm']}
    assert res.arm_times[1] == math.inf and math.isfinite(res.ref_times[1])
    ok = tta_ratio({s: arm[s] for s in (2, 3)}, {s: ref[s] for s in (2, 3)}, 61.0)
    assert isinstance(ok.comparison, Comparison) and ok.comparison.n == 2
    # seed 2: arm crosses 61 at 10 + 6/10*10 = 16 s; dense at 12 + 3/6*10 = 17 s
    assert ok.arm_times[2] == pytest.approx(16.0) and ok.ref_times[2] == pytest.approx(17.0)
    assert ok.comparison.per_seed[2] == pytest.approx(16.0 / 17.0)


def test_dense_margin_outside_range_is_none_not_invented():
    dense = [(100.0, 70.0), (200.0, 74.0)]
    assert dense_margin(72.0, 150.0, dense) == pytest.approx(0.0)
    assert dense_margin(72.0, 50.0, dense) is None
    assert dense_margin(72.0, 250.0, dense) is None
    assert dense_margin(72.0, 250.0, dense, outside='clamp') == pytest.approx(-2.0)
    with pytest.raises(ValueError, match='outside the dense envelope range'):
        dense_margin(72.0, 250.0, dense, outside='error')
    with pytest.raises(ValueError, match="outside must be"):
        envelope_at(dense, 150.0, outside='extrapolate')


def test_numpy_scalars_are_accepted():
    c = paired_ratio({1: np.float32(2.0), 2: np.int64(3)}, {1: np.float64(4.0), 2: 6})
    assert c.estimate == pytest.approx(0.5)
    assert paired_difference({1: np.float64(1.0), 2: np.int32(2)}, {1: 0.5, 2: 1.5}).estimate == pytest.approx(0.5)


def test_tied_times_take_the_better_run():
    pts = [(1.0, 5.0), (2.0, 8.0), (2.0, 6.0)]
    assert envelope_at(pts, 2.0) == 8.0
    assert envelope_at(pts, 1.5) == pytest.approx(6.5)
    assert running_max_frontier(pts) == [(1.0, 5.0), (2.0, 8.0)]
    assert time_to_accuracy(pts, 7.0) == pytest.approx(1 + 2 / 3)


def test_a_zero_width_interval_is_never_called_resolved():
    from capskip.analysis.stats import NO_SPREAD, difference_label, ratio_label, t_interval
    mean, lo, hi = t_interval([0.56, 0.56])                  # seeds that all agree: the interval has no width
    assert (mean, difference_label(lo, hi)) == (0.56, NO_SPREAD)
    assert ratio_label(*t_interval([0.5, 0.5])[1:]) == NO_SPREAD
    assert difference_label(0.08, 0.42) == 'better' and ratio_label(0.5, float('inf')) == 'unresolved'
