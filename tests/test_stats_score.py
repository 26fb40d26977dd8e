"""The one inference of harness.stats (the clustered paired score test) against independent references:
a numerical restricted MLE, statsmodels' McNemar test, exact enumeration of the paired multinomial,
a pandas computation of the cluster-robust null variance, and (hypothesis) the promise that no
verdict or p-value contradicts the interval shown beside it."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import optimize
from scipy import stats as sps
from statsmodels.stats.contingency_tables import mcnemar

from harness.stats import paired_compare
from harness.stats.score import effective_clusters, restricted_loss, score_interval, score_test, score_z


def _table_arrays(both_right: int, right_to_wrong: int, wrong_to_right: int, both_wrong: int):
    ref = np.array([1] * both_right + [1] * right_to_wrong + [0] * wrong_to_right + [0] * both_wrong, float)
    quant = np.array([1] * both_right + [0] * right_to_wrong + [1] * wrong_to_right + [0] * both_wrong, float)
    return ref, quant


def _numeric_loss(delta: float, gains: float, losses: float, n: float) -> float:
    """Restricted MLE by direct maximisation of the trinomial likelihood (independent of the closed form)."""
    ties = n - gains - losses
    lower, upper = max(0.0, -delta) + 1e-13, min(1.0, (1 - delta) / 2) - 1e-13

    def negative_loglik(q: float) -> float:
        total = 0.0
        for count, prob in ((gains, q + delta), (losses, q), (ties, 1 - 2 * q - delta)):
            if count:
                total -= count * math.log(prob)
        return total

    return float(optimize.minimize_scalar(negative_loglik, bounds=(lower, upper), method="bounded",
                                          options={"xatol": 1e-13}).x)


def _tango_z(delta: float, gains: float, losses: float, n: float) -> float:
    """Tango's (1998) statistic from the numerical MLE."""
    q = _numeric_loss(delta, gains, losses, n)
    return (gains - losses - n * delta) / math.sqrt(n * (2 * q + delta * (1 - delta)))


