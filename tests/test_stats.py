"""Tests for harness.stats against independent references (statsmodels, scipy, brute force)."""

from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps
from statsmodels.regression.linear_model import OLS
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import NormalIndPower

import harness.stats as hstats
from harness.stats import adjust_pvalues, compare_frame, flip_table, paired_compare


def _from_table(both_right: int, right_to_wrong: int, wrong_to_right: int, both_wrong: int, seed: int = 0):
    """Paired 0/1 arrays realising a 2x2 table, in shuffled item order."""
    ref = np.array([1] * both_right + [1] * right_to_wrong + [0] * wrong_to_right + [0] * both_wrong, float)
    quant = np.array([1] * both_right + [0] * right_to_wrong + [1] * wrong_to_right + [0] * both_wrong, float)
    order = np.random.default_rng(seed).permutation(ref.size)
    return ref[order], quant[order]


def _bootstrap_indices(rng: np.random.Generator, size: int) -> np.ndarray:
    """The documented draw: min(floor(u * size), size - 1) for size uniforms."""
    return np.minimum(np.floor(rng.random(size) * size).astype(int), size - 1)


def test_flip_table_hand_counted() -> None:
    ref = [1, 1, 1, 0, 0, 1, 0]
    quant = [1, 0, 1, 1, 0, 0, 0]
    assert flip_table(ref, quant) == {"both_right": 2, "both_wrong": 2, "right_to_wrong": 2, "wrong_to_right": 1}
    # partial credit: right means score >= 0.5
    assert flip_table([0.5, 0.49, 0.9, 0.2], [0.49, 0.5, 1.0, 0.0]) == {
        "both_right": 1, "both_wrong": 1, "right_to_wrong": 1, "wrong_to_right": 1,
    }


@pytest.mark.parametrize(
    "table",
    [(50, 10, 3, 37), (100, 0, 5, 20), (10, 7, 7, 10), (400, 31, 12, 57), (0, 1, 0, 0), (5, 25, 40, 3)],
)
def test_flip_counts_and_delta_from_the_table(table: tuple[int, int, int, int]) -> None:
    both_right, r2w, w2r, both_wrong = table
    ref, quant = _from_table(*table)
    result = paired_compare(ref, quant, n_resamples=50)
    assert (result.flips_right_to_wrong, result.flips_wrong_to_right) == (r2w, w2r)
    n = sum(table)
    assert result.flip_rate == pytest.approx((r2w + w2r) / n)
    assert result.delta == pytest.approx((w2r - r2w) / n)


def test_no_discordant_pairs_gives_p_one() -> None:
    ref, quant = _from_table(30, 0, 0, 10)
    assert paired_compare(ref, quant, n_resamples=50).delta_p == 1.0


@pytest.mark.parametrize("chunk_elements", [1 << 22, 1])
def test_item_bootstrap_matches_brute_force_loop(monkeypatch: pytest.MonkeyPatch, chunk_elements: int) -> None:
    monkeypatch.setattr(hstats.paired, "_CHUNK_ELEMENTS", chunk_elements)  # 1 -> one resample per chunk
    rng = np.random.default_rng(11)
    n, n_resamples, seed = 200, 300, 7
    ref = (rng.random(n) < 0.6).astype(float)
    quant = np.where(rng.random(n) < 0.2, 1 - ref, ref)
    result = paired_compare(ref, quant, n_resamples=n_resamples, seed=seed, ci_level=0.9)

    draws = np.random.default_rng(seed)
    flip_rates, r2w_rates = [], []
    for _ in range(n_resamples):
        idx = _bootstrap_indices(draws, n)
        r, q = ref[idx], quant[idx]
        flip_rates.append(np.mean(r != q))
        r2w_rates.append(np.mean((r == 1) & (q == 0)))
    pairs = [(result.flip_rate_ci, flip_rates), (result.right_to_wrong_ci, r2w_rates)]
    for got, samples in pairs:
        assert got == pytest.approx(tuple(np.percentile(samples, [5, 95])), abs=1e-12)


