"""Multiple-comparison adjustment of p-values (many slices x schemes are tested at once)."""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["adjust_pvalues"]


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
