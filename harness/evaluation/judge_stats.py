"""The pairwise judge's verdicts as per-item outcomes and statistics: win, tie, loss, and the judge's order consistency.

Each item was asked twice (:mod:`harness.evaluation.judge_client`): once with the reference's reply as Response A
(``verdict_ref_first``), once with the candidate's as Response A (``verdict_quant_first``). A verdict names the side
it prefers: the candidate (``quant``), the reference (``ref``) or neither (``tie``). Per item:

* **win**: the candidate preferred in both orders, or in one order with a tie in the other; **loss**: the same for
  the reference; **tie**: everything else (a tie in both orders, or the two orders preferring opposite sides);
* **consistent**: both orders name the same side (or both a tie), the judge's order consistency;
* items whose two replies are identical are a tie without asking the judge (``identical``: counted apart);
* an item with a verdict that is not one word A, B or tie (``unparsable``) gets no outcome: it is counted and
  left out of the rates, never guessed.

:func:`judge_metrics` gives ``<slice>/judge_*``: the win, tie and loss rates (Wilson on the clustered effective size,
:func:`harness.stats.intervals.clustered_rate`), loss − win with the clustered, stratified paired score interval of
:func:`harness.stats.paired_compare` (the statistic behind every Δ accuracy of the harness: win and loss as the two
"sides" of a paired binary outcome), the order consistency with its interval, and the share of decisive verdicts
that chose the first-shown response (the judge's position bias). :func:`strata_table` gives the same per stratum.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import numpy as np
import pandas as pd

__all__ = ["METRIC_DOCS", "OUTCOMES", "item_outcome", "judge_metrics", "markdown", "outcome_frame", "preference",
           "strata_table"]

OUTCOMES = ("win", "tie", "loss")
UNPARSABLE = "unparsable"
NOT_ASKED = ""  # identical replies: the judge is not asked


def preference(verdict: str, order: str) -> Optional[str]:
    """The side a verdict prefers: ``quant``, ``ref`` or ``tie``; None for an unparsable verdict. ``order`` is
    ``ref_first`` (Response A was the reference's reply) or ``quant_first``."""
    if verdict == "tie":
        return "tie"
    if verdict not in ("A", "B"):
        return None
    first = "ref" if order == "ref_first" else "quant"
    second = "quant" if first == "ref" else "ref"
    return first if verdict == "A" else second


def item_outcome(ref_first: str, quant_first: str) -> tuple[str, float]:
    """(outcome, consistent) of one item from its two verdicts (module docstring); consistent is NaN where the item
    has no outcome."""
    one, two = preference(ref_first, "ref_first"), preference(quant_first, "quant_first")
    if one is None or two is None:
        return UNPARSABLE, math.nan
    sides = {one, two}
    if sides <= {"quant", "tie"} and "quant" in sides:
        outcome = "win"
    elif sides <= {"ref", "tie"} and "ref" in sides:
        outcome = "loss"
    else:
        outcome = "tie"
    return outcome, float(one == two)


def outcome_frame(verdicts: pd.DataFrame) -> pd.DataFrame:
    """``verdicts`` (one row per item: ``item_id``, ``slice``, ``sub_slice``, ``cluster``, ``stratum``,
    ``identical``, ``verdict_ref_first``, ``verdict_quant_first``) with ``outcome``, ``win``, ``tie``, ``loss``,
    ``consistent`` and ``first_chosen`` (decisive verdicts that chose Response A, of ``decisive`` ones)."""
    frame = verdicts.copy()
    outcomes, consistent, first, decisive = [], [], [], []
    for row in frame.itertuples(index=False):
        if int(row.identical):
            outcomes.append("tie")
            consistent.append(math.nan)
            first.append(0)
            decisive.append(0)
            continue
        outcome, same = item_outcome(str(row.verdict_ref_first), str(row.verdict_quant_first))
        outcomes.append(outcome)
        consistent.append(same)
        pair = (str(row.verdict_ref_first), str(row.verdict_quant_first))
        first.append(sum(v == "A" for v in pair))
        decisive.append(sum(v in ("A", "B") for v in pair))
    frame["outcome"] = outcomes
    for name in OUTCOMES:
        frame[name] = [int(o == name) for o in outcomes]
    frame["consistent"] = consistent
    frame["first_chosen"], frame["decisive"] = first, decisive
    return frame


def _codes(labels: pd.Series) -> np.ndarray:
    from harness.stats.paired import cluster_codes

    return cluster_codes(labels.astype(str).to_numpy(), len(labels))


def _stats(part: pd.DataFrame, ci_level: float) -> dict[str, float]:
    """One group's numbers (a slice, or a stratum of one), flat, without the ``judge_`` prefix."""
    from harness.stats.intervals import clustered_rate
    from harness.stats.paired import paired_compare

    out: dict[str, float] = {"n": float(len(part)), "identical": float(part["identical"].sum()),
                             "unparsable": float((part["outcome"] == UNPARSABLE).sum())}
    out["asked"] = out["n"] - out["identical"]
    decided = part[part["outcome"] != UNPARSABLE].reset_index(drop=True)
    out["decided"] = float(len(decided))
    if decided.empty:
        return out
    codes = _codes(decided["cluster"])
    out["n_clusters"] = float(codes.max() + 1)

    def rate(key: str, values: np.ndarray, groups: np.ndarray) -> None:
        value, low, high = clustered_rate(values.astype(float), groups, ci_level)
        out[key] = value
        if math.isfinite(low):
            out[f"{key}_ci_low"], out[f"{key}_ci_high"] = low, high

    for name in OUTCOMES:
        rate(name, decided[name].to_numpy(), codes)
    strata = decided["stratum"].astype(str)
    result = paired_compare(decided["win"].to_numpy(float), decided["loss"].to_numpy(float),
                            clusters=decided["cluster"].astype(str).to_numpy(),
                            strata=strata.to_numpy() if strata.nunique() > 1 else None, ci_level=ci_level,
                            n_resamples=200, min_clusters=1)
    out["loss_minus_win"] = float(result.delta)
    low, high = result.delta_ci
    if math.isfinite(low) and math.isfinite(high):
        out["loss_minus_win_ci_low"], out["loss_minus_win_ci_high"] = float(low), float(high)
    asked = decided[decided["identical"] == 0].reset_index(drop=True)
    out["consistency_n"] = float(len(asked))
    if not asked.empty:
        rate("consistency", asked["consistent"].to_numpy(), _codes(asked["cluster"]))
    decisive = int(decided["decisive"].sum())
    out["decisive"] = float(decisive)
    if decisive:  # verdicts, not items: each item's two verdicts expanded, clustered by the item's cluster
        chosen = np.concatenate([np.r_[np.ones(int(f)), np.zeros(int(d - f))]
                                 for f, d in zip(decided["first_chosen"], decided["decisive"]) if d])
        groups = np.repeat(decided["cluster"].astype(str).to_numpy(), decided["decisive"].to_numpy(int))
        rate("first_chosen", chosen, _codes(pd.Series(groups)))
    return out


def judge_metrics(frame: pd.DataFrame, *, ci_level: float = 0.95) -> dict[str, float]:
    """``<slice>/judge_*`` metrics of an :func:`outcome_frame`, flat for summary.json (module docstring)."""
    out: dict[str, float] = {}
    for name, part in frame.groupby("slice", sort=False):
        out.update({f"{name}/judge_{key}": value for key, value in _stats(part, ci_level).items()})
    return out


def strata_table(frame: pd.DataFrame, *, ci_level: float = 0.95) -> pd.DataFrame:
    """One row per slice and per stratum (``sub_slice``) of each slice: the numbers of :func:`judge_metrics`."""
    rows = []
    for name, part in frame.groupby("slice", sort=False):
        rows.append({"slice": name, "sub_slice": None, **_stats(part, ci_level)})
        for sub, cell in part.groupby("sub_slice", sort=True):
            rows.append({"slice": name, "sub_slice": str(sub), **_stats(cell, ci_level)})
    return pd.DataFrame(rows)


def _pct(value: Any) -> str:
    return "–" if value is None or not math.isfinite(float(value)) else f"{100 * float(value):.1f}"


def _interval(get: Any, key: str) -> str:
    low, high = get(f"{key}_ci_low"), get(f"{key}_ci_high")
    shown = _pct(get(key))
    if low is None or high is None:
        return shown
    return f"{shown} [{_pct(low)}, {_pct(high)}]"


def markdown(metrics: Mapping[str, float], slice_name: str, table: Optional[pd.DataFrame] = None,
             judge_name: str = "") -> str:
    """The report's section for one judged slice: win / tie / loss, loss − win, order consistency, per stratum."""
    prefix = f"{slice_name}/judge_"
    if metrics.get(f"{prefix}n") is None:
        return ""

    def get(key: str) -> Any:
        return metrics.get(prefix + key)

    judge = f" by {judge_name}" if judge_name else ""
    lines = [f"## Pairwise judge{judge}: {slice_name}", "",
             f"- prompts: {int(get('n'))}; identical replies (a tie, the judge not asked): {int(get('identical'))}; "
             f"unparsable verdicts (no outcome, left out): {int(get('unparsable'))}; judged: {int(get('decided') or 0)}",
             f"- candidate wins {_interval(get, 'win')} %, ties {_interval(get, 'tie')} %, loses "
             f"{_interval(get, 'loss')} %",
             f"- loss − win: {_interval(get, 'loss_minus_win')} pt (clustered, stratified paired score interval)",
             f"- order consistency (same side preferred in both orders): {_interval(get, 'consistency')} % of "
             f"{int(get('consistency_n') or 0)} prompts asked; first-shown response chosen in "
             f"{_interval(get, 'first_chosen')} % of {int(get('decisive') or 0)} decisive verdicts"]
    if table is not None and not table.empty:
        cells = table[(table["slice"] == slice_name) & table["sub_slice"].notna()]
        if len(cells) > 1:
            lines += ["", "| stratum | prompts | win % | tie % | loss % | loss − win pt [CI] | consistent % |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
            for row in cells.to_dict("records"):
                def cell(key: str, row: dict = row) -> Any:
                    value = row.get(key)
                    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value
                lines.append(f"| {row['sub_slice']} | {int(row['n'])} | {_pct(cell('win'))} | {_pct(cell('tie'))} | "
                             f"{_pct(cell('loss'))} | {_interval(cell, 'loss_minus_win')} | "
                             f"{_pct(cell('consistency'))} |")
    lines += ["", "Each prompt's two replies were shown to the judge blind, as Response A and B, once in each order. "
              "Win: the candidate's reply preferred in both orders, or in one with a tie in the other; loss: the "
              "same for the reference's; tie otherwise. A weak or biased judge shows as low order consistency.", ""]
    return "\n".join(lines)


FRACTION = "fraction (tables: percent; Δ: points)"
# summary.json keys this module adds (scripts/docs_reference.py's METRICS format: key -> (unit, meaning))
METRIC_DOCS: dict[str, tuple[str, str]] = {
    "metrics/<slice>/judge_n": ("items", "prompts of a slice judged pairwise (judge.slices)"),
    "metrics/<slice>/judge_identical": ("items", "prompts with identical replies: a tie without asking the judge"),
    "metrics/<slice>/judge_asked": ("items", "prompts whose two replies differ: the judge asked in both orders"),
    "metrics/<slice>/judge_unparsable": ("items", "prompts with a judge verdict that is not one word A, B or tie in "
                                         "either order: no outcome, left out of the rates"),
    "metrics/<slice>/judge_decided": ("items", "prompts with an outcome (judge_n − judge_unparsable): the rates' "
                                      "denominator"),
    "metrics/<slice>/judge_n_clusters": ("clusters", "clusters (prompt-log groups) among the decided prompts"),
    "metrics/<slice>/judge_<outcome>": (FRACTION, "share of decided prompts the candidate wins, ties or loses "
                                        "(<outcome>: win, tie, loss); Wilson interval on the clustered effective size "
                                        "in _ci_low / _ci_high"),
    "metrics/<slice>/judge_loss_minus_win": (FRACTION, "loss rate − win rate, with the clustered, stratified paired "
                                             "score interval in _ci_low / _ci_high (gate.judge_loss_max reads its "
                                             "upper end)"),
    "metrics/<slice>/judge_consistency": (FRACTION, "share of asked prompts whose two orders prefer the same side (or "
                                          "both tie): the judge's order consistency, interval in _ci_low / _ci_high"),
    "metrics/<slice>/judge_consistency_n": ("items", "asked prompts with both verdicts parsed: the consistency's "
                                            "denominator"),
    "metrics/<slice>/judge_first_chosen": (FRACTION, "share of decisive verdicts (A or B) that chose the response "
                                           "shown first: 0.5 for a judge without position bias"),
    "metrics/<slice>/judge_decisive": ("verdicts", "decisive verdicts (A or B), both orders together"),
    "metrics/<slice>/judge_<rate>_ci_low": (FRACTION, "lower bound of that number's interval"),
    "metrics/<slice>/judge_<rate>_ci_high": (FRACTION, "upper bound of that number's interval"),
}
