"""Property-based tests of harness.stats on generated adversarial inputs (hypothesis).

Whatever the scores and clusters, the statistics must not raise and must be finite and
coherent; NaN is allowed only where the module docstring documents it (fewer than 2
clusters). The shapes that broke it before: flips cancelling inside every cluster (a zero
cluster-robust SE with non-zero item differences), one cluster, all-equal scores, n = 1.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from harness.stats import MIN_CLUSTERS, compare_frame, paired_compare

VERDICTS = {"worse", "better", "no detectable change", "inconclusive", "too few clusters"}
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def paired_items(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, list[int] | None]:
    """Scores (0/1, partial credit, or all equal) and optional cluster labels for 1-40 items."""
    n = draw(st.integers(1, 40))
    kind = draw(st.sampled_from(["binary", "partial", "equal", "binary_rare_flips"]))
    if kind == "partial":
        score = st.floats(0, 1, allow_nan=False, allow_subnormal=False)
        ref = np.array(draw(st.lists(score, min_size=n, max_size=n)))
        quant = np.array(draw(st.lists(score, min_size=n, max_size=n)))
    else:
        ref = np.array(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n)))
        if kind == "equal":
            quant = ref.copy()
        elif kind == "binary_rare_flips":
            flipped = draw(st.lists(st.integers(0, n - 1), max_size=2))
            quant = ref.copy()
            quant[flipped] = 1 - quant[flipped]
        else:
            quant = np.array(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n)))
    clusters = draw(st.one_of(st.none(), st.lists(st.integers(0, draw(st.integers(0, 8))), min_size=n, max_size=n)))
    return ref, quant, clusters


def _cancelling_pairs(n_clusters: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """One right->wrong and one wrong->right flip in every cluster: CR1 variance exactly 0."""
    ref = np.tile([1.0, 0.0, 1.0], n_clusters)
    quant = np.tile([0.0, 1.0, 1.0], n_clusters)
    return ref, quant, list(np.repeat(np.arange(n_clusters), 3))


def _check(result, margin: float | None, min_clusters: int = MIN_CLUSTERS) -> None:
    few = result.n_clusters < 2
    intervals = [result.delta_ci, result.flip_rate_ci, result.right_to_wrong_ci, result.wrong_to_right_ci]
    points = [result.delta, result.flip_rate, result.right_to_wrong_rate, result.wrong_to_right_rate]
    for (low, high), point, floor in zip(intervals, points, [-1.0, 0.0, 0.0, 0.0]):
        if few:
            assert math.isnan(low) and math.isnan(high)
            continue
        assert math.isfinite(low) and math.isfinite(high)
        assert floor - 1e-12 <= low <= point + 1e-12 and point - 1e-12 <= high <= 1 + 1e-12
    for value in (result.n, result.acc_ref, result.acc_quant, result.delta, result.flip_rate):
        assert math.isfinite(value)
    assert math.isnan(result.delta_p) if few else 0 <= result.delta_p <= 1
    if few:
        assert math.isnan(result.delta_se) and math.isnan(result.mde) and result.n_needed is None
        assert result.ci_method == "none"
    else:
        assert math.isfinite(result.delta_se) and result.delta_se > 0
        assert math.isfinite(result.mde) and result.mde > 0
        assert result.ci_method == "score"
    if margin is not None:
        for p in (result.noninferiority_p, result.inferiority_p, result.tost_p):
            assert math.isnan(p) if few else 0 <= p <= 1
        if result.settleable and not few:
            assert isinstance(result.n_needed, int) and result.n_needed >= 1
        else:
            assert result.n_needed is None
    allowed = VERDICTS if margin is None else VERDICTS | {
        f"equivalent within {100 * margin:.1f} pt", f"non-inferior within {100 * margin:.1f} pt",
        f"worse beyond {100 * margin:.1f} pt"}
    assert result.verdict in allowed
    assert (result.verdict == "too few clusters") == (result.n_clusters < min_clusters)


@pytest.mark.slow
@SETTINGS
@given(items=paired_items(), margin=st.sampled_from([None, 0.01, 0.05]), level=st.sampled_from([0.8, 0.95]))
@example(items=(np.array([1.0]), np.array([0.0]), None), margin=0.01, level=0.95)  # n = 1
@example(items=(np.ones(12), np.ones(12), [0] * 12), margin=0.01, level=0.95)  # one cluster, all equal
@example(items=_cancelling_pairs(6), margin=0.02, level=0.95)  # the ZeroDivisionError of issue 12
@example(items=_cancelling_pairs(30), margin=0.02, level=0.95)
def test_statistics_are_finite_and_coherent(items, margin: float | None, level: float) -> None:
    ref, quant, clusters = items
    _check(paired_compare(ref, quant, clusters=clusters, margin=margin, ci_level=level, n_resamples=200), margin)


@pytest.mark.parametrize("n_clusters", [2, 6, 40])
def test_flips_cancelling_in_every_cluster_floor_the_se(n_clusters: int) -> None:
    ref, quant, clusters = _cancelling_pairs(n_clusters)
    result = paired_compare(ref, quant, clusters=clusters, margin=0.02, n_resamples=200)
    n = ref.size
    assert result.delta == 0 and result.delta_se == pytest.approx(1 / n)  # floor, as if one discordant pair
    assert result.ci_method == "score"  # a bootstrap would be [0, 0]
    low, high = result.delta_ci
    assert low < -1 / n and high > 1 / n


@pytest.mark.slow
@SETTINGS
@given(items=paired_items(), min_clusters=st.integers(1, 12))
def test_min_clusters_decides_too_few_clusters(items, min_clusters: int) -> None:
    ref, quant, clusters = items
    result = paired_compare(ref, quant, clusters=clusters, n_resamples=100, min_clusters=min_clusters)
    _check(result, None, min_clusters)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(items=paired_items(), groups=st.integers(1, 3))
def test_compare_frame_keeps_n_clusters_and_never_raises(items, groups: int) -> None:
    ref, quant, clusters = items
    frame = pd.DataFrame({"slice": np.arange(ref.size) % groups, "correct_ref": ref, "correct_quant": quant,
                          "cluster": clusters if clusters is not None else np.arange(ref.size)})
    out = compare_frame(frame, by=["slice"], n_resamples=100, margin=0.02)
    expected = frame.groupby("slice")["cluster"].nunique().to_numpy()
    np.testing.assert_array_equal(out["n_clusters"].to_numpy(), expected)
    assert set(out["verdict"]) <= VERDICTS | {"equivalent within 2.0 pt", "non-inferior within 2.0 pt",
                                              "worse beyond 2.0 pt"}


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_min_clusters_names_the_value(bad) -> None:
    with pytest.raises(ValueError, match=f"min_clusters={bad!r}"):
        paired_compare([1, 0, 1], [1, 0, 0], min_clusters=bad)