def test_cluster_bootstrap_matches_brute_force_loop() -> None:
    """The flip-rate interval with >= BOOTSTRAP_MIN_CLUSTERS clusters is the percentile cluster bootstrap."""
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 9, size=60)
    labels = np.array([f"doc{c}" for c, size in enumerate(sizes) for _ in range(size)], dtype=object)
    labels = labels[rng.permutation(labels.size)]
    n = labels.size
    ref = (rng.random(n) < 0.6).astype(float)
    quant = np.where(rng.random(n) < 0.25, 1 - ref, ref)
    result = paired_compare(ref, quant, clusters=labels, n_resamples=400, seed=5)
    assert result.n_clusters == 60

    order = list(dict.fromkeys(labels))  # clusters numbered by first appearance
    members = {label: np.flatnonzero(labels == label) for label in order}
    draws = np.random.default_rng(5)
    rates = []
    for _ in range(400):
        chosen = [order[i] for i in _bootstrap_indices(draws, len(order))]
        items = np.concatenate([members[label] for label in chosen])
        rates.append(np.mean(quant[items] != ref[items]))
    assert result.flip_rate_ci == pytest.approx(tuple(np.percentile(rates, [2.5, 97.5])), abs=1e-12)


def test_missing_cluster_labels_are_singletons() -> None:
    rng = np.random.default_rng(0)
    ref = (rng.random(80) < 0.5).astype(float)
    quant = np.where(rng.random(80) < 0.3, 1 - ref, ref)
    unclustered = paired_compare(ref, quant, n_resamples=300, seed=1)
    all_missing = paired_compare(ref, quant, clusters=[None] * 40 + [np.nan] * 40, n_resamples=300, seed=1)
    assert all_missing == unclustered


def test_item_bootstrap_close_to_scipy_paired_percentile() -> None:
    rng = np.random.default_rng(8)
    ref = (rng.random(300) < 0.65).astype(float)
    quant = np.where(rng.random(300) < 0.15, 1 - ref, ref)
    ours = paired_compare(ref, quant, n_resamples=20000, seed=1).flip_rate_ci
    theirs = sps.bootstrap(
        (ref, quant), lambda r, q, axis=-1: np.mean(q != r, axis=axis),
        paired=True, vectorized=True, n_resamples=20000, method="percentile", random_state=2,
    ).confidence_interval
    assert ours == pytest.approx((theirs.low, theirs.high), abs=0.003)


@pytest.mark.slow
def test_score_interval_coverage() -> None:
    """95% CI covers the true Δ of correlated paired binary data at close to its nominal rate."""
    rng = np.random.default_rng(2024)
    true_delta = 0.3 * 0.10 - 0.7 * 0.08  # P(w->r) P(ref wrong) - P(r->w) P(ref right)
    hits = 0
    for rep in range(300):
        ref = rng.random(400) < 0.7
        u = rng.random(400)
        quant = np.where(ref, u >= 0.08, u < 0.10)
        low, high = paired_compare(ref.astype(float), quant.astype(float), n_resamples=500, seed=rep).delta_ci
        hits += low <= true_delta <= high
    assert 0.92 <= hits / 300 <= 0.98


@pytest.mark.slow
def test_cluster_coverage_and_naive_undercoverage() -> None:
    """With flip propensity shared inside clusters, only the clustered score interval keeps its coverage."""
    rng = np.random.default_rng(7)
    n_clusters, size = 150, 8
    labels = np.repeat(np.arange(n_clusters), size)
    true_delta = (0.3 - 0.7) * 0.3 / 3.6  # Beta(0.3, 3.3) flip propensities, mean 1/12
    cluster_hits = naive_hits = 0
    for rep in range(300):
        p_r2w = rng.beta(0.3, 3.3, n_clusters)[labels]
        p_w2r = rng.beta(0.3, 3.3, n_clusters)[labels]
        ref = rng.random(labels.size) < 0.7
        u = rng.random(labels.size)
        quant = np.where(ref, u >= p_r2w, u < p_w2r).astype(float)
        low, high = paired_compare(ref.astype(float), quant, clusters=labels, n_resamples=500, seed=rep).delta_ci
        cluster_hits += low <= true_delta <= high
        low, high = paired_compare(ref.astype(float), quant, n_resamples=500, seed=rep).delta_ci
        naive_hits += low <= true_delta <= high
    assert 0.92 <= cluster_hits / 300 <= 0.98
    assert naive_hits / 300 < 0.90


