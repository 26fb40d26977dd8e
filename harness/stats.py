"""Paired statistics for comparing a quantized model with its reference on the same items.

Both models answer the same items, so every comparison here is *paired*: the unit of
resampling is the item (or the cluster of items that share a source), never the two
accuracies separately. An unpaired test on paired data throws away the correlation
between the two models and gives needlessly wide intervals.

Scores are per-item values in [0, 1]: 0/1 correctness or a partial-credit score. An item
counts as "right" when its score is >= 0.5 (``RIGHT_THRESHOLD``); flips, flip rates and
McNemar's test use that thresholded view, Δ and its interval use the raw scores.

Verdict labels (``PairedResult.verdict``), with ``lo, hi`` the bootstrap CI of Δ and
"significant" meaning the CI excludes 0 *and*, for 0/1 scores, McNemar's exact p < alpha
(for partial-credit scores the CI alone decides) *and* there are at least 2 clusters (a
bootstrap over one cluster is a single point):

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

Zero-variance floor: when all per-item differences are identical (e.g. no discordant pair)
the observed variance is 0, which would claim infinite precision. The per-item variance is
then floored at 1/n, as if one discordant pair had been seen, so SE = 1/n.

Power: with d_i = quant_i - ref_i the per-item SD is ``sqrt(mean(d^2) - Δ^2)``, which for
0/1 scores is McNemar's ``sqrt(p_disc - Δ^2)`` (p_disc = discordant fraction). Clustering
inflates it by the design effect deff = SE_cluster^2 / SE_iid^2. Then
``mde = (z_{1-α/2} + z_{0.8}) * sd * sqrt(deff / n)`` and
``n_needed = ceil(((z_{1-α/2} + z_{0.8}) * sd * sqrt(deff) / margin)^2)``.
With fewer than 2 clusters the SE, TOST p-values and MDE are NaN and ``n_needed`` is None.
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

__all__ = [
    "RIGHT_THRESHOLD",
    "PairedResult",
    "adjust_pvalues",
    "compare_frame",
    "flip_table",
    "paired_compare",
]

RIGHT_THRESHOLD = 0.5
POWER = 0.8
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
    """CR1 cluster-robust SE of the mean of ``diffs``; NaN with fewer than 2 clusters."""
    n_clusters = int(codes.max()) + 1
    if n_clusters < 2:
        return math.nan
    resid_sums = np.bincount(codes, weights=diffs - diffs.mean(), minlength=n_clusters)
    variance = n_clusters / (n_clusters - 1) * float(np.sum(resid_sums**2)) / diffs.size**2
    return math.sqrt(variance)


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


def _points(margin: float) -> str:
    points = 100.0 * margin
    return f"{points:.1f}" if abs(points * 10 - round(points * 10)) < 1e-9 else f"{points:g}"


def _verdict(
    *, lo: float, hi: float, binary: bool, mcnemar_p: float, alpha: float, n_clusters: int,
    margin: float | None, noninferiority_p: float | None, tost_p: float | None,
) -> str:
    supported = n_clusters >= 2 and (mcnemar_p < alpha if binary else True)
    drop = hi < 0 and supported
    gain = lo > 0 and supported
    if margin is None:
        return "worse" if drop else "better" if gain else "no detectable change"
    noninferior = noninferiority_p is not None and noninferiority_p < alpha
    if drop and hi < -margin:
        return "worse"
    if tost_p is not None and tost_p < alpha:
        return f"equivalent within {_points(margin)} pt"
    if drop and not noninferior:
        return "worse"
    if gain:
        return "better"
    if noninferior:
        return f"non-inferior within {_points(margin)} pt"
    return "inconclusive"


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
) -> PairedResult:
    """Compare per-item scores of the quantized model (``quant``) with the reference (``ref``).

    ``clusters`` (one label per item; missing labels are singletons) switches the bootstrap
    and the SE to whole clusters, for items that share a source [Miller 2024]. CIs are
    percentile intervals (numpy "linear" quantiles) of a paired bootstrap seeded with
    ``np.random.default_rng(seed)``. ``margin`` (e.g. 0.01 = 1 point of accuracy) enables
    the non-inferiority and TOST equivalence tests and ``n_needed``.
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

    codes = _cluster_codes(clusters, n)
    n_clusters = int(codes.max()) + 1
    diffs = quant_scores - ref_scores
    ref_right = ref_scores >= RIGHT_THRESHOLD
    quant_right = quant_scores >= RIGHT_THRESHOLD
    right_to_wrong = ref_right & ~quant_right
    wrong_to_right = ~ref_right & quant_right
    flips = right_to_wrong | wrong_to_right
    n10, n01 = int(right_to_wrong.sum()), int(wrong_to_right.sum())

    per_item = np.column_stack([diffs, flips, right_to_wrong, wrong_to_right]).astype(float)
    boot = _bootstrap_means(codes, per_item, int(n_resamples), np.random.default_rng(seed))
    tail = (1 - ci_level) / 2
    low, high = np.quantile(boot, [tail, 1 - tail], axis=0)
    ci = [(float(low[j]), float(high[j])) for j in range(per_item.shape[1])]

    mcnemar_p = 1.0 if n10 + n01 == 0 else float(sps.binomtest(n01, n01 + n10, 0.5).pvalue)
    delta = float(diffs.mean())

    degenerate = bool(np.ptp(diffs) == 0)
    if degenerate:
        item_sd = math.sqrt(1.0 / n)
        delta_se = 1.0 / n if n_clusters >= 2 else math.nan
        design_effect = 1.0
    else:
        item_sd = math.sqrt(float(np.var(diffs)))
        delta_se = _clustered_se(codes, diffs)
        iid_se_sq = float(np.var(diffs, ddof=1)) / n
        design_effect = delta_se**2 / iid_se_sq

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
            n_needed = int(math.ceil((z_sum * item_sd * math.sqrt(design_effect) / margin) ** 2))

    binary = bool(np.all((ref_scores == 0) | (ref_scores == 1)) and np.all((quant_scores == 0) | (quant_scores == 1)))
    verdict = _verdict(
        lo=ci[0][0], hi=ci[0][1], binary=binary, mcnemar_p=mcnemar_p, alpha=alpha, n_clusters=n_clusters,
        margin=margin, noninferiority_p=noninferiority_p, tost_p=tost_p,
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
    )


