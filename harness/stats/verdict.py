"""Verdict labels of a paired comparison, read off the displayed interval of Δ (rules: harness.stats.paired)."""

from __future__ import annotations

__all__ = ["points", "verdict_label"]


def points(margin: float) -> str:
    """A margin in accuracy points for labels: 0.02 -> "2.0", 0.0125 -> "1.25"."""
    value = 100.0 * margin
    return f"{value:.1f}" if abs(value * 10 - round(value * 10)) < 1e-9 else f"{value:g}"


def verdict_label(*, lo: float, hi: float, n_clusters: int, min_clusters: int, margin: float | None) -> str:
    """The verdict of ``harness.stats.paired`` (its module docstring lists the rules, in order).

    Only the interval ``[lo, hi]`` of Δ decides (NaN bounds decide nothing), so no label can
    contradict the interval shown beside it.
    """
    if n_clusters < min_clusters:
        return "too few clusters"
    drop, gain = hi < 0, lo > 0
    if margin is None:
        return "worse" if drop else "better" if gain else "no detectable change"
    if hi < -margin:
        return f"worse beyond {points(margin)} pt"
    if lo > -margin and hi < margin:
        return f"equivalent within {points(margin)} pt"
    if gain:
        return "better"
    if lo > -margin:
        return f"non-inferior within {points(margin)} pt"
    if drop:
        return "worse"
    return "inconclusive"