def test_cluster_robust_se_matches_statsmodels_ols() -> None:
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 30, size=240)
    ref = (rng.random(240) < 0.6).astype(float)
    quant = np.where(rng.random(240) < 0.2 + 0.02 * (labels % 5), 1 - ref, ref)
    result = paired_compare(ref, quant, clusters=labels, n_resamples=50)
    fit = OLS(quant - ref, np.ones(240)).fit(cov_type="cluster", cov_kwds={"groups": labels})
    assert result.delta_se == pytest.approx(float(fit.bse[0]), rel=1e-10)
    iid = paired_compare(ref, quant, n_resamples=50)
    assert iid.delta_se == pytest.approx(np.std(quant - ref, ddof=1) / math.sqrt(240), rel=1e-12)


@pytest.mark.parametrize("binary", [True, False])
def test_margin_p_values_are_the_one_sided_tests_the_interval_inverts(binary: bool) -> None:
    rng = np.random.default_rng(9)
    n = 500
    if binary:
        ref = (rng.random(n) < 0.7).astype(float)
        quant = np.where(rng.random(n) < 0.06, 1 - ref, ref)
    else:
        ref = rng.random(n)
        quant = np.clip(ref + rng.normal(-0.002, 0.05, n), 0, 1)
    result = paired_compare(ref, quant, n_resamples=50, margin=0.02)
    test = hstats.score_test(quant - ref, np.arange(n))
    assert result.noninferiority_p == pytest.approx(test.p_greater(-0.02), rel=1e-12)
    assert result.inferiority_p == pytest.approx(test.p_less(-0.02), rel=1e-12)
    assert result.tost_p == pytest.approx(max(test.p_greater(-0.02), test.p_less(0.02)), rel=1e-12)
    # The level at which the lower bound touches -margin is the non-inferiority p-value.
    low_at_p = paired_compare(ref, quant, n_resamples=50, ci_level=1 - 2 * result.noninferiority_p).delta_ci[0]
    assert low_at_p == pytest.approx(-0.02, abs=1e-6)


def test_mde_matches_statsmodels_power() -> None:
    ref, quant = _from_table(600, 40, 25, 335)
    n = 1000
    result = paired_compare(ref, quant, n_resamples=50, margin=0.01)
    p_disc, delta = 65 / n, -15 / n
    sd = math.sqrt(p_disc - delta**2)  # McNemar normal approximation
    effect = NormalIndPower().solve_power(nobs1=n, alpha=0.05, power=0.8, ratio=0)  # one-sample z test
    assert result.mde == pytest.approx(effect * sd, rel=1e-4)
    assert paired_compare(ref, quant, n_resamples=50).n_needed is None  # no margin


def test_zero_discordance_floor() -> None:
    ref, quant = _from_table(140, 0, 0, 60)
    result = paired_compare(ref, quant, n_resamples=50, margin=0.05)
    assert result.delta_se == pytest.approx(1 / 200)  # variance floored at 1/n
    z_sum = sps.norm.ppf(0.975) + sps.norm.ppf(0.8)
    assert result.mde == pytest.approx(z_sum / 200)


