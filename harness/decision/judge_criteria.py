"""The gate's judge criterion: ``gate.judge_loss_max`` against the pairwise judge's loss − win and its interval.

Read off the interval the report shows (``<slice>/judge_loss_minus_win``, compare.ci_level two-sided, clustered and
stratified: :mod:`harness.evaluation.judge_stats`), the way ``gate.outcomes`` is read
(:func:`harness.decision.criteria.outcome_criteria`): pass when the whole interval is at or below the limit, fail when
the whole interval is above it, inconclusive otherwise or with fewer than gate.min_items judged prompts. The
false-pass rate at the limit is measured by simulation in ``benchmarks/bench_judge_gate.py``
(docs/benchmarks/judge.md).
"""
from __future__ import annotations

from harness.config import GateConfig
from harness.decision.criteria import FAIL, INCONCLUSIVE, PASS, Criterion
from harness.decision.gate_inputs import RunResults

CRITERION = "judge_loss"


def judge_outcome(loss_minus_win: float | None, low: float | None, high: float | None, decided: float | None,
                  limit: float, min_items: int) -> str:
    """pass / fail / inconclusive of one slice (module docstring)."""
    if loss_minus_win is None or low is None or high is None or (decided or 0) < min_items:
        return INCONCLUSIVE
    return PASS if high <= limit else FAIL if low > limit else INCONCLUSIVE


def judge_criteria(run: RunResults, cfg: GateConfig, slices: list[str]) -> list[Criterion]:
    """One criterion per judged slice of ``slices`` when gate.judge_loss_max is set ([] otherwise, or for a run the
    judge did not read)."""
    if cfg.judge_loss_max is None:
        return []
    limit = float(cfg.judge_loss_max)
    metrics = run.summary.get("metrics", {})
    out = []
    for name in slices:
        stem = f"{name}/judge_loss_minus_win"
        if metrics.get(f"{name}/judge_n") is None:
            continue
        value, low, high = metrics.get(stem), metrics.get(f"{stem}_ci_low"), metrics.get(f"{stem}_ci_high")
        decided = metrics.get(f"{name}/judge_decided")
        unparsable = int(metrics.get(f"{name}/judge_unparsable") or 0)
        outcome = judge_outcome(value, low, high, decided, limit, int(cfg.min_items))
        numbers = {"change": value, "ci_low": low, "ci_high": high, "limit": limit, "n": decided,
                   "unparsable": unparsable, "consistency": metrics.get(f"{name}/judge_consistency")}
        if value is None or low is None or high is None or (decided or 0) < cfg.min_items:
            out.append(Criterion(name, CRITERION, INCONCLUSIVE,
                                 f"inconclusive: the judge decided {int(decided or 0)} prompts (gate.min_items="
                                 f"{cfg.min_items}) or gave no interval; {unparsable} unparsable",
                                 ["judge: too few judged prompts"], numbers))
            continue
        shown = f"{100 * value:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] pt"
        out.append(Criterion(name, CRITERION, outcome,
                             f"{outcome}: judge loss − win {shown}, allowed at most {100 * limit:.1f} pt "
                             f"({int(decided)} prompts judged, {unparsable} unparsable)",
                             [] if outcome == PASS else [f"judge loss − win {shown} vs {100 * limit:.1f} pt"], numbers))
    return out
