"""The stratified, clustered score statistic (harness.stats.strata, harness.stats.score) against independent
references: bit-for-bit the unstratified test without strata, a stratified bootstrap over items (and over
clusters) within strata written here, statsmodels' cluster-robust regression on stratum indicators, and
the promise that every p-value reads the one interval."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
import statsmodels.api as sm
from scipy import stats as sps

from harness.stats import compare_frame, paired_compare, spending_test
from harness.stats.paired import cluster_codes
from harness.stats.score import score_test, score_z, stratified_z
from harness.stats.strata import cluster_variance, design, stratum_codes

LEVEL = 0.95


def _stratified_slice(rng: np.random.Generator, n: int, strata: int, concentrated: bool = True):
    """0/1 scores of a slice whose strata differ in reference accuracy (0.1 .. 0.9) and whose
    right -> wrong flips sit in the most accurate quarter of the strata (``concentrated``) or everywhere."""
    layer = np.arange(n) % strata
    accuracy = np.linspace(0.1, 0.9, strata)[layer]
    flipping = layer >= strata - max(1, strata // 4) if concentrated else np.ones(n, bool)
    ref = rng.random(n) < accuracy
    quant = ref & ~(flipping & (rng.random(n) < 0.4))
    quant |= ~ref & (rng.random(n) < 0.03)
    return ref.astype(float), quant.astype(float), layer


def test_without_strata_every_number_is_the_unstratified_one() -> None:
    rng = np.random.default_rng(1)
    for _ in range(30):
        n = int(rng.integers(20, 300))
        ref = (rng.random(n) < 0.6).astype(float)
        quant = np.where(rng.random(n) < 0.15, 1 - ref, ref)
        clusters = rng.integers(0, max(2, n // 7), n).astype(str)
        plain = paired_compare(ref, quant, clusters=clusters, margin=0.05)
        one = paired_compare(ref, quant, clusters=clusters, strata=np.full(n, "all"), margin=0.05)
        assert one.to_dict() == plain.to_dict()  # exact: not approximately
        assert plain.n_strata == 1 and plain.n_clusters_within == plain.n_clusters


def test_one_stratum_z_is_score_z_to_the_bit() -> None:
    rng = np.random.default_rng(2)
    n = rng.integers(5, 500, 200).astype(float)
    gains = np.floor(rng.random(200) * n / 2)
    losses = np.floor(rng.random(200) * (n - gains))
    delta = rng.uniform(-0.9, 0.9, 200)
    deff = rng.uniform(1, 3, 200)
    one = stratified_z(delta, gains[:, None], losses[:, None], n[:, None], deff)
    np.testing.assert_array_equal(one, score_z(delta, gains, losses, n, deff))


def _bootstrap_within_strata(rng, diffs, layer, codes, reps):
    """Δ̂ of ``reps`` resamples that draw, in each stratum, its clusters with replacement (as many as it has),
    weighting each stratum by its share of the slice (written independently of harness.stats)."""
    frame = pd.DataFrame({"d": diffs, "h": layer, "g": codes})
    sums = frame.groupby(["h", "g"])["d"].agg(["sum", "size"]).reset_index()
    n = diffs.size
    total = np.zeros(reps)
    for _, block in sums.groupby("h"):
        picks = rng.integers(0, len(block), (reps, len(block)))
        stratum_mean = block["sum"].to_numpy()[picks].sum(axis=1) / block["size"].to_numpy()[picks].sum(axis=1)
        total += stratum_mean * block["size"].sum() / n
    return total


@pytest.mark.parametrize("clustered", [False, True])
def test_interval_agrees_with_a_stratified_bootstrap(clustered: bool) -> None:
    """Half-width of the 95 % interval against t_dof x the bootstrap SE, within the bootstrap's Monte-Carlo
    error (4 SE of a standard deviation estimated from ``reps`` draws: 4 / sqrt(2 reps), relative), plus the
    small-sample factor c = (n-1)/(n-H) and G/(G-K) the statistic applies on purpose."""
    rng = np.random.default_rng(3 + clustered)
    n, strata, reps = 6000, 8, 4000
    ref, quant, layer = _stratified_slice(rng, n, strata)
    if clustered:  # 25 clusters in each stratum, sharing a cluster-level flip propensity
        codes = layer * 25 + (np.arange(n) // strata) % 25
        shock = rng.random(codes.max() + 1) < 0.3
        quant = np.where(shock[codes] & (ref == 1) & (rng.random(n) < 0.3), 0.0, quant)
    else:
        codes = np.arange(n)
    diffs = quant - ref
    test = score_test(diffs, cluster_codes(codes, n), stratum_codes(layer, n))
    low, high = test.interval(LEVEL)
    boot = _bootstrap_within_strata(rng, diffs, layer, codes, reps)
    found = design(diffs, cluster_codes(codes, n), stratum_codes(layer, n))
    factor = (n - 1) / (n - strata) if not clustered else found.n_clusters / found.free
    expected = sps.t.ppf(0.975, test.dof) * float(boot.std(ddof=1)) * math.sqrt(factor * max(test.deff, 1.0)
                                                                                 if not clustered else factor)
    assert (high - low) / 2 == pytest.approx(expected, rel=4 / math.sqrt(2 * reps))
    # ... and the unstratified statistic, with the between-strata differences, is measurably wider.
    pooled = score_test(diffs, cluster_codes(codes, n))
    pooled_low, pooled_high = pooled.interval(LEVEL)
    assert (pooled_high - pooled_low) / 2 > expected * (1 + 4 / math.sqrt(2 * reps))


def test_cluster_variance_is_statsmodels_cluster_robust_regression_on_stratum_indicators() -> None:
    """Clusters crossing strata (a parallel question asked in each language): the sandwich variance of
    Σ_h w_h β_h from statsmodels (no small-sample correction) times G/(G-K) is ours."""
    rng = np.random.default_rng(5)
    concepts, languages = 40, 6
    codes = np.repeat(np.arange(concepts), languages)
    layer = np.tile(np.arange(languages), concepts)
    keep = rng.random(codes.size) > 0.1  # some translations missing: unequal strata
    codes, layer = codes[keep], layer[keep]
    n = codes.size
    diffs = (rng.random(n) < 0.15 + 0.1 * (codes % 3 == 0)).astype(float) * -1 + (rng.random(n) < 0.05)
    dummies = np.eye(languages)[layer]
    fit = sm.OLS(diffs, dummies).fit(cov_type="cluster", cov_kwds={"groups": codes, "use_correction": False})
    weights = dummies.mean(axis=0)
    sandwich = float(weights @ fit.cov_params() @ weights)
    found = design(diffs, codes, layer)
    assert found.components == 1  # every concept joins every language
    assert cluster_variance(diffs, codes, layer) == pytest.approx(sandwich * concepts / (concepts - 1), rel=1e-10)
    # Nested clusters: one component per stratum.
    nested = design(diffs, cluster_codes(layer * concepts + codes, n), layer)
    assert nested.components == languages


def test_independent_items_in_strata_have_no_design_effect_and_count_as_clusters() -> None:
    rng = np.random.default_rng(6)
    ref, quant, layer = _stratified_slice(rng, 96, 11)
    result = paired_compare(ref, quant, strata=layer.astype(str), margin=0.05)
    assert result.design_effect == 1.0
    assert result.n_clusters == 96 and result.n_strata == 11 and result.n_clusters_within == 96 - 11 + 1
    cells_as_clusters = paired_compare(ref, quant, clusters=layer.astype(str), margin=0.05)
    assert cells_as_clusters.n_clusters == 11  # what the slices declared before issue 37


def test_every_p_value_reads_the_stratified_interval() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        n = int(rng.integers(40, 400))
        ref, quant, layer = _stratified_slice(rng, n, int(rng.integers(2, 12)), bool(rng.integers(2)))
        codes = rng.integers(0, max(3, n // 4), n)
        test = score_test(quant - ref, cluster_codes(codes, n), stratum_codes(layer, n))
        low, high = test.interval(0.9)
        assert test.p_greater(low) == pytest.approx(0.05, abs=1e-9)
        assert test.p_less(high) == pytest.approx(0.05, abs=1e-9)
        grid = np.linspace(-0.99, 0.99, 199)
        z = [test.z(float(d)) for d in grid]
        assert all(a >= b for a, b in itertools.pairwise(z))  # Z falls in δ: one root per bound
        for delta in grid:
            assert (test.p_greater(float(delta)) < 0.05) == (low > delta) or abs(low - delta) < 1e-9


def test_compare_frame_takes_a_stratum_column() -> None:
    rng = np.random.default_rng(8)
    ref, quant, layer = _stratified_slice(rng, 200, 5)
    frame = pd.DataFrame({"slice": "s", "correct_ref": ref, "correct_quant": quant,
                          "cluster": np.arange(200).astype(str), "stratum": layer.astype(str)})
    row = compare_frame(frame, by=["slice"], stratum_col="stratum").iloc[0]
    direct = paired_compare(ref, quant, clusters=np.arange(200).astype(str), strata=layer.astype(str))
    assert (row["delta_ci_low"], row["delta_ci_high"]) == direct.delta_ci
    assert row["n_strata"] == 5
    with pytest.raises(ValueError, match="stratum"):
        compare_frame(frame.drop(columns="stratum"), by=["slice"], stratum_col="stratum")


def test_spending_test_looks_are_stratified_score_tests() -> None:
    """The last look of a stratified group-sequential run, every item scored, is the fixed stratified
    score test read at that look's nominal level; without strata it is the unstratified one."""
    rng = np.random.default_rng(9)
    ref, quant, layer = _stratified_slice(rng, 400, 8)
    diffs = quant - ref
    codes = np.arange(400)
    result = spending_test(diffs, codes, 0.05, strata=layer, stop=False)
    plain = spending_test(diffs, codes, 0.05, stop=False)
    assert result.looks_items == plain.looks_items  # same order, same rounds
    fixed = score_test(diffs, codes, stratum_codes(layer, 400))
    level = fixed.p_greater(result.looks_lower[-1])
    assert fixed.interval(1 - 2 * level)[0] == pytest.approx(result.looks_lower[-1], abs=1e-9)
    assert result.looks_lower[-1] != plain.looks_lower[-1]


def test_strata_without_a_residual_degree_of_freedom_collapse_to_the_unstratified_interval():
    """Every item its own cluster and its own stratum (a smoke run of a few items): no within-stratum
    variance can be estimated, so the strata collapse and the interval is the unstratified one."""
    import numpy as np

    from harness.stats import paired_compare
    from harness.stats.strata import estimable_strata

    ref = np.array([1, 1, 0, 1, 0, 1], dtype=float)
    quant = np.array([0, 1, 0, 0, 1, 1], dtype=float)
    items = [f"i{k}" for k in range(6)]
    alone = paired_compare(ref, quant, clusters=items, strata=items, seed=0, n_resamples=200)
    plain = paired_compare(ref, quant, clusters=items, seed=0, n_resamples=200)
    assert np.isfinite(alone.delta_se) and alone.delta_se == plain.delta_se
    assert alone.delta_ci == plain.delta_ci and np.isfinite(alone.delta_ci).all()
    codes, layers = np.arange(6), np.array([0, 0, 0, 1, 1, 1])
    assert estimable_strata(layers, codes) is layers  # three clusters per stratum: kept
    assert estimable_strata(np.arange(6), codes) is None
