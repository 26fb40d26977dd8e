"""harness.stats.group_sequential: spending boundaries and the group-sequential verdict against independent references.

(a) published boundaries: Lan–DeMets O'Brien–Fleming- and Pocock-type spending, K = 5 equal looks,
one-sided α = 0.025 (gsDesign ``sfLDOF`` / ``sfLDPocock``, test.type = 1; the same to 3 decimals as
the two-sided α = 0.05 tables of Jennison & Turnbull 2000, where the lower boundary's effect is
negligible), and the repeated-significance-test error of Armitage, McPherson & Rowe (1969) at an
unadjusted z = 1.96 (gsDesign's own unit test ``test.Deming.gsProb``: 0.042, 0.063, 0.097, 0.124
for K = 2, 4, 10, 20); (b) scipy's multivariate normal cdf (Genz) and a Monte-Carlo Brownian motion
at the looks; (c) K = 1; (d) the last look against the fixed score test; (e) NaN handling and rounds
against ``sequential_test``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from harness.stats import group_sequential as gs
from harness.stats.score import score_test
from harness.stats.sequential import cluster_order, sequential_test

EQUAL5 = np.arange(1, 6) / 5


# ---------------------------------------------------------------- (a) published values

def test_obrien_fleming_type_k5_one_sided_0025():
    # gsDesign(k=5, test.type=1, alpha=0.025, sfu=sfLDOF)$upper$bound
    published = [4.8769, 3.3569, 2.6803, 2.2898, 2.0310]
    assert gs.spending_boundaries(EQUAL5, 0.025, "obf") == pytest.approx(published, abs=6e-4)


def test_pocock_type_k5_one_sided_0025():
    # gsDesign(k=5, test.type=1, alpha=0.025, sfu=sfLDPocock)$upper$bound
    published = [2.4380, 2.4268, 2.4101, 2.3966, 2.3859]
    assert gs.spending_boundaries(EQUAL5, 0.025, "pocock") == pytest.approx(published, abs=6e-4)


@pytest.mark.parametrize(("looks", "error"), [(2, 0.042), (4, 0.063), (10, 0.097), (20, 0.124)])
def test_repeated_significance_tests_at_196(looks, error):
    fractions = np.arange(1, looks + 1) / looks
    total = gs.crossing_probabilities(fractions, np.full(looks, sps.norm.isf(0.025))).sum()
    assert round(float(total), 3) == error


# ---------------------------------------------------------------- (b) other computations of the same law

@pytest.mark.slow
@pytest.mark.parametrize("spending", gs.SPENDING)
def test_against_multivariate_normal_cdf(spending):
    fractions = np.array([0.2, 0.45, 0.7, 1.0])
    c = gs.spending_boundaries(fractions, 0.05, spending)
    corr = np.sqrt(np.minimum.outer(fractions, fractions) / np.maximum.outer(fractions, fractions))
    spent = gs.spending_function(fractions, 0.05, spending)
    for k in range(1, fractions.size + 1):  # P(no crossing by look k) = 1 - α(t_k)
        below = sps.multivariate_normal(mean=np.zeros(k), cov=corr[:k, :k], abseps=1e-7, releps=1e-7).cdf(c[:k])
        assert below == pytest.approx(1 - spent[k - 1], abs=1e-4)


@pytest.mark.parametrize("spending", gs.SPENDING)
def test_monte_carlo_brownian_motion(spending):
    rng = np.random.default_rng(7)
    fractions = np.array([0.15, 0.3, 0.55, 0.6, 0.85, 1.0])  # unequal, one pair close together
    alpha, paths = 0.05, 400_000
    c = gs.spending_boundaries(fractions, alpha, spending)
    steps = rng.standard_normal((paths, fractions.size)) * np.sqrt(np.diff(np.concatenate([[0.0], fractions])))
    z = np.cumsum(steps, axis=1) / np.sqrt(fractions)
    crossed = z >= c
    first = np.where(crossed.any(axis=1), crossed.argmax(axis=1), -1)
    spent = gs.spending_function(fractions, alpha, spending)
    cumulative = np.array([(first >= 0) & (first <= k) for k in range(fractions.size)]).mean(axis=1)
    se = np.sqrt(spent * (1 - spent) / paths)
    assert np.all(np.abs(cumulative - spent) <= 4 * se + 1e-6), (cumulative, spent)
    assert abs(cumulative[-1] - alpha) <= 4 * math.sqrt(alpha * (1 - alpha) / paths)


def test_crossing_probabilities_spend_exactly():
    fractions = np.array([0.1, 0.35, 0.5, 0.9, 1.0])
    c = gs.spending_boundaries(fractions, 0.01, "obf")
    increments = np.diff(gs.spending_function(np.concatenate([[0.0], fractions]), 0.01, "obf"))
    assert gs.crossing_probabilities(fractions, c) == pytest.approx(increments, rel=1e-6, abs=1e-12)


# ---------------------------------------------------------------- (c) one look, and edge cases

@pytest.mark.parametrize("spending", gs.SPENDING)
@pytest.mark.parametrize("alpha", [0.05, 0.01, 0.025 / 5])
def test_single_look_is_fixed_sample(spending, alpha):
    assert gs.spending_boundaries([1.0], alpha, spending)[0] == pytest.approx(sps.norm.isf(alpha), abs=1e-12)


def test_early_look_with_nothing_to_spend_cannot_reject():
    c = gs.spending_boundaries([0.001, 1.0], 0.05, "obf")
    assert c[0] == math.inf and c[1] == pytest.approx(sps.norm.isf(0.05), abs=1e-6)
    assert gs.nominal_levels([0.001, 1.0], 0.05)[0] == 0.0


def test_bad_fractions_rejected():
    for bad in ([0.5, 0.5, 1.0], [0.0, 1.0], [0.5, 1.2], []):
        with pytest.raises(ValueError):
            gs.spending_boundaries(bad, 0.05)


# ---------------------------------------------------------------- (d) against the fixed score test

def _slice(rng, n=600, clusters=30, loss=0.08, gain=0.08):
    codes = np.arange(n) % clusters
    diffs = (rng.random(n) < gain).astype(float) - (rng.random(n) < loss)
    return diffs, codes


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_last_look_reads_the_score_interval_at_its_nominal_level(seed):
    rng = np.random.default_rng(seed)
    diffs, codes = _slice(rng)
    result = gs.spending_test(diffs, codes, 0.02, family=5, stop=False, seed=seed)
    assert result.n == diffs.size and result.looks_items[-1] == diffs.size
    fractions = np.array(result.looks_items) / diffs.size
    level = gs.nominal_levels(fractions, 0.05)[-1]
    level_fail = gs.nominal_levels(fractions, 0.05 / 5)[-1]
    fixed = score_test(diffs, codes)
    assert result.lower == pytest.approx(fixed.interval(1 - 2 * level)[0], abs=1e-12)
    assert result.upper == pytest.approx(fixed.interval(1 - 2 * level_fail)[1], abs=1e-12)
    # the last boundary lies a little above z_{1-α}: the repeated bound is a little wider than the fixed one
    assert level < 0.05
    assert result.lower <= fixed.interval(0.9)[0] + 1e-12
    assert result.upper >= fixed.interval(1 - 2 * 0.05 / 5)[1] - 1e-12
    # and the verdict reads the p-values at the same nominal levels
    assert (result.lower > -0.02) == (fixed.p_greater(-0.02) < level)
    assert (result.upper < -0.02) == (fixed.p_less(-0.02) < level_fail)


def test_every_look_is_the_score_test_on_the_items_seen():
    rng = np.random.default_rng(11)
    diffs, codes = _slice(rng, n=400, clusters=40)
    result = gs.spending_test(diffs, codes, 0.05, stop=False, seed=3)
    order = cluster_order(codes, 3)
    levels = gs.nominal_levels(np.array(result.looks_items) / diffs.size, 0.05)
    for items, low, level in zip(result.looks_items, result.looks_lower, levels):
        clusters = order[:np.searchsorted(np.cumsum(np.bincount(codes)[order]), items) + 1]
        seen = np.isin(codes, clusters)
        _, relabelled = np.unique(codes[seen], return_inverse=True)
        assert seen.sum() == items
        assert low == pytest.approx(score_test(diffs[seen], relabelled).interval(1 - 2 * level)[0], abs=1e-12)


def test_clear_drop_in_a_clustered_slice_fails_early():
    rng = np.random.default_rng(5)
    diffs, codes = _slice(rng, n=1000, clusters=20, loss=0.3, gain=0.02)
    result = gs.spending_test(diffs, codes, 0.02, family=5)
    assert result.state == "fail" and result.n < diffs.size and result.upper < -0.02
    assert sequential_test(diffs, codes, 0.02, family=5).n == diffs.size  # betting settles nothing early here


# ---------------------------------------------------------------- (e) same rounds and NaN handling as sequential_test

@pytest.mark.slow
@pytest.mark.parametrize(("n", "clusters", "round_items"), [(300, 300, None), (500, 25, None), (90, 9, 8),
                                                             (240, 12, 50), (7, 7, None)])
def test_rounds_and_nan_like_sequential_test(n, clusters, round_items):
    rng = np.random.default_rng(n + clusters)
    codes = rng.permutation(np.arange(n) % clusters)
    diffs = (rng.random(n) < 0.1).astype(float) - (rng.random(n) < 0.1)
    for missing in (0.0, 0.3, 1.0):
        partial = diffs.copy()
        order = cluster_order(codes, 2)
        late = np.isin(codes, order[int((1 - missing) * clusters):])  # the last clusters in the order not scored
        partial[late & (rng.random(n) < 0.5)] = np.nan
        a = gs.spending_test(partial, codes, 0.05, seed=2, round_items=round_items, stop=False)
        b = sequential_test(partial, codes, 0.05, seed=2, round_items=round_items, stop=False)
        assert (a.n, a.n_clusters, a.n_total, a.clusters_total, a.looks_items) == \
               (b.n, b.n_clusters, b.n_total, b.clusters_total, b.looks_items)
        assert a.estimate == pytest.approx(b.estimate, nan_ok=True)
        assert len(a.looks_lower) == len(a.looks_upper) == len(a.looks_items)
        if not a.looks_items:
            assert (a.state, a.lower, a.upper) == ("open", -1.0, 1.0)


def test_invalid_input_like_sequential_test():
    with pytest.raises(ValueError):
        gs.spending_test(np.zeros(3), np.array([0, 2, 2]), 0.05)
    with pytest.raises(ValueError):
        gs.spending_test(np.zeros(3), np.zeros(3, dtype=int), 1.5)


# ---------------------------------------------------------------- the benchmark's vectorised copy reads the same

@pytest.mark.slow
def test_bench_sequential_spending_decisions_match_spending_test():
    import importlib.util
    import sys
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench_dir))
    try:
        spec = importlib.util.spec_from_file_location("bench_sequential_under_test", bench_dir / "bench_sequential.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(bench_dir))
    rng = np.random.default_rng(21)
    for n, clusters, rho, margin, delta in [(300, 300, 0.0, 0.05, -0.15), (1000, 20, 0.05, 0.02, -0.1),
                                            (100, 5, 0.05, 0.05, -0.05), (300, 50, 0.02, 0.05, 0.0)]:
        reps = 6
        diffs, codes = bench.simulate(rng, reps, n, clusters, rho, 0.5, *bench.rates(0.5, delta, "both", 0.3), False)
        order = np.array([cluster_order(codes, seed) for seed in range(reps)])
        out = bench.spending_decisions(order, diffs, codes, clusters, margin)
        for i in range(reps):
            ref = gs.spending_test(diffs[i], codes, margin, family=bench.SLICES, seed=i)
            assert (out["pass"][i], out["fail"][i]) == (ref.state == "pass", ref.state == "fail")
            assert out["fraction"][i] == pytest.approx(ref.fraction, abs=1e-12)
