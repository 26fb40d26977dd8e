"""Verdict labels of a paired comparison, from its CI, tests and cluster count (rules: harness.stats)."""

from __future__ import annotations

__all__ = ["verdict_label"]


def _points(margin: float) -> str:
    points = 100.0 * margin
    return f"{points:.1f}" if abs(points * 10 - round(points * 10)) < 1e-9 else f"{points:g}"


def verdict_label(
    *, lo: float, hi: float, binary: bool, mcnemar_p: float, alpha: float, n_clusters: int, min_clusters: int,
    margin: float | None, noninferiority_p: float | None, tost_p: float | None,
) -> str:
    """The verdict label of ``harness.stats`` (its module docstring lists the rules, in order)."""
    if n_clusters < min_clusters:
        return "too few clusters"
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
