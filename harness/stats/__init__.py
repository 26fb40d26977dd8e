"""Paired statistics for comparing a quantized model with its reference on the same items.

Both models answer the same items, so every comparison here is *paired*: the unit of
resampling is the item (or the cluster of items that share a source), never the two
accuracies separately. An unpaired test on paired data throws away the correlation
between the two models and gives needlessly wide intervals.

Scores are per-item values in [0, 1]: 0/1 correctness or a partial-credit score. An item
counts as "right" when its score is >= 0.5 (``RIGHT_THRESHOLD``); flips, flip rates and
McNemar's test use that thresholded view, Δ and its interval use the raw scores.

Intervals (``PairedResult.ci_method`` says which one Δ got; the flip-rate intervals follow
the same rule with Wilson in place of Newcombe):

``"bootstrap"``
    percentile interval of a paired cluster bootstrap, used when it is reliable: at least
    ``BOOTSTRAP_MIN_CLUSTERS`` (51) clusters, and at least ``BOOTSTRAP_MIN_EVENT_CLUSTERS``
    (10) clusters holding an item whose value differs from the most common one (for Δ of
    0/1 scores: a discordant pair; for a flip rate: a flip, or a non-flip if flips are the
    majority), and a non-zero cluster-robust SE for Δ.
``"newcombe"``
    otherwise, for 0/1 scores: Newcombe's hybrid score interval for a paired difference on
    the 2x2 table scaled to the Korn–Graubard effective size (``harness.stats.intervals``):
    it stays wide with no discordant pair (n = 54, none discordant: ±0.073) and widens like
    a t interval with G - 1 degrees of freedom when clusters are few.
``"t"``
    otherwise, for partial-credit scores: Δ ± t_{G-1} * SE (SE below), clipped to [-1, 1].
``"none"``
    fewer than 2 clusters: nothing about between-cluster variation can be estimated, so
    every interval is (NaN, NaN).
The coverage of the reported intervals for G = 5..50, with few and no flips, is measured by
``benchmarks/bench_coverage.py`` (results in ``benchmarks/results/coverage.json``).

Verdict labels (``PairedResult.verdict``), with ``lo, hi`` the CI of Δ and "significant"
meaning the CI excludes 0 *and*, for 0/1 scores, McNemar's exact p < alpha (for
partial-credit scores the CI alone decides):

with fewer than ``min_clusters`` clusters (default ``MIN_CLUSTERS`` = 5)
    ``"too few clusters"``, whatever the data: with 2-4 clusters neither the bootstrap nor a
    t interval on G - 1 degrees of freedom supports a claim.
without a margin
    ``"worse"`` significant drop; ``"better"`` significant gain; otherwise
    ``"no detectable change"``.
with a margin m (shown in points, 0.01 -> "1.0 pt"), first match wins
    1. ``"worse"``: significant drop with hi < -m (the whole CI lies beyond the margin);
    2. ``"equivalent within m pt"``: both one-sided tests of TOST reject at alpha;
    3. ``"worse"``: significant drop and the non-inferiority test does not reject;
    4. ``"better"``: significant gain (equivalence not shown: the gain may exceed m);
    5. ``"non-inferior within m pt"``: H0 Δ <= -m rejected at alpha;
    6. ``"inconclusive"``.

Standard error of Δ: the cluster-robust (CR1) sandwich SE of a mean,
``sqrt(G/(G-1) * Σ_g (Σ_{i∈g} (d_i - d̄))^2) / n``, which reduces to ``s/sqrt(n)`` (ddof=1)
when every item is its own cluster. The TOST statistics use a t distribution with G-1
degrees of freedom (this matches ``statsmodels`` ``ttost_paired`` without clusters).

Zero-variance floor: when the cluster-robust variance is 0 — all per-item differences are
identical (e.g. no discordant pair), or flips cancel inside every cluster — it would claim
infinite precision. The SE is then floored at 1/n, as if one discordant pair had been seen.

Power: with d_i = quant_i - ref_i the per-item SD is ``sqrt(mean(d^2) - Δ^2)``, which for
0/1 scores is McNemar's ``sqrt(p_disc - Δ^2)`` (p_disc = discordant fraction). Clustering
inflates it by the design effect deff = SE_cluster^2 / SE_iid^2 (1 when all d_i are equal).
Then ``mde = (z_{1-α/2} + z_{0.8}) * sd * sqrt(deff / n)`` and
``n_needed = ceil(((z_{1-α/2} + z_{0.8}) * sd * sqrt(deff) / margin)^2)``.

NaN, by design and only here: with fewer than 2 clusters ``delta_se``, every ``*_ci``,
``mde`` and (with a margin) ``noninferiority_p``/``tost_p`` are NaN and ``n_needed`` is None.
Everything else is always finite.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike
from scipy import stats as sps

from harness.stats.intervals import clustered_variance, effective_scale, newcombe_paired, wilson
from harness.stats.multiple import adjust_pvalues
from harness.stats.verdict import verdict_label

__all__ = [
    "BOOTSTRAP_MIN_CLUSTERS",
    "BOOTSTRAP_MIN_EVENT_CLUSTERS",
    "MIN_CLUSTERS",
    "RIGHT_THRESHOLD",
    "PairedResult",
    "adjust_pvalues",
    "compare_frame",
    "flip_table",
    "paired_compare",
]

RIGHT_THRESHOLD = 0.5
POWER = 0.8
MIN_CLUSTERS = 5  # default min_clusters: fewer clusters give the verdict "too few clusters"
BOOTSTRAP_MIN_CLUSTERS = 51  # up to 50 clusters the percentile bootstrap under-covers (bench_coverage)
BOOTSTRAP_MIN_EVENT_CLUSTERS = 10  # clusters holding an off-mode value, for the bootstrap to be used
_CHUNK_ELEMENTS = 1 << 22  # resample draws held in memory at once (~32 MB of float64)


@dataclass(frozen=True)
class PairedResult:
    """Paired comparison of one model pair on one set of items (see module docstring)."""

    n: int
    acc_ref: float
    acc_quant: float
    delta: float  # acc_quant - acc_ref
    delta_ci: tuple[float, float]
    ci_level: float
    delta_se: float  # cluster-robust SE of delta, zero-variance floor applied
    flips_right_to_wrong: int  # n10: ref right, quant wrong
    flips_wrong_to_right: int  # n01: ref wrong, quant right
    flip_rate: float
    flip_rate_ci: tuple[float, float]
    right_to_wrong_rate: float
    right_to_wrong_ci: tuple[float, float]
    wrong_to_right_rate: float
    wrong_to_right_ci: tuple[float, float]
    mcnemar_p: float
    n_clusters: int
    margin: float | None
    noninferiority_p: float | None  # H0: delta <= -margin
    tost_p: float | None  # max of the two one-sided p-values
    verdict: str
    mde: float
    n_needed: int | None
    ci_method: str  # how delta_ci was computed: bootstrap | newcombe | t | none (module docstring)

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


def _cluster_codes(clusters: ArrayLike | None, n: int) -> np.ndarray:
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


def paired_compare(
    ref: ArrayLike,
    quant: ArrayLike,
    *,
    clusters: ArrayLike | None = None,
    n_resamples: int = 2000,
    ci_level: float = 0.95,
    seed: int = 0,
    margin: float | None = None,
    alpha: float = 0.05,
    min_clusters: int = MIN_CLUSTERS,
) -> PairedResult:
    """Compare per-item scores of the quantized model (``quant``) with the reference (``ref``).

    ``clusters`` (one label per item; missing labels are singletons) switches the bootstrap
    and the SE to whole clusters, for items that share a source [Miller 2024]. CIs are
    percentile intervals (numpy "linear" quantiles) of a paired bootstrap seeded with
    ``np.random.default_rng(seed)`` where that is reliable, score or t intervals otherwise
    (module docstring). ``margin`` (e.g. 0.01 = 1 point of accuracy) enables the
    non-inferiority and TOST equivalence tests and ``n_needed``. With fewer than
    ``min_clusters`` clusters the verdict is ``"too few clusters"``.
    """
    ref_scores = _as_scores(ref, "ref")
    quant_scores = _as_scores(quant, "quant")
    n = ref_scores.size
    if quant_scores.size != n:
        raise ValueError(f"ref has {n} items but quant has {quant_scores.size}: pass the same items in the same order")
    if not 0 < ci_level < 1:
        raise ValueError(f"ci_level={ci_level!r} must lie in (0, 1), e.g. 0.95")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must lie in (0, 1), e.g. 0.05")
    if int(n_resamples) != n_resamples or n_resamples < 1:
        raise ValueError(f"n_resamples={n_resamples!r} must be a positive integer, e.g. 2000")
    if margin is not None and not 0 < margin < 1:
        raise ValueError(f"margin={margin!r} must lie in (0, 1) as a fraction of accuracy (0.01 = 1 point) or be None")
    if isinstance(min_clusters, bool) or int(min_clusters) != min_clusters or min_clusters < 1:
        raise ValueError(f"min_clusters={min_clusters!r} must be a positive integer, e.g. {MIN_CLUSTERS}")

    codes = _cluster_codes(clusters, n)
    n_clusters = int(codes.max()) + 1
    diffs = quant_scores - ref_scores
    ref_right = ref_scores >= RIGHT_THRESHOLD
    quant_right = quant_scores >= RIGHT_THRESHOLD
    right_to_wrong = ref_right & ~quant_right
    wrong_to_right = ~ref_right & quant_right
    flips = right_to_wrong | wrong_to_right
    n10, n01 = int(right_to_wrong.sum()), int(wrong_to_right.sum())

    binary = bool(np.all((ref_scores == 0) | (ref_scores == 1)) and np.all((quant_scores == 0) | (quant_scores == 1)))
    per_item = np.column_stack([diffs, flips, right_to_wrong, wrong_to_right]).astype(float)
    boot = _bootstrap_means(codes, per_item, int(n_resamples), np.random.default_rng(seed))
    tail = (1 - ci_level) / 2
    low, high = np.quantile(boot, [tail, 1 - tail], axis=0)
    estimates = per_item.mean(axis=0)
    ci = [_bracket((float(low[j]), float(high[j])), float(estimates[j])) for j in range(per_item.shape[1])]

    mcnemar_p = 1.0 if n10 + n01 == 0 else float(sps.binomtest(n01, n01 + n10, 0.5).pvalue)
    delta = float(diffs.mean())
    delta_se = _clustered_se(codes, diffs)

    z = float(sps.norm.ppf(1 - tail))
    ci_method = "bootstrap"
    if n_clusters < 2:
        ci = [(math.nan, math.nan)] * per_item.shape[1]
        ci_method = "none"
    else:
        for j in range(1, per_item.shape[1]):
            if not _bootstrap_reliable(codes, per_item[:, j]):
                scale = effective_scale(codes, per_item[:, j], ci_level)
                ci[j] = wilson(float(per_item[:, j].sum()) * scale, n * scale, z)
        if not _bootstrap_reliable(codes, diffs) or _variance_is_zero(codes, diffs):
            if binary:
                scale = effective_scale(codes, diffs, ci_level)
                both = float(np.sum(ref_right & quant_right))
                ci[0] = newcombe_paired(both * scale, n01 * scale, n10 * scale, (n - both - n01 - n10) * scale, z)
                ci_method = "newcombe"
            else:
                half = float(sps.t.ppf(1 - tail, n_clusters - 1)) * delta_se
                ci[0] = (max(-1.0, delta - half), min(1.0, delta + half))
                ci_method = "t"

    if n_clusters < 2:
        item_sd, design_effect = math.sqrt(float(np.var(diffs))), math.nan
    else:
        item_sd = math.sqrt(float(np.var(diffs)))
        iid_se_sq = float(np.var(diffs, ddof=1)) / n
        if iid_se_sq > 0:
            design_effect = delta_se**2 / iid_se_sq
        else:  # all differences equal: the floored SE stands in for one discordant pair
            item_sd, design_effect = math.sqrt(1.0 / n), 1.0

    z_sum = float(sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(POWER))
    mde = z_sum * item_sd * math.sqrt(design_effect / n)

    noninferiority_p = tost_p = None
    n_needed = None
    if margin is not None:
        if math.isnan(delta_se):
            noninferiority_p = tost_p = math.nan
        else:
            dof = n_clusters - 1
            noninferiority_p = float(sps.t.sf((delta + margin) / delta_se, dof))
            upper_p = float(sps.t.sf((margin - delta) / delta_se, dof))
            tost_p = max(noninferiority_p, upper_p)
        if not math.isnan(design_effect):
            n_needed = max(1, int(math.ceil((z_sum * item_sd * math.sqrt(design_effect) / margin) ** 2)))

    verdict = verdict_label(
        lo=ci[0][0], hi=ci[0][1], binary=binary, mcnemar_p=mcnemar_p, alpha=alpha, n_clusters=n_clusters,
        min_clusters=int(min_clusters), margin=margin, noninferiority_p=noninferiority_p, tost_p=tost_p,
    )
    return PairedResult(
        n=n,
        acc_ref=float(ref_scores.mean()),
        acc_quant=float(quant_scores.mean()),
        delta=delta,
        delta_ci=ci[0],
        ci_level=float(ci_level),
        delta_se=delta_se,
        flips_right_to_wrong=n10,
        flips_wrong_to_right=n01,
        flip_rate=(n10 + n01) / n,
        flip_rate_ci=ci[1],
        right_to_wrong_rate=n10 / n,
        right_to_wrong_ci=ci[2],
        wrong_to_right_rate=n01 / n,
        wrong_to_right_ci=ci[3],
        mcnemar_p=mcnemar_p,
        n_clusters=n_clusters,
        margin=None if margin is None else float(margin),
        noninferiority_p=noninferiority_p,
        tost_p=tost_p,
        verdict=verdict,
        mde=mde,
        n_needed=n_needed,
        ci_method=ci_method,
    )


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
    n_resamples: int = 2000,
    seed: int = 0,
    margin: float | None = None,
    correction: Literal["holm", "bh", "none"] = "holm",
    ci_level: float = 0.95,
    alpha: float = 0.05,
    min_clusters: int = MIN_CLUSTERS,
) -> pd.DataFrame:
    """One ``paired_compare`` row per group of ``by`` (flattened via ``PairedResult.to_dict``).

    ``mcnemar_p_adj`` is corrected across all rows of the returned frame. Each group's
    bootstrap seed is derived from ``(seed, group key)``. Verdicts use unadjusted tests;
    groups with fewer than ``min_clusters`` clusters get the verdict ``"too few clusters"``.
    To get an overall row, add a constant column and group by it.
    """
    if correction not in ("holm", "bh", "none"):
        raise ValueError(f"correction={correction!r} is unknown; use 'holm', 'bh' or 'none'")
    if isinstance(by, str):
        by = [by]
    by = list(by)
    if not by:
        raise ValueError("by is empty: name at least one column, e.g. by=['slice']")
    needed = [*by, ref_col, quant_col] + ([cluster_col] if cluster_col is not None else [])
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
            n_resamples=n_resamples,
            ci_level=ci_level,
            seed=_group_seed(seed, by, key),
            margin=margin,
            alpha=alpha,
            min_clusters=min_clusters,
        )
        rows.append({**dict(zip(by, key)), **result.to_dict()})
    frame = pd.DataFrame(rows)
    frame.insert(
        frame.columns.get_loc("mcnemar_p") + 1, "mcnemar_p_adj", adjust_pvalues(frame["mcnemar_p"], correction)
    )
    return frame