@pytest.mark.parametrize(
    ("table", "margin", "verdict"),
    [
        ((3500, 0, 0, 1500), 0.01, "equivalent within 1.0 pt"),  # identical, large n
        ((3400, 50, 50, 1500), 0.01, "equivalent within 1.0 pt"),
        ((300, 100, 5, 95), 0.01, "worse beyond 1.0 pt"),  # quant much worse: CI beyond the margin
        ((2600, 152, 104, 1144), 0.01, "worse"),  # significant drop, not shown non-inferior
        ((1400, 44, 56, 500), 0.01, "non-inferior within 1.0 pt"),  # gain not significant, not bounded
        ((300, 5, 100, 95), 0.01, "better"),
        ((7, 1, 0, 2), 0.01, "inconclusive"),  # tiny n
        ((7, 0, 0, 3), 0.01, "inconclusive"),  # tiny n, identical
        ((300, 5, 2, 193), 0.005, "inconclusive"),
        ((3500, 0, 0, 1500), None, "no detectable change"),
        ((300, 100, 5, 95), None, "worse"),
        ((300, 5, 100, 95), None, "better"),
        ((3, 4, 0, 3), None, "no detectable change"),  # 4 of 4 flips one way in 10 items: t_9 p = 0.077
    ],
)
def test_verdicts(table: tuple[int, int, int, int], margin: float | None, verdict: str) -> None:
    ref, quant = _from_table(*table)
    assert paired_compare(ref, quant, margin=margin, n_resamples=1000).verdict == verdict


def test_margin_label_formatting() -> None:
    ref, quant = _from_table(3500, 0, 0, 1500)
    assert paired_compare(ref, quant, margin=0.005, n_resamples=50).verdict == "equivalent within 0.5 pt"
    assert paired_compare(ref, quant, margin=0.0025, n_resamples=50).verdict == "equivalent within 0.25 pt"


def test_single_cluster_gives_no_verdict_and_nan_intervals() -> None:
    ref, quant = _from_table(2, 8, 0, 0)
    result = paired_compare(ref, quant, clusters=["doc"] * 10, margin=0.01, n_resamples=50)
    assert result.n_clusters == 1
    assert math.isnan(result.delta_se) and math.isnan(result.tost_p)
    assert all(math.isnan(bound) for bound in (*result.delta_ci, *result.flip_rate_ci))
    assert result.ci_method == "none"
    assert result.verdict == "too few clusters"  # was "inconclusive" before min_clusters existed


def test_partial_credit_scores() -> None:
    rng = np.random.default_rng(5)
    ref = rng.random(400)
    quant = np.clip(ref - 0.1 + rng.normal(0, 0.02, 400), 0, 1)
    result = paired_compare(ref, quant, n_resamples=500)
    assert result.delta == pytest.approx(np.mean(quant) - np.mean(ref))
    assert result.delta_ci[1] < 0
    assert result.verdict == "worse"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ref": [1, 0, 1], "quant": [1, 0]}, "same items"),
        ({"ref": [1, 0, 2], "quant": [1, 0, 1]}, r"ref\[2\] = 2.0"),
        ({"ref": [1, 0, 1], "quant": [1, np.nan, 1]}, r"quant\[1\]"),
        ({"ref": [1, 0, 1], "quant": [1, 0, 1], "margin": 1.5}, "margin=1.5"),
        ({"ref": [1, 0, 1], "quant": [1, 0, 1], "clusters": [1, 2]}, "one label per item"),
    ],
)
def test_bad_inputs_raise_with_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        paired_compare(**kwargs)


@pytest.mark.parametrize(("method", "reference"), [("holm", "holm"), ("bh", "fdr_bh")])
def test_adjust_pvalues_matches_statsmodels(method: str, reference: str) -> None:
    p = np.array([0.01, 0.04, 0.03, 0.2, 0.001, 0.04, 0.9, 0.5])
    expected = multipletests(p, method=reference)[1]
    np.testing.assert_allclose(adjust_pvalues(p, method), expected, rtol=1e-12)
    with_nans = np.insert(p, [0, 3, 8], np.nan)
    adjusted = adjust_pvalues(with_nans, method)
    assert np.isnan(adjusted[[0, 4, 10]]).all()
    np.testing.assert_allclose(adjusted[~np.isnan(with_nans)], expected, rtol=1e-12)