def test_restricted_mle_matches_numerical_maximisation() -> None:
    rng = np.random.default_rng(0)
    for _ in range(400):
        n = int(rng.integers(5, 400))
        gains = int(rng.integers(0, n // 2 + 1))
        losses = int(rng.integers(0, n - gains + 1))
        delta = float(rng.uniform(-0.95, 0.95))
        if min(1.0, (1 - delta) / 2) - max(0.0, -delta) < 1e-6:
            continue
        assert restricted_loss(delta, gains, losses, n) == pytest.approx(_numeric_loss(delta, gains, losses, n),
                                                                          abs=2e-6)


@pytest.mark.parametrize("table", [(50, 10, 3, 37), (100, 0, 5, 20), (10, 7, 7, 10), (400, 31, 12, 57), (5, 25, 40, 3)])
def test_delta_p_is_mcnemars_score_test_without_clusters(table: tuple[int, int, int, int]) -> None:
    """At δ = 0 the statistic is (n01 - n10) / sqrt(n01 + n10); referred to t_{n-1} (≈ normal for large n)."""
    ref, quant = _table_arrays(*table)
    result = paired_compare(ref, quant, n_resamples=20)
    chi2 = mcnemar(np.array([[table[0], table[1]], [table[2], table[3]]]), exact=False, correction=False).statistic
    n = sum(table)
    expected = 2 * sps.t.sf(math.sqrt(chi2), n - 1)
    assert result.delta_p == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("table", [(80, 0, 0, 20), (60, 1, 0, 39), (300, 12, 5, 183), (20, 9, 2, 9), (2, 25, 0, 3)])
def test_interval_inverts_tangos_statistic(table: tuple[int, int, int, int]) -> None:
    """Bounds = roots of Tango's Z(δ) = ±t (found by brentq on the numerical-MLE statistic)."""
    ref, quant = _table_arrays(*table)
    n, gains, losses = sum(table), table[2], table[1]
    result = paired_compare(ref, quant, n_resamples=20, ci_level=0.9)
    critical = sps.t.ppf(0.95, n - 1)
    estimate = (gains - losses) / n
    low = optimize.brentq(lambda d: _tango_z(d, gains, losses, n) - critical, -1 + 1e-9, estimate) \
        if estimate > -1 + 1e-9 else -1.0
    high = optimize.brentq(lambda d: _tango_z(d, gains, losses, n) + critical, estimate, 1 - 1e-9) \
        if estimate < 1 - 1e-9 else 1.0
    assert result.delta_ci == pytest.approx((low, high), abs=1e-5)


def _exact_pass_rate(n: int, p_gain: float, p_loss: float, margin: float, alpha: float = 0.05) -> float:
    """P(lower bound of the 1 - 2α interval > -margin) summed over every trinomial outcome (B, C)."""
    gains, losses = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = gains + losses <= n
    gains, losses = gains[valid].astype(float), losses[valid].astype(float)
    prob = sps.multinomial.pmf(np.stack([gains, losses, n - gains - losses], axis=1), n,
                               [p_gain, p_loss, 1 - p_gain - p_loss])
    passes = score_z(-margin, gains, losses, n) > sps.t.ppf(1 - alpha, n - 1)
    return float(prob[passes].sum())


@pytest.mark.parametrize(("n", "p_gain", "p_loss", "margin"), [
    (30, 0.0, 0.05, 0.05), (60, 0.02, 0.07, 0.05), (100, 0.0, 0.04, 0.04), (100, 0.05, 0.09, 0.04),
    (200, 0.0, 0.02, 0.02), (200, 0.04, 0.06, 0.02), (150, 0.1, 0.15, 0.05),
])
def test_exact_false_pass_rate_at_the_margin(n: int, p_gain: float, p_loss: float, margin: float) -> None:
    """Exact size (no simulation) of the non-inferiority claim at Δ = -margin, unclustered 0/1 data.

    The statistic is asymptotic; the tolerance 0.012 above α is the stated allowance for the
    discreteness of small trinomial tables (the old Wald rule exceeded α by up to 0.058 here:
    10.8 % at n = 100, one-way flips, as issue 19 measured)."""
    assert p_gain - p_loss == pytest.approx(-margin)
    assert _exact_pass_rate(n, p_gain, p_loss, margin) <= 0.05 + 0.012


def test_clustered_statistic_matches_a_groupby_computation() -> None:
    """Z = Tango's statistic over the design effect computed independently (pandas groupby, CR1 / iid)."""
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 12, size=150)
    ref = (rng.random(150) < 0.7).astype(float)
    quant = np.where(rng.random(150) < 0.05 + 0.03 * (labels % 3), 1 - ref, ref)
    diffs = quant - ref
    test = score_test(diffs, pd.factorize(labels)[0])
    frame = pd.DataFrame({"g": labels, "d": diffs})
    sums = frame.groupby("g")["d"].agg(["sum", "size"])
    cr1 = 12 / 11 * float(((sums["sum"] - sums["size"] * diffs.mean()) ** 2).sum()) / 150**2
    deff = max(1.0, cr1 / (np.var(diffs, ddof=1) / 150))
    gains, losses = float((diffs > 0).sum()), float((diffs < 0).sum())
    delta = -0.03
    expected = _tango_z(delta, gains, losses, 150) / math.sqrt(deff)
    resid = sums["sum"] - sums["size"] * diffs.mean()
    dof = 11.0 if deff == 1 else min(11.0, max(1.0, float((resid**2).sum() ** 2 / (resid**4).sum())))
    assert deff > 1  # the data are built to be clustered: the effective number of clusters applies
    assert test.deff == pytest.approx(deff, rel=1e-10)
    assert test.dof == pytest.approx(dof, rel=1e-10)
    assert test.z(delta) == pytest.approx(expected, rel=1e-5)
    assert test.p_greater(delta) == pytest.approx(float(sps.t.sf(expected, dof)), rel=1e-4)


def test_effective_clusters_counts_the_clusters_the_variance_rests_on() -> None:
    """Two clusters carrying all of the residual give ν = 2 whatever G; equal residuals give G - 1 (capped);
    no residual at all (every cluster at the mean) gives G - 1; never below 1."""
    assert effective_clusters(np.r_[3.0, -3.0, np.zeros(8)]) == pytest.approx(2.0)
    assert effective_clusters(np.r_[2.0, -2.0, 2.0, -2.0, np.zeros(16)]) == pytest.approx(4.0)
    assert effective_clusters(np.tile([1.0, -1.0], 10)) == pytest.approx(19.0)
    assert effective_clusters(np.zeros(7)) == pytest.approx(6.0)
    assert effective_clusters(np.r_[5.0, np.full(9, -5.0 / 9)]) >= 1.0
    batch = effective_clusters(np.array([[3.0, -3.0, 0.0, 0.0], [1.0, -1.0, 1.0, -1.0]]))
    assert batch == pytest.approx([2.0, 3.0])


def test_unclustered_and_uninflated_slices_keep_g_minus_one_degrees_of_freedom() -> None:
    rng = np.random.default_rng(8)
    diffs = np.where(rng.random(200) < 0.05, -1.0, 0.0)
    assert score_test(diffs, np.arange(200)).dof == 199  # every item its own cluster: deff = 1
    spread = np.zeros(200)
    spread[::20] = -1.0  # one loss in each of ten clusters of 20: no inflation
    test = score_test(spread, np.repeat(np.arange(10), 20))
    assert test.deff == 1.0 and test.dof == 9


@pytest.mark.slow
def test_few_clusters_with_concentrated_flips_hold_the_false_pass_rate() -> None:
    """Issue 19's open case, by simulation: 20 clusters of 50 items, losses only, cluster loss rates
    Beta-distributed with ICC 0.05, true Δ exactly -m (m = 2 pt, reference accuracy 0.9). Passing
    on t with G - 1 degrees of freedom exceeds α (0.085 here); on the effective number of clusters
    it does not (0.044; 3,000 data sets, Monte-Carlo SE 0.004)."""
    rng = np.random.default_rng(2026)
    reps, clusters, size, margin, p_ref, rho = 3000, 20, 50, 0.02, 0.9, 0.05
    loss = margin / p_ref
    total = 1 / rho - 1
    labels = np.repeat(np.arange(clusters), size)
    rates = rng.beta(loss * total, (1 - loss) * total, size=(reps, clusters))[:, labels]
    ref_right = rng.random((reps, labels.size)) < p_ref
    diffs = -(ref_right & (rng.random((reps, labels.size)) < rates)).astype(float)
    critical_g1 = float(sps.t.ppf(0.95, clusters - 1))
    passes = passes_g1 = 0
    for row in diffs:
        test = score_test(row, labels)
        passes += test.p_greater(-margin) < 0.05
        passes_g1 += test.z(-margin) > critical_g1
    mc_se = math.sqrt(0.05 * 0.95 / reps)
    assert passes / reps <= 0.05 + 3 * mc_se
    assert passes_g1 / reps > 0.05 + 3 * mc_se  # the case is a real one: the rule before fails it


def test_clustering_widens_the_interval() -> None:
    rng = np.random.default_rng(4)
    labels = np.repeat(np.arange(20), 25)
    ref = (rng.random(500) < 0.7).astype(float)
    quant = np.where(rng.random(500) < rng.beta(0.5, 5, 20)[labels], 1 - ref, ref)
    clustered = paired_compare(ref, quant, clusters=labels, n_resamples=20).delta_ci
    plain = paired_compare(ref, quant, n_resamples=20).delta_ci
    assert clustered[0] < plain[0] and clustered[1] > plain[1]


def test_issue_19_constructed_case_no_longer_contradicts_its_interval() -> None:
    """One flip in 100 items, 4-point margin: the old rule said "equivalent" beside a CI reaching -5.5."""
    result = paired_compare(np.ones(100), np.r_[0, np.ones(99)], margin=0.04)
    assert result.delta_ci[0] < -0.04
    assert result.verdict == "inconclusive"
    assert result.noninferiority_p > 0.025


def test_n_needed_gives_eighty_percent_power_by_exact_enumeration() -> None:
    """At the n it names, with true Δ = 0 and the observed discordance, the exact power is ~80 %."""
    ref, quant = _table_arrays(600, 20, 20, 360)
    result = paired_compare(ref, quant, margin=0.02, ci_level=0.9, n_resamples=20)
    n = result.n_needed
    assert n is not None
    discordance = 40 / 1000
    gains, losses = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = gains + losses <= n
    gains, losses = gains[valid].astype(float), losses[valid].astype(float)
    prob = sps.multinomial.pmf(np.stack([gains, losses, n - gains - losses], axis=1), n,
                               [discordance / 2, discordance / 2, 1 - discordance])
    power = float(prob[score_z(-0.02, gains, losses, n) > sps.t.ppf(0.95, n - 1)].sum())
    assert 0.75 <= power <= 0.86


def test_n_needed_with_no_discordance_is_the_smallest_passing_n() -> None:
    result = paired_compare(np.ones(200), np.ones(200), margin=0.05, ci_level=0.9, n_resamples=20)
    n = result.n_needed
    assert paired_compare(np.ones(n + 1), np.ones(n + 1), margin=0.05, ci_level=0.9).delta_ci[0] > -0.05
    assert paired_compare(np.ones(n - 3), np.ones(n - 3), margin=0.05, ci_level=0.9).delta_ci[0] <= -0.05


def test_a_slice_at_the_margin_cannot_be_settled_by_more_items() -> None:
    ref, quant = _table_arrays(300, 12, 0, 88)  # Δ = -3 pt against a 2-point margin
    result = paired_compare(ref, quant, margin=0.02)
    assert result.settleable is False and result.n_needed is None


def test_partial_credit_uses_fractional_flips() -> None:
    ref = np.array([1.0, 0.5, 0.75, 0.0] * 25)
    quant = np.array([0.75, 0.5, 0.75, 0.25] * 25)
    test = score_test(quant - ref, np.arange(100))
    assert (test.gains, test.losses) == pytest.approx((6.25, 6.25))
    low, high = test.interval(0.95)
    assert low < 0 < high


def test_vectorised_interval_matches_scalar() -> None:
    gains, losses, n = np.array([0.0, 3, 10]), np.array([5.0, 3, 0]), np.array([100.0, 50, 80])
    low, high = score_interval(gains, losses, n, 1.96)
    for i in range(3):
        one = score_interval(gains[i], losses[i], n[i], 1.96)
        assert (float(low[i]), float(high[i])) == pytest.approx((float(one[0]), float(one[1])), abs=1e-12)


@st.composite
def _paired_data(draw):
    n = draw(st.integers(2, 120))
    partial = draw(st.booleans())
    if partial:
        levels = st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0])
    else:
        levels = st.sampled_from([0.0, 1.0])
    ref = np.array(draw(st.lists(levels, min_size=n, max_size=n)))
    quant = np.array(draw(st.lists(levels, min_size=n, max_size=n)))
    clustered = draw(st.booleans())
    clusters = np.array(draw(st.lists(st.integers(0, draw(st.integers(1, 12))), min_size=n, max_size=n))) \
        if clustered else None
    margin = draw(st.sampled_from([0.01, 0.02, 0.05, 0.1, 0.3]))
    level = draw(st.sampled_from([0.8, 0.9, 0.95]))
    return ref, quant, clusters, margin, level


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_paired_data())
def test_no_verdict_or_p_value_contradicts_the_interval(data) -> None:
    ref, quant, clusters, margin, level = data
    result = paired_compare(ref, quant, clusters=clusters, margin=margin, ci_level=level, n_resamples=10,
                            min_clusters=1)
    if result.n_clusters < 2:
        assert result.ci_method == "none" and math.isnan(result.delta_ci[0])
        return
    low, high = result.delta_ci
    tail = (1 - level) / 2
    assert low <= result.delta <= high
    verdict = result.verdict
    if verdict.startswith("worse beyond"):
        assert high < -margin
    elif verdict.startswith("equivalent"):
        assert -margin < low and high < margin
    elif verdict == "better":
        assert low > 0
    elif verdict.startswith("non-inferior"):
        assert low > -margin
    elif verdict == "worse":
        assert high < 0 and low <= -margin
    else:
        assert verdict == "inconclusive" and low <= -margin <= high and not (high < 0)

    def agrees(p: float, excluded: bool) -> bool:  # p < tail ⇔ the bound excludes; ties at rounding skipped
        return abs(p - tail) < 1e-7 or (p < tail) == excluded

    assert agrees(result.noninferiority_p, low > -margin)
    assert agrees(result.inferiority_p, high < -margin)
    assert abs(result.delta_p - 2 * tail) < 1e-7 or (result.delta_p < 2 * tail) == (low > 0 or high < 0)
