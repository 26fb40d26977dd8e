"""A thinking model's traces across compared runs: how long each side thought, per item.

From each run's ``thinking.parquet`` (:func:`harness.evaluation.thinking.trace_frame`, written when
``model.thinking`` is on): one row per (run, side, item) with the trace's tokens, whether the reply hit its token
cap and whether the trace never closed; :func:`trace_summary` gives per run and side the distribution's
quantiles and the cap-hit and unclosed rates with their intervals (Wilson on the clustered effective size, as
:func:`harness.evaluation.thinking.thinking_metrics` computes them in each run).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from harness.compare.sources import RunData

__all__ = ["SIDE_NAMES", "trace_rows", "trace_summary"]

SIDE_NAMES = {"ref": "reference", "quant": "candidate"}
ROW_COLUMNS = ["label", "side", "item_id", "slice", "cluster", "trace_tokens", "cap_hit", "unclosed"]


def trace_rows(runs: Sequence[RunData]) -> pd.DataFrame:
    """Long table of every thinking run's traces: (label, side = reference | candidate, item) and its lengths."""
    parts = []
    for run in runs:
        frame = run.thinking
        if frame.empty or "trace_tokens_ref" not in frame:
            continue
        for side, name in SIDE_NAMES.items():
            parts.append(pd.DataFrame({
                "label": run.label, "side": name, "item_id": frame["item_id"],
                "slice": frame.get("slice", pd.Series("", index=frame.index)),
                "cluster": frame.get("cluster", pd.Series(None, index=frame.index, dtype=object)),
                "trace_tokens": frame[f"trace_tokens_{side}"].astype(float),
                "cap_hit": frame.get(f"cap_hit_{side}", pd.Series(math.nan, index=frame.index)).astype(float),
                "unclosed": frame.get(f"unclosed_{side}", pd.Series(math.nan, index=frame.index)).astype(float)}))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=ROW_COLUMNS)


def _rate(values: pd.Series, clusters: pd.Series, ci_level: float) -> tuple[float, float, float]:
    from harness.stats.intervals import clustered_rate
    from harness.stats.paired import cluster_codes

    known = values.notna().to_numpy()
    if not known.any():
        return math.nan, math.nan, math.nan
    codes = cluster_codes(clusters.astype(object).where(clusters.notna(), None).to_numpy()[known], int(known.sum()))
    return clustered_rate(values.to_numpy(float)[known], codes, ci_level)


def trace_summary(rows: pd.DataFrame, ci_level: float = 0.95) -> pd.DataFrame:
    """Per (label, side): items, mean / median / p90 / max trace tokens, cap-hit and unclosed rates with intervals."""
    out = []
    for (label, side), part in rows.groupby(["label", "side"], sort=False):
        tokens = part["trace_tokens"].to_numpy(float)
        record = {"label": label, "side": side, "n": len(part), "tokens_mean": float(np.mean(tokens)),
                  "tokens_median": float(np.median(tokens)), "tokens_p90": float(np.quantile(tokens, 0.9)),
                  "tokens_max": float(np.max(tokens))}
        for what in ("cap_hit", "unclosed"):
            rate, low, high = _rate(part[what], part["cluster"], ci_level)
            record.update({what: rate, f"{what}_ci_low": low, f"{what}_ci_high": high})
        out.append(record)
    return pd.DataFrame(out)