def test_adjust_pvalues_none_and_errors() -> None:
    np.testing.assert_array_equal(adjust_pvalues([0.2, np.nan], "none"), [0.2, np.nan])
    assert np.isnan(adjust_pvalues([np.nan], "holm")).all()
    with pytest.raises(ValueError, match="1.2"):
        adjust_pvalues([0.1, 1.2])
    with pytest.raises(ValueError, match="bonferroni"):
        adjust_pvalues([0.1], "bonferroni")  # type: ignore[arg-type]


def _item_frame(seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    n = 600
    frame = pd.DataFrame({
        "slice": rng.choice(["math", "code", "long"], n),
        "sub_slice": rng.choice(["easy", "hard"], n),
        "cluster": rng.integers(0, 60, n),
        "correct_ref": (rng.random(n) < 0.7).astype(int),
    })
    frame["correct_quant"] = np.where(rng.random(n) < 0.1, 1 - frame["correct_ref"], frame["correct_ref"])
    return frame


def test_compare_frame_rows_columns_and_correction() -> None:
    frame = _item_frame()
    out = compare_frame(frame, by=["slice", "sub_slice"], n_resamples=200, margin=0.02, correction="bh")
    assert len(out) == 6
    expected_columns = {"delta_ci_low", "delta_ci_high", "flip_rate_ci_low", "delta_p_adj", "verdict", "n_needed"}
    assert expected_columns <= set(out.columns)
    np.testing.assert_allclose(out["delta_p_adj"], multipletests(out["delta_p"], method="fdr_bh")[1])
    row = out[(out["slice"] == "math") & (out["sub_slice"] == "hard")].iloc[0]
    group = frame[(frame["slice"] == "math") & (frame["sub_slice"] == "hard")]
    assert row["n"] == len(group)
    assert row["n_clusters"] == group["cluster"].nunique()
    assert row["delta"] == pytest.approx(group["correct_quant"].mean() - group["correct_ref"].mean())


def test_compare_frame_does_not_depend_on_group_order_or_other_groups() -> None:
    frame = _item_frame()
    columns = lambda out: out.drop(columns=["slice", "delta_p_adj"]).reset_index(drop=True)  # noqa: E731
    math_rows = lambda out: columns(out[out["slice"] == "math"])  # noqa: E731
    full = compare_frame(frame, by=["slice"], n_resamples=200)
    alone = compare_frame(frame[frame["slice"] == "math"], by=["slice"], n_resamples=200)
    renamed = frame.assign(slice=frame["slice"].replace({"code": "zz_code", "long": "a_long"}))
    reordered = compare_frame(renamed, by=["slice"], n_resamples=200)  # math is now the middle group
    pd.testing.assert_frame_equal(math_rows(full), math_rows(alone))
    pd.testing.assert_frame_equal(math_rows(full), math_rows(reordered))
    reseeded = compare_frame(frame, by=["slice"], n_resamples=200, seed=1)
    assert not np.allclose(reseeded["flip_rate_ci_low"], full["flip_rate_ci_low"])  # the bootstrap's seed
    np.testing.assert_allclose(reseeded["delta_ci_low"], full["delta_ci_low"])  # Δ's interval has none


def test_compare_frame_missing_cluster_column_names_the_fix() -> None:
    frame = _item_frame().drop(columns="cluster")
    with pytest.raises(ValueError, match="cluster_col=None"):
        compare_frame(frame, by=["slice"])
    out = compare_frame(frame, by=["slice"], cluster_col=None, n_resamples=100)
    assert (out["n_clusters"] == out["n"]).all()


def test_ten_thousand_items_is_fast() -> None:
    rng = np.random.default_rng(0)
    ref = (rng.random(10_000) < 0.7).astype(float)
    quant = np.where(rng.random(10_000) < 0.05, 1 - ref, ref)
    start = time.perf_counter()
    paired_compare(ref, quant, n_resamples=2000)
    assert time.perf_counter() - start < 10.0
