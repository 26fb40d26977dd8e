"""Paired comparison of a quantized model with its reference on the same items (``paired_compare``).

Both models answer the same items, so every comparison here is *paired*: the unit of
inference is the item (or the cluster of items that share a source), never the two
accuracies separately.

Scores are per-item values in [0, 1]: 0/1 correctness or a partial-credit score. An item
counts as "right" when its score is >= 0.5 (``RIGHT_THRESHOLD``); flips and flip rates use
that thresholded view, Δ and everything decided about it use the raw scores.

**One inference for Δ.** The interval of Δ (``delta_ci``, at ``ci_level``), the p-value of
"no change" (``delta_p``), the non-inferiority, inferiority and equivalence p-values at a
margin, and the verdict all come from the clustered score test of ``harness.stats.score``
(Tango's paired score test, clustered by its design effect, t on G - 1 degrees of freedom).
The verdict is read off the displayed interval and nothing else; each one-sided claim is made
at level (1 - ci_level) / 2, and its p-value is below that level exactly when the interval
says so. ``ci_method`` is ``"score"`` (``"none"`` with fewer than 2 clusters).

Flip-rate intervals (descriptive; no verdict reads them): the percentile of a paired cluster
bootstrap where it is reliable (at least ``BOOTSTRAP_MIN_CLUSTERS`` clusters, of which at
least ``BOOTSTRAP_MIN_EVENT_CLUSTERS`` hold an off-mode value), else Wilson's score interval
on the Korn–Graubard effective size (``harness.stats.intervals``).

Verdict labels (``PairedResult.verdict``), with ``lo, hi`` the displayed interval of Δ:

with fewer than ``min_clusters`` clusters (default ``MIN_CLUSTERS`` = 5)
    ``"too few clusters"``, whatever the data.
without a margin
    ``"worse"`` hi < 0; ``"better"`` lo > 0; otherwise ``"no detectable change"``.
with a margin m (shown in points, 0.01 -> "1.0 pt"), first match wins
    1. ``"worse beyond m pt"``: hi < -m (the whole interval lies beyond the margin);
    2. ``"equivalent within m pt"``: -m < lo and hi < m;
    3. ``"better"``: lo > 0 (equivalence not shown: the gain may exceed m);
    4. ``"non-inferior within m pt"``: lo > -m;
    5. ``"worse"``: hi < 0 (a drop, but whether it exceeds m is open);
    6. ``"inconclusive"``.

Strata (``strata``; ``harness.stats.strata``). A stratum is a cell the slice enumerates on purpose, a
cluster a group of items drawn at random together. With strata the score statistic weights each
stratum by its share of the slice and takes the variance within strata; the design effect, the
degrees of freedom and ``n_clusters`` come from the clusters alone. Without strata (or with one)
every number is the unstratified one, to the last bit. ``ci_method`` is ``"none"`` when the clusters
leave no residual degree of freedom (G - K < 1; without strata: fewer than 2 clusters).

``delta_se`` is the cluster-robust (CR1, within strata) SE of Δ (descriptive; floored at 1/n when the
variance is 0). Power, for planning: with p_d the discordance (mean |d|) and deff the design
effect, ``mde = (z_{1-a} + z_{0.8}) * sqrt(max(p_d - Δ^2, 1/n) * deff / n)`` (a = (1 - ci_level) / 2:
the drop a two-sided test at ci_level detects with 80 % power), and with a margin
``n_needed`` is the number of items for 80 % power of the non-inferiority claim if the true Δ
were 0 at the observed discordance and design effect: ``n = deff * ((z_{1-a} σ0 + z_{0.8} σ1) / m)^2``,
σ1² = p_d, σ0² the score test's null variance at Δ = -m. It is None when Δ̂ <= -m
(``settleable`` False: no number of items shows non-inferiority of a slice observed at or
beyond the margin).

NaN, by design and only here: with fewer than 2 clusters ``delta_se``, every ``*_ci``,
``delta_p``, ``mde`` and (with a margin) the margin p-values are NaN and ``n_needed`` is None.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields
from typing import Any, Literal, TypedDict

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike
from scipy import stats as sps

from harness.stats.intervals import clustered_variance, effective_scale, wilson
from harness.stats.multiple import adjust_pvalues
from harness.stats.score import ScoreTest, restricted_loss, score_test
from harness.stats.strata import cluster_variance, estimable_strata, stratum_codes
from harness.stats.verdict import verdict_label

__all__ = [
    "BOOTSTRAP_MIN_CLUSTERS",
    "BOOTSTRAP_MIN_EVENT_CLUSTERS",
    "MIN_CLUSTERS",
    "RIGHT_THRESHOLD",
    "PairedResult",
    "ratio_of_means",
    "adjust_pvalues",
    "compare_frame",
    "flip_table",
    "noninferiority_items",
    "paired_compare",
]

RIGHT_THRESHOLD = 0.5
POWER = 0.8
MIN_CLUSTERS = 5  # default min_clusters: fewer clusters give the verdict "too few clusters"
BOOTSTRAP_MIN_CLUSTERS = 51  # up to 50 clusters the percentile bootstrap under-covers (bench_coverage); flip rates only
BOOTSTRAP_MIN_EVENT_CLUSTERS = 10  # clusters holding an off-mode value, for the bootstrap to be used
_CHUNK_ELEMENTS = 1 << 22  # resample draws held in memory at once (~32 MB of float64)


@dataclass(frozen=True)
class PairedResult:
    """Paired comparison of one model pair on one set of items (see module docstring)."""

    n: int
    acc_ref: float
    acc_quant: float
    delta: float  # acc_quant - acc_ref
    delta_ci: tuple[float, float]  # the clustered score interval at ci_level: every claim about Δ reads it
    ci_level: float
    delta_se: float  # cluster-robust SE of delta (descriptive), zero-variance floor applied
    delta_p: float  # two-sided p of H0 Δ = 0 from the same score test (McNemar's score test for 0/1, no clusters)
    design_effect: float  # CR1 / iid variance of Δ within strata, floored at 1 (the clusters' inflation only)
    flips_right_to_wrong: int  # n10: ref right, quant wrong
    flips_wrong_to_right: int  # n01: ref wrong, quant right
    flip_rate: float
    flip_rate_ci: tuple[float, float]
    right_to_wrong_rate: float
    right_to_wrong_ci: tuple[float, float]
    wrong_to_right_rate: float
    wrong_to_right_ci: tuple[float, float]
    n_clusters: int
    margin: float | None
    noninferiority_p: float | None  # H0: delta <= -margin (small: non-inferior)
    inferiority_p: float | None  # H0: delta >= -margin (small: worse beyond the margin)
    tost_p: float | None  # max of the two one-sided p-values of equivalence within ±margin
    verdict: str
    mde: float
    n_needed: int | None  # items for 80 % power of non-inferiority if the true Δ were 0 (module docstring)
    settleable: bool | None  # with a margin: False when Δ̂ <= -margin (no number of items shows non-inferiority)
    ci_method: str  # score | none (module docstring)
    n_strata: int = 1  # strata the items were declared in (1: none); n_clusters counts random clusters only
    # G - K + 1: the clusters left once each stratum's mean is taken out (K: connected components of the
    # cluster-stratum graph; n_clusters without strata). gate.min_clusters_pass counts these.
    n_clusters_within: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Flat dict of plain Python values; each ``x_ci`` pair becomes ``x_ci_low``/``x_ci_high``."""
        out: dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, tuple):
                out[f"{field.name}_low"], out[f"{field.name}_high"] = float(value[0]), float(value[1])
            else:
                out[field.name] = value
        return out


