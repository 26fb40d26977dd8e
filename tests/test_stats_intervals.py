"""Tests of the small-G / few-event intervals against published values and statsmodels."""

from __future__ import annotations

import math

import numpy as np
import pytest
from statsmodels.regression.linear_model import OLS
from statsmodels.stats.proportion import proportion_confint

from harness.stats import paired_compare
from harness.stats.intervals import clustered_variance, newcombe_paired, wilson

Z95 = 1.959963984540054


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        # Newcombe (1998), Stat Med 17:2635, Table II, method 10: (e, f, g, h), d = (f - g) / n
        ((36, 12, 2, 0), (0.0569, 0.3404)),
        ((18, 12, 2, 18), (0.0562, 0.3290)),
        ((53, 0, 0, 1), (-0.0729, 0.0729)),  # no discordant pair: not [0, 0]
        ((0, 30, 0, 0), (0.8395, 1.0)),
        # Fagerland, Lydersen & Laake, "Statistical Analysis of Contingency Tables" ch. 8:
        # complete response before/after consolidation therapy (Cavo et al. 2012)
        ((59, 6, 16, 80), (-0.1186, -0.0046)),
    ],
)
def test_newcombe_paired_matches_published_values(table: tuple[int, int, int, int], expected) -> None:
    low, high = newcombe_paired(*table, z=Z95)
    assert (low, high) == pytest.approx(expected, abs=6e-5)


@pytest.mark.parametrize("total", [1, 7, 40, 333])
def test_wilson_matches_statsmodels(total: int) -> None:
    for successes in sorted({0, 1, total // 3, total - 1, total}):
        expected = proportion_confint(successes, total, alpha=0.05, method="wilson")
        assert wilson(successes, total, Z95) == pytest.approx(expected, abs=1e-12)
    assert wilson(0, total, Z95)[0] == 0.0 and wilson(total, total, Z95)[1] == 1.0  # exact ends


def test_clustered_variance_matches_statsmodels() -> None:
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 12, 200)
    values = rng.normal(size=200) + 0.5 * rng.normal(size=12)[codes]
    fit = OLS(values, np.ones(200)).fit(cov_type="cluster", cov_kwds={"groups": codes})
    assert clustered_variance(codes, values) == pytest.approx(float(fit.bse[0]) ** 2, rel=1e-10)
    assert math.isnan(clustered_variance(np.zeros(5, dtype=int), values[:5]))


def _cluster_t_interval(diffs: np.ndarray, codes: np.ndarray) -> tuple[float, float]:
    fit = OLS(diffs, np.ones(diffs.size)).fit(cov_type="cluster", cov_kwds={"groups": codes}, use_t=True)
    low, high = fit.conf_int(alpha=0.05)[0]
    return float(low), float(high)


def test_partial_credit_small_g_interval_is_no_narrower_than_the_cluster_t_interval() -> None:
    """The score interval (null-centred variances) is at least as wide as the Wald t interval on CR1."""
    rng = np.random.default_rng(2)
    codes = np.repeat(np.arange(8), rng.integers(2, 9, 8))
    ref = rng.uniform(0.2, 0.8, codes.size)
    quant = np.clip(ref + rng.normal(-0.03, 0.05, 8)[codes] + rng.normal(0, 0.05, codes.size), 0, 1)
    result = paired_compare(ref, quant, clusters=codes, n_resamples=100)
    low, high = _cluster_t_interval(quant - ref, codes)
    assert result.delta_ci[0] <= low + 1e-9 and result.delta_ci[1] >= high - 1e-9


def test_many_items_per_cluster_approach_the_cluster_t_interval() -> None:
    """With many items per cluster and many flips the score interval behaves like Δ ± t_{G-1} SE_CR1."""
    rng = np.random.default_rng(3)
    n_clusters, size = 30, 200
    codes = np.repeat(np.arange(n_clusters), size)
    ref = rng.random(codes.size) < 0.6
    flip = rng.uniform(0.05, 0.35, n_clusters)[codes]
    quant = np.where(rng.random(codes.size) < flip, ~ref, ref)
    result = paired_compare(ref.astype(float), quant.astype(float), clusters=codes, n_resamples=100)
    low, high = _cluster_t_interval(quant.astype(float) - ref, codes)
    width = high - low
    assert result.delta_ci[0] == pytest.approx(low, abs=0.1 * width)
    assert result.delta_ci[1] == pytest.approx(high, abs=0.1 * width)


def test_no_discordant_pair_is_not_a_zero_width_interval() -> None:
    """Issue 12: a 10-item sub-slice with no discordant pair showed Δ +0.000 [+0.000, +0.000]."""
    ref = np.array([1, 1, 0, 1, 0, 0, 1, 1, 1, 0], float)
    result = paired_compare(ref, ref.copy(), clusters=np.arange(10) // 2, n_resamples=200)
    published_low, published_high = newcombe_paired(5, 0, 0, 5, Z95)  # same table, no clustering
    low, high = result.delta_ci
    assert low < published_low < 0 < published_high < high  # wider: 5 clusters, t with 4 dof
    assert result.flip_rate_ci[0] == 0.0 and result.flip_rate_ci[1] > 0.2
