"""Quality against measured speed, and the ledger against the engine, for compared runs whose scheme was measured
serving (``perf.json``, :mod:`harness.engines.perf`).

A run carries its serving speed as ``perf.json`` beside its ``summary.json`` (or among its MLflow artifacts), or
is given one with ``perf=[...]`` (a ``perf.json`` of ``python -m harness.parity speed=true``, or the folder
holding it), matched to its run by the results directory it names, else by model and scheme.

Each such run gives one point per concurrency level: the measured speed-up over the reference's own weights on
the same engine (output tokens/s, candidate ÷ reference, paired bootstrap interval) against its quality (the
overall Δaccuracy with its interval; the mean KL where a run has no Δ). A point is on the **Pareto front** of its
level when no other point — the reference included, at speed-up 1 and Δ 0 (KL 0) — is at least as fast and at
least as good, and better in one of the two. The front is read off the point estimates; the intervals stand
beside it, so two schemes whose intervals overlap are not told apart by it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from harness.compare.sources import RunData

__all__ = ["REFERENCE_LABEL", "attach_perf", "measured_table", "pareto_front", "speed_table", "speed_words"]

REFERENCE_LABEL = "reference (own weights)"
SPEED_COLUMNS = ["label", "concurrency", "speedup", "speedup_ci_low", "speedup_ci_high", "quality", "delta",
                 "delta_ci_low", "delta_ci_high", "kl_mean", "pareto", "speed", "is_reference"]


def _read_perf(path: str | Path) -> tuple[Path, dict[str, Any]]:
    path = Path(path)
    file = path / "perf.json" if path.is_dir() else path
    if not file.exists():
        raise ValueError(f"perf={path}: no perf.json there; give the perf.json of `python -m harness.parity "
                         "speed=true` (or its output folder)")
    result = json.loads(file.read_text())
    if not result.get("levels"):
        raise ValueError(f"{file} has no measured levels: not a harness.engines.perf result")
    return file, result


def attach_perf(runs: Sequence[RunData], paths: Sequence[str | Path]) -> None:
    """Give each ``perf.json`` of ``paths`` to the compared run it measured (the results directory it names, else
    its model and scheme); one that matches no run, or several, is refused naming the fix."""
    for path in paths:
        file, result = _read_perf(path)
        named = result.get("run")
        found = [run for run in runs if named and run.source and Path(run.source).resolve() == Path(named).resolve()]
        if not found and result.get("scheme"):
            found = [run for run in runs
                     if run.scheme == result["scheme"] and run.model == result.get("model", run.model)]
        if len(found) != 1:
            which = "no compared run" if not found else f"{len(found)} compared runs"
            raise ValueError(f"{file} (model {result.get('model')!r}, scheme {result.get('scheme')!r}, run "
                             f"{named!r}) matches {which}; compare its simulation run with it, or put the perf.json "
                             "beside that run's summary.json and leave it out of perf=")
        found[0].perf = result


def speed_words(point: float, low: float, high: float) -> str:
    """The speed-up in words, read off its interval: slower / faster / not shown faster than its reference."""
    if not math.isfinite(point):
        return "not measured"
    shown = f"{point:.2f}× [{low:.2f}, {high:.2f}]"
    if math.isfinite(high) and high < 1:
        return f"SLOWER than its reference ({shown})"
    if math.isfinite(low) and low > 1:
        return f"faster than its reference ({shown})"
    return f"not shown faster than its reference ({shown})"


def pareto_front(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For (speed, quality) points, both the higher the better: True where no other point is at least as high in
    both and higher in one (points with a missing coordinate are never on the front)."""
    def dominated(i: int) -> bool:
        x, y = points[i]
        return any(a >= x and b >= y and (a > x or b > y) for j, (a, b) in enumerate(points) if j != i)

    return [all(map(math.isfinite, points[i])) and not dominated(i) for i in range(len(points))]


def _quality_of(headline: pd.DataFrame, labels: list[str]) -> tuple[str, dict[str, dict[str, float]]]:
    """("delta" or "kl", label -> overall Δ with its interval and KL): Δaccuracy when every run has one."""
    overall = headline[headline["slice"] == "overall"].set_index("label")
    values = {}
    for label in labels:
        row = overall.loc[label] if label in overall.index else pd.Series(dtype=float)
        values[label] = {key: float(row.get(key, math.nan)) for key in ("delta", "delta_ci_low", "delta_ci_high",
                                                                         "kl_mean")}
    has_delta = all(math.isfinite(v["delta"]) for v in values.values())
    has_kl = all(math.isfinite(v["kl_mean"]) for v in values.values())
    return ("delta" if has_delta or not has_kl else "kl"), values


def speed_table(runs: Sequence[RunData], headline: pd.DataFrame) -> pd.DataFrame:
    """One row per (run with perf, concurrency level) and the reference's own row per level: speed-up with its
    interval, the quality the front is drawn on, whether the point is Pareto-optimal, the speed in words."""
    measured = [run for run in runs if run.perf.get("levels")]
    if not measured:
        return pd.DataFrame(columns=SPEED_COLUMNS)
    quality, values = _quality_of(headline, [run.label for run in measured])
    rows = []
    for run in measured:
        for level in run.perf["levels"]:
            point, low, high = (float(level.get(k, math.nan)) for k in ("speedup", "speedup_ci_low", "speedup_ci_high"))
            rows.append({"label": run.label, "concurrency": int(level["concurrency"]), "speedup": point,
                         "speedup_ci_low": low, "speedup_ci_high": high, "quality": quality,
                         **values[run.label], "speed": speed_words(point, low, high), "is_reference": False})
    for concurrency in sorted({row["concurrency"] for row in rows}):
        rows.append({"label": REFERENCE_LABEL, "concurrency": int(concurrency), "speedup": 1.0, "speedup_ci_low": 1.0,
                     "speedup_ci_high": 1.0, "quality": quality, "delta": 0.0, "delta_ci_low": 0.0,
                     "delta_ci_high": 0.0, "kl_mean": 0.0, "speed": "the reference itself", "is_reference": True})
    table = pd.DataFrame(rows)
    score = table["delta"] if quality == "delta" else -table["kl_mean"]
    table["pareto"] = False
    for _, part in table.groupby("concurrency"):
        flags = pareto_front(list(zip(part["speedup"], score[part.index])))
        table.loc[part.index, "pareto"] = flags
    return table.sort_values(["concurrency", "speedup"], ascending=[True, False]).reset_index(drop=True)[SPEED_COLUMNS]


def measured_table(runs: Sequence[RunData], device: str | None = None) -> pd.DataFrame:
    """Per run with perf and side: the ledger's predicted weight memory and decode floor beside the engine's log's
    weight memory and the measured time per output token, with both ratios
    (:func:`harness.engines.perf.predicted_vs_measured`, on ``device`` or the one perf.json names)."""
    from harness.sizing.measured import predicted_vs_measured

    rows = []
    for run in runs:
        if run.perf.get("levels"):
            rows += [{"label": run.label, **row} for row in predicted_vs_measured(run.perf, run.summary, device)]
    return pd.DataFrame(rows)