def _as_scores(values: ArrayLike, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one score per item), got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name} is empty: pass at least one item")
    bad = ~np.isfinite(array) | (array < 0) | (array > 1)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{name}[{first}] = {float(array[first])!r} is not a score in [0, 1]; drop items that were "
            "not scored and map correctness to 0/1"
        )
    return array


def cluster_codes(clusters: ArrayLike | None, n: int) -> np.ndarray:
    """Integer cluster ids 0..G-1, numbered by first appearance; missing labels become
    singleton clusters numbered after the labelled ones, in item order."""
    if clusters is None:
        return np.arange(n)
    labels = np.asarray(clusters, dtype=object)
    if labels.shape != (n,):
        raise ValueError(f"clusters has shape {labels.shape}, expected ({n},): one label per item")
    codes, uniques = pd.factorize(labels)
    missing = codes < 0
    codes[missing] = len(uniques) + np.arange(int(missing.sum()))
    return codes.astype(np.int64)


def _bootstrap_means(codes: np.ndarray, values: np.ndarray, n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Means of each column of ``values`` over ``n_resamples`` cluster resamples.

    Resample b draws G cluster ids as ``min(floor(u * G), G - 1)`` from ``G`` uniforms
    ``rng.random`` (row b of one (n_resamples, G) draw, taken in chunks; uniforms consume
    the stream identically however they are chunked). The mean is the ratio of the summed
    values to the summed sizes of the drawn clusters.
    """
    n_clusters = int(codes.max()) + 1
    sums = np.stack([np.bincount(codes, weights=col, minlength=n_clusters) for col in values.T], axis=1)
    sizes = np.bincount(codes, minlength=n_clusters).astype(float)
    out = np.empty((n_resamples, values.shape[1]))
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // n_clusters)
    for start in range(0, n_resamples, rows_per_chunk):
        rows = min(rows_per_chunk, n_resamples - start)
        picks = np.minimum((rng.random((rows, n_clusters)) * n_clusters).astype(np.int64), n_clusters - 1)
        picks += np.arange(rows)[:, None] * n_clusters
        counts = np.bincount(picks.ravel(), minlength=rows * n_clusters).reshape(rows, n_clusters).astype(float)
        out[start : start + rows] = (counts @ sums) / (counts @ sizes)[:, None]
    return out


def _clustered_se(codes: np.ndarray, diffs: np.ndarray) -> float:
    """CR1 cluster-robust SE of the mean of ``diffs`` with the zero-variance floor 1/n; NaN
    with fewer than 2 clusters. "Zero" allows for rounding (flips that cancel in a cluster
    leave residual sums of ~1e-17 when the mean is not a binary fraction)."""
    variance = clustered_variance(codes, diffs)
    if math.isnan(variance):
        return math.nan
    return 1.0 / diffs.size if _variance_is_zero(codes, diffs) else math.sqrt(variance)


def _stratified_se(codes: np.ndarray, strata: np.ndarray, diffs: np.ndarray) -> float:
    """Cluster-robust SE of Δ within strata (``harness.stats.strata``), floored at 1/n like the unstratified one."""
    variance = cluster_variance(diffs, codes, strata)
    if math.isnan(variance):
        return math.nan
    return 1.0 / diffs.size if math.sqrt(variance) <= 1e-9 / diffs.size else math.sqrt(variance)


def _variance_is_zero(codes: np.ndarray, diffs: np.ndarray) -> bool:
    """Whether the CR1 variance of the mean is 0 up to rounding (NaN, < 2 clusters: False)."""
    return bool(math.sqrt(clustered_variance(codes, diffs)) <= 1e-9 / diffs.size)


def _bootstrap_reliable(codes: np.ndarray, values: np.ndarray) -> bool:
    """Whether the percentile bootstrap of the mean of ``values`` is used (module docstring)."""
    n_clusters = int(codes.max()) + 1
    if n_clusters < BOOTSTRAP_MIN_CLUSTERS:
        return False
    levels, counts = np.unique(values, return_counts=True)
    off_mode = values != levels[int(np.argmax(counts))]
    return np.unique(codes[off_mode]).size >= BOOTSTRAP_MIN_EVENT_CLUSTERS


def _bracket(interval: tuple[float, float], estimate: float) -> tuple[float, float]:
    """The interval widened, if need be, to hold its point estimate (a percentile interval
    of a ratio estimator can miss it in pathological cluster layouts)."""
    return min(interval[0], estimate), max(interval[1], estimate)


def flip_table(ref: ArrayLike, quant: ArrayLike) -> dict[str, int]:
    """Counts of the 2x2 paired table; an item is right when its score >= 0.5."""
    ref_right = _as_scores(ref, "ref") >= RIGHT_THRESHOLD
    quant_right = _as_scores(quant, "quant") >= RIGHT_THRESHOLD
    if ref_right.size != quant_right.size:
        raise ValueError(f"ref has {ref_right.size} items but quant has {quant_right.size}: pass the same items")
    return {
        "both_right": int(np.sum(ref_right & quant_right)),
        "both_wrong": int(np.sum(~ref_right & ~quant_right)),
        "right_to_wrong": int(np.sum(ref_right & ~quant_right)),
        "wrong_to_right": int(np.sum(~ref_right & quant_right)),
    }


class _FlipFields(TypedDict):
    """The ``PairedResult`` fields of the flips: counts, rates and their descriptive intervals."""

    flips_right_to_wrong: int
    flips_wrong_to_right: int
    flip_rate: float
    flip_rate_ci: tuple[float, float]
    right_to_wrong_rate: float
    right_to_wrong_ci: tuple[float, float]
    wrong_to_right_rate: float
    wrong_to_right_ci: tuple[float, float]


class _DeltaFields(TypedDict):
    """The ``PairedResult`` fields of Δ: the estimate, what the score test says about it, and its power."""

    delta: float
    delta_ci: tuple[float, float]
    delta_se: float
    delta_p: float
    design_effect: float
    mde: float
    ci_method: str
    n_strata: int
    n_clusters_within: int


class _MarginFields(TypedDict):
    """The ``PairedResult`` fields a margin enables (all None without one)."""

    margin: float | None
    noninferiority_p: float | None
    inferiority_p: float | None
    tost_p: float | None
    n_needed: int | None
    settleable: bool | None


def _paired_scores(ref: ArrayLike, quant: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """The two models' scores as float arrays, checked to be scores of the same number of items."""
    ref_scores = _as_scores(ref, "ref")
    quant_scores = _as_scores(quant, "quant")
    if quant_scores.size != ref_scores.size:
        raise ValueError(
            f"ref has {ref_scores.size} items but quant has {quant_scores.size}: pass the same items in the same order"
        )
    return ref_scores, quant_scores


def _check_options(ci_level: float, n_resamples: int, margin: float | None, min_clusters: int) -> None:
    """Raise ValueError, naming the value, for the first of ``paired_compare``'s options out of its range."""
    if not 0 < ci_level < 1:
        raise ValueError(f"ci_level={ci_level!r} must lie in (0, 1), e.g. 0.95")
    if int(n_resamples) != n_resamples or n_resamples < 1:
        raise ValueError(f"n_resamples={n_resamples!r} must be a positive integer, e.g. 2000")
    if margin is not None and not 0 < margin < 1:
        raise ValueError(f"margin={margin!r} must lie in (0, 1) as a fraction of accuracy (0.01 = 1 point) or be None")
    if isinstance(min_clusters, bool) or int(min_clusters) != min_clusters or min_clusters < 1:
        raise ValueError(f"min_clusters={min_clusters!r} must be a positive integer, e.g. {MIN_CLUSTERS}")


def _flip_rate_intervals(
    codes: np.ndarray, per_item: np.ndarray, n_resamples: int, ci_level: float, seed: int
) -> list[tuple[float, float]]:
    """The descriptive ``ci_level`` interval of the mean of each column of ``per_item``: the percentile
    of a paired cluster bootstrap where it is reliable, else Wilson's on the effective size; NaN with
    fewer than 2 clusters (module docstring)."""
    tail = (1 - ci_level) / 2
    if int(codes.max()) + 1 < 2:
        return [(math.nan, math.nan)] * per_item.shape[1]
    z = float(sps.norm.ppf(1 - tail))
    boot = _bootstrap_means(codes, per_item, n_resamples, np.random.default_rng(seed))
    low, high = np.quantile(boot, [tail, 1 - tail], axis=0)
    estimates = per_item.mean(axis=0)
    intervals = []
    for j in range(per_item.shape[1]):
        if _bootstrap_reliable(codes, per_item[:, j]):
            intervals.append(_bracket((float(low[j]), float(high[j])), float(estimates[j])))
        else:
            scale = effective_scale(codes, per_item[:, j], ci_level)
            intervals.append(wilson(float(per_item[:, j].sum()) * scale, per_item.shape[0] * scale, z))
    return intervals


def _flip_fields(
    ref_scores: np.ndarray, quant_scores: np.ndarray, codes: np.ndarray, n_resamples: int, ci_level: float, seed: int
) -> _FlipFields:
    """The flips (an item is right when its score >= ``RIGHT_THRESHOLD``): right -> wrong, wrong -> right
    and either, counted, as rates of the items, and with their intervals (``_flip_rate_intervals``)."""
    ref_right = ref_scores >= RIGHT_THRESHOLD
    quant_right = quant_scores >= RIGHT_THRESHOLD
    right_to_wrong = ref_right & ~quant_right
    wrong_to_right = ~ref_right & quant_right
    per_item = np.column_stack([right_to_wrong | wrong_to_right, right_to_wrong, wrong_to_right]).astype(float)
    flip_ci, right_to_wrong_ci, wrong_to_right_ci = _flip_rate_intervals(codes, per_item, n_resamples, ci_level, seed)
    n, n10, n01 = ref_scores.size, int(right_to_wrong.sum()), int(wrong_to_right.sum())
    return _FlipFields(
        flips_right_to_wrong=n10,
        flips_wrong_to_right=n01,
        flip_rate=(n10 + n01) / n,
        flip_rate_ci=flip_ci,
        right_to_wrong_rate=n10 / n,
        right_to_wrong_ci=right_to_wrong_ci,
        wrong_to_right_rate=n01 / n,
        wrong_to_right_ci=wrong_to_right_ci,
    )


def _minimum_detectable_effect(test: ScoreTest, delta: float, discordance: float, n: int, ci_level: float) -> float:
    """``mde``: the drop a two-sided test at ``ci_level`` detects with 80 % power (module docstring); NaN
    when the score test is not testable."""
    if not test.testable:
        return math.nan
    z = float(sps.norm.ppf(1 - (1 - ci_level) / 2))
    spread = max(discordance - delta * delta, 1.0 / n)
    return (z + float(sps.norm.ppf(POWER))) * math.sqrt(spread * test.deff / n)


def _delta_fields(
    test: ScoreTest, diffs: np.ndarray, codes: np.ndarray, layers: np.ndarray | None, ci_level: float
) -> _DeltaFields:
    """Δ (the mean of ``diffs``) with the one inference about it, the clustered score ``test``: its
    interval at ``ci_level`` and p-value of no change; with the descriptive SE, the design effect, the
    ``mde`` and the strata and clusters the test counted."""
    delta = float(diffs.mean())
    return _DeltaFields(
        delta=delta,
        delta_ci=test.interval(ci_level),
        delta_se=_clustered_se(codes, diffs) if test.n_strata == 1 else _stratified_se(codes, layers, diffs),
        delta_p=test.p_two_sided(0.0),
        design_effect=test.deff,
        mde=_minimum_detectable_effect(test, delta, float(np.abs(diffs).mean()), diffs.size, ci_level),
        ci_method="score" if test.testable else "none",
        n_strata=test.n_strata,
        n_clusters_within=test.n_clusters - test.components + 1,
    )


def _margin_fields(test: ScoreTest, diffs: np.ndarray, margin: float | None, ci_level: float) -> _MarginFields:
    """The margin p-values of the score ``test`` (non-inferiority, inferiority, equivalence), whether
    non-inferiority can be shown (``settleable``) and the items for 80 % power to show it (``n_needed``)."""
    if margin is None:
        return _MarginFields(margin=None, noninferiority_p=None, inferiority_p=None, tost_p=None, n_needed=None,
                             settleable=None)
    noninferiority_p = test.p_greater(-margin)
    settleable = bool(float(diffs.mean()) > -margin)
    n_needed: int | None = None
    if settleable and test.testable:
        n_needed = noninferiority_items(float(np.abs(diffs).mean()), test.deff, margin, (1 - ci_level) / 2)
    return _MarginFields(
        margin=float(margin),
        noninferiority_p=noninferiority_p,
        inferiority_p=test.p_less(-margin),
        tost_p=max(noninferiority_p, test.p_less(margin)),
        n_needed=n_needed,
        settleable=settleable,
    )


def paired_compare(
    ref: ArrayLike,
    quant: ArrayLike,
    *,
    clusters: ArrayLike | None = None,
    strata: ArrayLike | None = None,
    n_resamples: int = 2000,
    ci_level: float = 0.95,
    seed: int = 0,
    margin: float | None = None,
    min_clusters: int = MIN_CLUSTERS,
) -> PairedResult:
    """Compare per-item scores of the quantized model (``quant``) with the reference (``ref``).

    ``clusters`` (one label per item; missing labels are singletons) makes the inference count
    whole clusters, for items that share a source [Miller 2024]. ``strata`` (one label per item; None:
    one stratum) are the cells the slice enumerates on purpose: Δ's variance is then the within-stratum
    one, strata weighted by their share of the slice (``harness.stats.strata``); clusters are counted
    inside them and alone make the design effect. Without strata every number is the unstratified one.
    Δ's interval, p-values and
    verdict come from the clustered score test at ``ci_level`` (module docstring): a one-sided
    claim is made at (1 - ci_level) / 2, so ``ci_level=0.90`` decides at α = 0.05.
    ``margin`` (e.g. 0.01 = 1 point of accuracy) enables the non-inferiority, inferiority and
    equivalence claims and ``n_needed``. ``n_resamples`` and ``seed`` drive the bootstrap of the
    (descriptive) flip-rate intervals only. With fewer than ``min_clusters`` clusters the
    verdict is ``"too few clusters"``.
    """
    ref_scores, quant_scores = _paired_scores(ref, quant)
    _check_options(ci_level, n_resamples, margin, min_clusters)
    n = ref_scores.size
    codes = cluster_codes(clusters, n)
    layers = None if strata is None else estimable_strata(stratum_codes(strata, n), codes)
    n_clusters = int(codes.max()) + 1
    diffs = quant_scores - ref_scores

    flips = _flip_fields(ref_scores, quant_scores, codes, int(n_resamples), ci_level, seed)
    test = score_test(diffs, codes, layers)  # Δ: the one inference (harness.stats.score)
    delta = _delta_fields(test, diffs, codes, layers, ci_level)
    lo, hi = delta["delta_ci"]
    verdict = verdict_label(lo=lo, hi=hi, n_clusters=n_clusters, min_clusters=int(min_clusters), margin=margin)
    return PairedResult(
        n=n,
        acc_ref=float(ref_scores.mean()),
        acc_quant=float(quant_scores.mean()),
        ci_level=float(ci_level),
        n_clusters=n_clusters,
        verdict=verdict,
        **flips,
        **delta,
        **_margin_fields(test, diffs, margin, ci_level),
    )


def noninferiority_items(discordance: float, design_effect: float, margin: float, level: float) -> int:
    """Items for 80 % power of the one-sided level-``level`` non-inferiority score test at ``margin``
    when the true Δ is 0 with discordance ``discordance`` (mean |d|) and design effect ``design_effect``
    (normal approximation; the critical value is t_{n-1} at the n found, by fixed-point iteration)."""
    half = discordance / 2
    null_loss = float(restricted_loss(-margin, half, half, 1.0))
    sigma0 = math.sqrt(max(2 * null_loss - margin * (1 + margin), 0.0))
    sigma1 = math.sqrt(discordance)
    z_power = float(sps.norm.ppf(POWER))
    critical = float(sps.norm.ppf(1 - level))
    n = 2
    for _ in range(20):
        n_new = max(2, int(math.ceil(design_effect * ((critical * sigma0 + z_power * sigma1) / margin) ** 2)))
        critical = float(sps.t.ppf(1 - level, n_new - 1))
        if n_new == n:
            break
        n = n_new
    return n


def _group_seed(seed: int, by: list[str], key: tuple) -> int:
    """A seed that depends only on (seed, group key), never on the order of the groups."""
    plain = [value.item() if isinstance(value, np.generic) else value for value in key]
    text = f"{seed}|" + "|".join(f"{col}={value!r}" for col, value in zip(by, plain))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def compare_frame(
    df: pd.DataFrame,
    *,
    by: list[str],
    ref_col: str = "correct_ref",
    quant_col: str = "correct_quant",
    cluster_col: str | None = "cluster",
    stratum_col: str | None = None,
    n_resamples: int = 2000,
    seed: int = 0,
    margin: float | None = None,
    correction: Literal["holm", "bh", "none"] = "holm",
    ci_level: float = 0.95,
    min_clusters: int = MIN_CLUSTERS,
) -> pd.DataFrame:
    """One ``paired_compare`` row per group of ``by`` (flattened via ``PairedResult.to_dict``).

    ``delta_p_adj`` (H0 Δ = 0) is corrected across all rows of the returned frame. Each group's
    bootstrap seed is derived from ``(seed, group key)``. Verdicts read each row's own interval
    (unadjusted); groups with fewer than ``min_clusters`` clusters get the verdict ``"too few clusters"``.
    ``stratum_col`` names the column of each item's stratum (``paired_compare``'s ``strata``; None: none).
    To get an overall row, add a constant column and group by it.
    """
    if correction not in ("holm", "bh", "none"):
        raise ValueError(f"correction={correction!r} is unknown; use 'holm', 'bh' or 'none'")
    if isinstance(by, str):
        by = [by]
    by = list(by)
    if not by:
        raise ValueError("by is empty: name at least one column, e.g. by=['slice']")
    needed = [*by, ref_col, quant_col] + ([cluster_col] if cluster_col is not None else []) + (
        [stratum_col] if stratum_col is not None else [])
    missing = [col for col in needed if col not in df.columns]
    if missing:
        hint = " (pass cluster_col=None for unclustered items)" if cluster_col in missing else ""
        raise ValueError(f"columns {missing} not in the frame (has {list(df.columns)}){hint}")
    if df.empty:
        raise ValueError("df has no rows: nothing to compare")
    rows = []
    for key, group in df.groupby(by, sort=True, observed=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        result = paired_compare(
            group[ref_col].to_numpy(),
            group[quant_col].to_numpy(),
            clusters=None if cluster_col is None else group[cluster_col].to_numpy(dtype=object),
            strata=None if stratum_col is None else group[stratum_col].to_numpy(dtype=object),
            n_resamples=n_resamples,
            ci_level=ci_level,
            seed=_group_seed(seed, by, key),
            margin=margin,
            min_clusters=min_clusters,
        )
        rows.append({**dict(zip(by, key)), **result.to_dict()})
    frame = pd.DataFrame(rows)
    frame.insert(
        frame.columns.get_loc("delta_p") + 1, "delta_p_adj", adjust_pvalues(frame["delta_p"], correction)
    )
    return frame


def cluster_sums(ref: Any, cand: Any, clusters: Any) -> tuple[float, np.ndarray | None, np.ndarray | None]:
    """(sum(cand) / sum(ref), each cluster's sum of ref, of cand): what a paired ratio of means and its interval are
    made of; the sums are None where the ratio is undefined (no reference mass) or there is one cluster only."""
    ref, cand = np.asarray(ref, dtype=float), np.asarray(cand, dtype=float)
    if ref.size == 0 or ref.sum() <= 0:
        return math.nan, None, None
    estimate = float(cand.sum() / ref.sum())
    codes = cluster_codes(clusters, ref.size)
    groups = int(codes.max()) + 1
    if groups < 2:
        return estimate, None, None
    return (estimate, np.bincount(codes, weights=ref, minlength=groups),
            np.bincount(codes, weights=cand, minlength=groups))


def ratio_of_means(ref: np.ndarray, cand: np.ndarray, clusters: Any, *, n_resamples: int = 2000,
                   ci_level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(sum(cand) / sum(ref), percentile interval of a paired cluster bootstrap); NaN where undefined.

    Whole clusters are drawn with replacement, the same draw for both sides (the pairing), and the ratio of
    the drawn sums is taken each time."""
    estimate, ref_sums, cand_sums = cluster_sums(ref, cand, clusters)
    if ref_sums is None or cand_sums is None:
        return estimate, math.nan, math.nan
    groups = len(ref_sums)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, groups, size=(n_resamples, groups))
    counts = np.zeros((n_resamples, groups))
    np.add.at(counts, (np.repeat(np.arange(n_resamples), groups), picks.ravel()), 1.0)
    denominators = counts @ ref_sums
    ratios = np.where(denominators > 0, (counts @ cand_sums) / np.where(denominators > 0, denominators, 1), np.nan)
    ratios = ratios[np.isfinite(ratios)]
    tail = (1 - ci_level) / 2
    return estimate, float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1 - tail))
