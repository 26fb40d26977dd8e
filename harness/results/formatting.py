"""Number formatting for every human-readable table: the run's report.md and terminal table
(:mod:`harness.results.report`) and the comparison's terminal, Markdown and HTML renderings
(:mod:`harness.compare.render`).

One rule for a missing value everywhere: ``None``, NaN and ``pd.NA`` print as an en dash, so a
table never shows ``nan`` and a reader sees at once which number was not measured.

One unit everywhere a person reads a table (the console, report.md, ``harness.compare`` and the gate):
accuracies and rates in percent (:func:`pct`, ``43.9``), differences of them in percentage points
(:func:`points`, ``-21.9 [-26.4, -17.7]``), the unit named once in the column header (:data:`PCT`,
:data:`PT`). Stored values (summary.json, parquet, MLflow metrics) stay fractions.
"""
from __future__ import annotations

import math
from typing import Any

import pandas as pd

__all__ = ["MISSING", "PCT", "PT", "count", "delta_ci", "flips", "is_missing", "lower_bound_mark", "num", "pct",
           "pct_pm", "pm", "points"]

MISSING = "–"
PCT = "%"  # header suffix of a column in percent: "acc ref %"
PT = "pt"  # header suffix of a column in percentage points: "Δacc pt [95% CI]"


def is_missing(value: Any) -> bool:
    """True for ``None``, ``pd.NA`` and any float NaN (Python or NumPy)."""
    if value is None or value is pd.NA:
        return True
    try:
        return math.isnan(value)
    except TypeError:
        return False


def num(value: Any, spec: str = ".3f") -> str:
    """``format(value, spec)``, or :data:`MISSING` when there is no value."""
    return MISSING if is_missing(value) else format(value, spec)


def pm(mean: Any, se: Any, spec: str = ".4f") -> str:
    """``mean ± se``; :data:`MISSING` alone when the mean is missing."""
    return MISSING if is_missing(mean) else f"{num(mean, spec)} ± {num(se, spec)}"


def delta_ci(delta: Any, low: Any, high: Any, spec: str = "+.3f") -> str:
    """A signed difference with its interval: ``+0.012 [-0.004, +0.030]``."""
    return f"{num(delta, spec)} [{num(low, spec)}, {num(high, spec)}]"


def pct(value: Any, spec: str = ".1f") -> str:
    """A fraction in percent, without the sign: ``0.439`` → ``43.9``; :data:`MISSING` when there is none."""
    return MISSING if is_missing(value) else format(100 * float(value), spec)


def pct_pm(mean: Any, se: Any, spec: str = ".1f") -> str:
    """A rate and its standard error, both in percent: ``97.3 ± 0.4``."""
    return MISSING if is_missing(mean) else f"{pct(mean, spec)} ± {pct(se, spec)}"


def points(delta: Any, low: Any = None, high: Any = None, spec: str = "+.1f") -> str:
    """A difference of fractions in percentage points, with its interval when given:
    ``-0.219, -0.264, -0.177`` → ``-21.9 [-26.4, -17.7]``."""
    head = MISSING if is_missing(delta) else format(100 * float(delta), spec)
    if low is None and high is None:
        return head
    return f"{head} [{pct(low, spec)}, {pct(high, spec)}]"


def flips(right_to_wrong: Any, wrong_to_right: Any) -> str:
    """Discordant pair counts as ``r→w / w→r``: ``9 / 1``."""
    return f"{count(right_to_wrong)} / {count(wrong_to_right)}"


def count(value: Any) -> str:
    """A whole number (``12``), or :data:`MISSING`."""
    return MISSING if is_missing(value) else str(int(value))


def lower_bound_mark(row: dict) -> str:
    """``"≥ "`` before a KL that is only a lower bound (a row with a ``kl_bound`` label: a served
    candidate's KL on the server's top-k partition), else nothing."""
    bound = row.get("kl_bound")
    return "≥ " if isinstance(bound, str) and bound else ""
