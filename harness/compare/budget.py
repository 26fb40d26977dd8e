"""A thinking budget sweep: compared runs that differ only in ``eval.max_gen_toks`` or ``eval.thinking_budget``.

Runs are grouped by everything that decides their answers (model, scheme, slices, candidate, reference and the
eval settings, those two keys left out); a group whose runs take two or more values of exactly one of the keys is
a sweep. At each budget: both sides' overall accuracy with its interval (Wilson on the clustered effective
size; the reference is re-run at each budget, so its accuracy moves too) and Δ with the comparison's interval.

**Where the candidate matches.** Non-inferior at a budget: the lower end of Δ's interval above −margin (the
verdict's rule). The smallest matching budget is found by fixed-sequence testing: from the largest budget down,
each budget is claimed while every larger one was, and the walk stops at the first that is not. Claims made this
way are wrong with probability at most one test's one-sided error (2.5 % at 95 % intervals), however many budgets
were tried; taking the smallest budget that passes anywhere would not be (``tests/test_compare_thinking.py``
measures both by simulation).
"""
from __future__ import annotations

import json
import math
from typing import Any, Sequence

import numpy as np
import pandas as pd

from harness.compare.sources import RunData

__all__ = ["BUDGET_KEYS", "budget_table", "fixed_sequence_smallest", "sweep_groups"]

BUDGET_KEYS = ("max_gen_toks", "thinking_budget")  # eval.<key>
IDENTITY_SECTIONS = ("model", "quant", "slices", "candidate", "reference")  # with eval: what decides the answers
BUDGET_COLUMNS = ["group", "budget_key", "budget", "label", "n", "acc_ref", "acc_ref_ci_low", "acc_ref_ci_high",
                  "acc_quant", "acc_quant_ci_low", "acc_quant_ci_high", "delta", "delta_ci_low", "delta_ci_high",
                  "verdict", "non_inferior", "matched_from"]


def _identity(run: RunData) -> str | None:
    config = run.config
    if not config or "eval" not in config:
        return None
    evaluation = {k: v for k, v in config["eval"].items() if k not in BUDGET_KEYS}
    return json.dumps({**{k: config.get(k) for k in IDENTITY_SECTIONS}, "eval": evaluation}, sort_keys=True,
                      default=str)


def sweep_groups(runs: Sequence[RunData]) -> list[tuple[str, list[tuple[int, RunData]]]]:
    """[(budget key, [(budget, run), ...] by budget)] for each group of runs that differ in exactly one budget key
    (two or more values); a budget given twice keeps its first run."""
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        key = _identity(run)
        if key is not None:
            groups.setdefault(key, []).append(run)
    sweeps = []
    for members in groups.values():
        values = {key: [m.config["eval"].get(key) for m in members] for key in BUDGET_KEYS}
        varying = [key for key, found in values.items() if len(set(map(str, found))) > 1]
        if len(varying) != 1 or any(v is None for v in values[varying[0]]):
            continue
        key = varying[0]
        by_budget: dict[int, RunData] = {}
        for member, value in zip(members, values[key]):
            by_budget.setdefault(int(value), member)
        sweeps.append((key, sorted(by_budget.items())))
    return sweeps


def fixed_sequence_smallest(budgets: Sequence[float], non_inferior: Sequence[bool]) -> float:
    """The smallest budget claimed by fixed-sequence testing from the largest down (NaN: not even the largest)."""
    found = math.nan
    for budget, passed in sorted(zip(budgets, non_inferior), reverse=True):
        if not passed:
            break
        found = budget
    return found


def _accuracy(items: pd.DataFrame, column: str, ci_level: float) -> tuple[float, float, float]:
    from harness.stats.intervals import clustered_rate
    from harness.stats.paired import cluster_codes

    values = items[column].to_numpy(float)
    known = np.isfinite(values)
    clusters = items["cluster"].astype(object).where(items["cluster"].notna(), None).to_numpy() \
        if "cluster" in items else None
    codes = cluster_codes(None if clusters is None else clusters[known], int(known.sum()))
    return clustered_rate(values[known], codes, ci_level)


def budget_table(runs: Sequence[RunData], item_stats: pd.DataFrame, *, margin: float | None,
                 ci_level: float) -> pd.DataFrame:
    """One row per (sweep, budget): both sides' accuracy with intervals, Δ with its interval and verdict, whether
    it is non-inferior at ``margin``, and the sweep's smallest matching budget (``matched_from``, NaN: none)."""
    overall = item_stats[item_stats["level"] == "overall"].set_index("label")
    rows: list[dict[str, Any]] = []
    for key, members in sweep_groups(runs):
        first = members[0][1]
        group = f"{first.model}/{first.scheme}"
        part = []
        for budget, run in members:
            stats_row = overall.loc[run.label]
            ref, quant = (_accuracy(run.items, f"correct_{side}", ci_level) for side in ("ref", "quant"))
            low = float(stats_row["delta_ci_low"])
            part.append({"group": group, "budget_key": f"eval.{key}", "budget": budget, "label": run.label,
                         "n": int(stats_row["n"]), "acc_ref": ref[0], "acc_ref_ci_low": ref[1],
                         "acc_ref_ci_high": ref[2], "acc_quant": quant[0], "acc_quant_ci_low": quant[1],
                         "acc_quant_ci_high": quant[2], "delta": float(stats_row["delta"]), "delta_ci_low": low,
                         "delta_ci_high": float(stats_row["delta_ci_high"]), "verdict": stats_row["verdict"],
                         "non_inferior": margin is not None and math.isfinite(low) and low > -margin})
        smallest = fixed_sequence_smallest([r["budget"] for r in part], [r["non_inferior"] for r in part])
        rows += [{**r, "matched_from": smallest} for r in part]
    return pd.DataFrame(rows, columns=BUDGET_COLUMNS)