def adjust_pvalues(pvalues: ArrayLike, method: Literal["holm", "bh", "none"] = "holm") -> np.ndarray:
    """Multiple-comparison adjusted p-values (Holm step-down FWER or Benjamini-Hochberg FDR).

    NaNs pass through unchanged and do not count towards the number of tests.
    """
    p = np.array(pvalues, dtype=float)
    valid = ~np.isnan(p)
    if np.any((p[valid] < 0) | (p[valid] > 1)):
        low, high = float(p[valid].min()), float(p[valid].max())
        raise ValueError(f"p-values must lie in [0, 1]; got min {low!r}, max {high!r}")
    if method not in ("holm", "bh", "none"):
        raise ValueError(f"method={method!r} is unknown; use 'holm', 'bh' or 'none'")
    m = int(valid.sum())
    if method == "none" or m == 0:
        return p
    values = p[valid]
    order = np.argsort(values, kind="mergesort")
    ranked = values[order]
    if method == "holm":
        adjusted = np.maximum.accumulate((m - np.arange(m)) * ranked)
    else:
        adjusted = np.minimum.accumulate((m / np.arange(1, m + 1) * ranked)[::-1])[::-1]
    unsorted = np.empty(m)
    unsorted[order] = np.minimum(adjusted, 1.0)
    p[valid] = unsorted
    return p


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
) -> pd.DataFrame:
    """One ``paired_compare`` row per group of ``by`` (flattened via ``PairedResult.to_dict``).

    ``mcnemar_p_adj`` is corrected across all rows of the returned frame. Each group's
    bootstrap seed is derived from ``(seed, group key)``. Verdicts use unadjusted tests.
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
        )
        rows.append({**dict(zip(by, key)), **result.to_dict()})
    frame = pd.DataFrame(rows)
    frame.insert(
        frame.columns.get_loc("mcnemar_p") + 1, "mcnemar_p_adj", adjust_pvalues(frame["mcnemar_p"], correction)
    )
    return frame
