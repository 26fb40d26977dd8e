"""Sequential evaluation (``eval.sequential=true``): the candidate answers a slice in rounds and stops once settled.

The statistics (``eval.sequential_method``) are :mod:`harness.stats.group_sequential` (``spending``,
the default: the slice's clustered score test at every round against O'Brien–Fleming-type
α-spending boundaries) or :mod:`harness.stats.sequential` (``betting``: a confidence sequence over
clusters that assumes nothing but bounded scores and i.i.d. clusters, valid however often it is
looked at, and for the same reason slow to settle a slice of few clusters). Both take the same
inputs and rounds and give the same result type; this module runs them inside a job:

1. **The plan** (:func:`plan_slice`), from the reference's records of the slice, before the
   candidate answers anything: the slice's clusters numbered by their sorted labels, a uniform
   random cluster order from ``eval.seed``, and rounds of whole clusters of about
   ``eval.sequential_round_items`` items (default ~1/8 of the slice, at least 8).
2. **The rounds** (:func:`evaluate_sequential`): each round asks lm-eval for exactly its items
   (``samples`` = their document indices, per task) through the run's one request checkpoint, so
   a job killed mid-slice replays its finished rounds from the checkpoint and reaches the same
   decision. After a round the slice's sequence is read with the gate's own rule — pass when the
   (repeated) lower bound at ``gate.alpha`` is above -margin, fail when the upper bound at ``gate.alpha / k``
   (Bonferroni over the k gated slices) is below it — and the slice stops at the first round
   that settles it, once it also has ``gate.min_items`` items and ``gate.min_clusters``
   clusters (the gate would call a smaller slice inconclusive whatever its bounds).
3. **The record**: only answered items enter ``items.parquet`` (with their round and their
   cluster's place in the order); the rest are listed in ``not_evaluated.parquet`` with status
   "not evaluated" — never scored as wrong. ``summary.json["sequential"][slice]`` holds the
   plan, the stop (round, items, reason) and the trajectory (Δ̂ and both bounds after every
   round), and the gate recomputes the same sequence from the two files (:func:`gate_sequence`).

The reference answers every item (once per model and slice, shared by every scheme of a sweep
through the reference cache); the rounds save the candidates' evaluation, the per-scheme cost.
Only lm-eval's registry slices with few-shot prompts are refused (preflight): their few-shot
examples are drawn in document order, so a round's prompts would differ from the reference's.
Each round's prompts are checked against the reference's all the same.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.config import RunConfig
from harness.errors import UsageError
from harness.evaluation import evaluate
from harness.evaluation.slices import Slice
from harness.stats import sequential as seqstats
from harness.stats.strata import design

log = logging.getLogger(__name__)

__all__ = ["SequentialConfigError", "SlicePlan", "StopRule", "check_config", "evaluate_sequential", "fraction_saved",
           "gate_sequence", "items_line", "not_evaluated_frame", "plan_slice", "stop_rule"]


class SequentialConfigError(UsageError):
    """``eval.sequential`` cannot run with this configuration (raised in preflight, before any work)."""


@dataclass(frozen=True)
class StopRule:
    """What settles a slice: the gate's level, its Bonferroni family and margins, its minimum sizes."""

    alpha: float
    family: int
    margins: dict[str, float]
    min_items: int
    min_clusters: int
    method: str = "spending"  # eval.sequential_method
    min_clusters_pass: int = 0  # gate.min_clusters_pass: a spending pass on multi-item clusters needs this many


def stop_rule(cfg: RunConfig, slice_names: list[str]) -> StopRule:
    """The gate's rule for this job's slices (``gate.*``; the margin falls back to ``compare.margin``)."""
    gated = [name for name in slice_names if not cfg.gate.slices or name in cfg.gate.slices]
    correction = cfg.gate.correction or cfg.compare.correction
    family = 1 if correction == "none" else max(1, len(gated))
    default = cfg.gate.margin if cfg.gate.margin is not None else cfg.compare.margin
    margins = {name: float(cfg.gate.margins.get(name, default)) for name in slice_names}
    return StopRule(float(cfg.gate.alpha), family, margins, int(cfg.gate.min_items), int(cfg.gate.min_clusters),
                    cfg.eval.sequential_method, int(cfg.gate.min_clusters_pass))


METHODS = ("betting", "spending")


def method_test(method: str):
    """The sequential test of ``method`` (same signature and result): betting confidence sequence or
    alpha-spending on the score test (:mod:`harness.stats.sequential`, :mod:`harness.stats.group_sequential`)."""
    if method == "betting":
        return seqstats.sequential_test
    if method == "spending":
        from harness.stats.group_sequential import spending_test
        return spending_test
    raise SequentialConfigError(f"eval.sequential_method={method!r} is unknown; use one of {list(METHODS)}")


def run_test(method: str, diffs: np.ndarray, codes: np.ndarray, margin: float, strata: np.ndarray | None,
             **options: Any) -> seqstats.SequentialResult:
    """The sequential test of ``method``; the spending test's looks are stratified by ``strata`` (stratum ids,
    None: none), the betting sequence assumes nothing of the design and takes none."""
    if method == "spending" and strata is not None:
        options["strata"] = strata
    return method_test(method)(diffs, codes, margin, **options)


def _strata(records: pd.DataFrame) -> np.ndarray | None:
    """Stratum ids of the records (docs/explanation/strata.md); None where they declare none."""
    if "stratum" not in records:
        return None
    labels = records["stratum"].astype(object).where(records["stratum"].notna(), "").astype(str)
    return None if labels.nunique() < 2 else _codes(labels)[1]


def _clusters_within(diffs: np.ndarray, codes: np.ndarray, strata: np.ndarray | None) -> int:
    """G - K + 1 over the scored items: the random clusters the gate's min_clusters_pass counts."""
    seen = np.isfinite(diffs)
    _, clusters = np.unique(codes[seen], return_inverse=True)
    layers = None if strata is None else np.unique(strata[seen], return_inverse=True)[1]
    found = design(diffs[seen], clusters, layers)
    return found.n_clusters - found.components + 1


def check_config(cfg: RunConfig, slices: list[Slice]) -> None:
    """Refuse, before any model is loaded, what a sequential evaluation cannot do."""
    if not cfg.eval.sequential:
        return
    method_test(cfg.eval.sequential_method)
    if cfg.eval.sequential_round_items is not None and cfg.eval.sequential_round_items < 1:
        raise SequentialConfigError(f"eval.sequential_round_items={cfg.eval.sequential_round_items} must be >= 1 "
                                    "(or null: about 1/8 of each slice)")
    if cfg.eval.backend != "hf":
        raise SequentialConfigError(f"eval.sequential=true runs with eval.backend=hf only (got {cfg.eval.backend!r}); "
                                    "set eval.sequential=false to evaluate every item through vLLM")
    if not 0 < cfg.gate.alpha < 0.5:
        raise SequentialConfigError(f"gate.alpha={cfg.gate.alpha} must lie in (0, 0.5) to stop slices on it")
    fewshot = [s.name for s in slices if s.directory is None and (s.config.num_fewshot or 0) > 0]
    if fewshot:
        raise SequentialConfigError(
            f"eval.sequential=true cannot evaluate {fewshot} in rounds: lm-eval draws few-shot examples in document "
            "order, so a round's prompts would differ from the reference's; set their num_fewshot=0 or "
            "eval.sequential=false")
    rule = stop_rule(cfg, [s.name for s in slices])
    bad = {name: m for name, m in rule.margins.items() if not 0 < m < 1}
    if bad:
        raise SequentialConfigError(f"margins {bad} must lie in (0, 1) (0.02 = 2 pt): set gate.margin(s) or "
                                    "compare.margin")


@dataclass(frozen=True)
class SlicePlan:
    """A slice's clusters, their order and its rounds, fixed before the candidate answers anything."""

    slice: str
    labels: list[str]  # cluster labels; code g is labels[g] (sorted)
    codes: np.ndarray  # per reference record: its cluster code
    order: np.ndarray  # cluster codes in the order they are scored
    rounds: list[np.ndarray]  # cluster codes of each round
    round_items: int
    seed: int

    @property
    def position(self) -> dict[int, int]:
        """Cluster code -> its place in the order."""
        return {int(code): place for place, code in enumerate(self.order)}

    def round_of(self) -> dict[int, int]:
        """Cluster code -> the round that scores it."""
        return {int(code): index for index, part in enumerate(self.rounds) for code in part}


def _codes(clusters: pd.Series) -> tuple[list[str], np.ndarray]:
    labels = sorted(set(clusters.astype(str)))
    lookup = {label: code for code, label in enumerate(labels)}
    return labels, np.array([lookup[c] for c in clusters.astype(str)], dtype=int)


def plan_slice(ref_records: pd.DataFrame, slice_name: str, seed: int, round_items: int | None) -> SlicePlan:
    """The plan of one slice from its reference records (module docstring, step 1)."""
    labels, codes = _codes(ref_records["cluster"])
    sizes = np.bincount(codes, minlength=len(labels)).astype(float)
    order = seqstats.cluster_order(codes, seed)
    items = seqstats.default_round_items(int(sizes.sum())) if round_items is None else int(round_items)
    return SlicePlan(slice_name, labels, codes, order, seqstats.rounds(order, sizes, items), items, int(seed))


def _may_pass(result: seqstats.SequentialResult, rule: StopRule, within: int | None = None) -> bool:
    """A pass the gate accepts: the betting sequence assumes nothing of the clusters; the score test at the
    looks (spending) needs ``min_clusters_pass`` random clusters (``within``: G - K + 1 of the items scored;
    None: the clusters scored) when clusters hold several items (harness.decision.gate)."""
    clustered = result.n_clusters < result.n
    count = result.n_clusters if within is None else within
    return rule.method == "betting" or not clustered or count >= rule.min_clusters_pass


def _diffs(ref_records: pd.DataFrame, answered: pd.DataFrame) -> np.ndarray:
    """d = quant - ref per reference record, NaN where the candidate has not answered yet."""
    quant = ref_records["item_id"].map(answered.set_index("item_id")["correct"]) if len(answered) else \
        pd.Series(np.nan, index=ref_records.index)
    return quant.to_numpy(float) - ref_records["correct"].to_numpy(float)


def _check_prompts(ref_records: pd.DataFrame, round_records: pd.DataFrame, slice_name: str) -> None:
    """The candidate must have been asked exactly what the reference was asked (same items, same prompts)."""
    merged = round_records[["item_id", "prompt"]].merge(ref_records[["item_id", "prompt"]], on="item_id",
                                                          how="left", suffixes=("", "_ref"), indicator=True)
    unknown = merged.loc[merged["_merge"] != "both", "item_id"].tolist()
    if unknown:
        raise RuntimeError(f"slice {slice_name!r}: a sequential round scored items the reference has not "
                           f"({unknown[:3]}); the slice's items changed between the reference and this job")
    differ = merged.loc[merged["prompt"].astype(str) != merged["prompt_ref"].astype(str), "item_id"].tolist()
    if differ:
        raise RuntimeError(f"slice {slice_name!r}: {len(differ)} items were prompted differently in a sequential round "
                           f"than for the reference (e.g. {differ[:2]}); run it with eval.sequential=false")


def evaluate_sequential(lm: Any, slice_: Slice, settings: evaluate.EvalSettings, checkpoint: Path,
                        ref_records: pd.DataFrame, rule: StopRule, seed: int,
                        round_items: int | None) -> tuple[pd.DataFrame, dict[str, float], dict[str, Any], pd.DataFrame]:
    """The candidate's records of the items it answered, per-task accuracy over them, the slice's
    sequential record for summary.json, and each answered item's round and cluster place
    (``item_id``, ``seq_round`` from 1, ``seq_order`` from 0) for items.parquet (module docstring)."""
    ref_records = ref_records.reset_index(drop=True)
    plan = plan_slice(ref_records, slice_.name, seed, round_items)
    strata = _strata(ref_records)
    margin = rule.margins[slice_.name]
    answered = pd.DataFrame(columns=evaluate.RECORD_COLUMNS)
    round_of = plan.round_of()
    item_round = np.array([round_of[int(code)] for code in plan.codes])
    trajectory: list[dict[str, Any]] = []
    result = None
    reason = "items exhausted"
    for index, part in enumerate(plan.rounds):
        chosen = ref_records[item_round == index]
        samples = {task: sorted(int(i) for i in group["doc_id"]) for task, group in chosen.groupby("task")}
        records, _ = evaluate.evaluate_slice(lm, slice_, settings, checkpoint=checkpoint, samples=samples,
                                             progress_offset=(len(answered), len(ref_records)))
        _check_prompts(ref_records, records, slice_.name)
        answered = pd.concat([answered, records], ignore_index=True)
        diffs = _diffs(ref_records, answered)
        result = run_test(rule.method, diffs, plan.codes, margin, strata, alpha=rule.alpha, family=rule.family,
                          seed=plan.seed, round_items=plan.round_items, stop=False)  # the sequence at this round
        trajectory.append({"round": index + 1, "items": result.n, "clusters": result.n_clusters,
                           "delta": result.estimate, "lower": result.lower, "upper": result.upper})
        big_enough = result.n >= rule.min_items and result.n_clusters >= rule.min_clusters
        if result.state == "pass" and not _may_pass(result, rule, _clusters_within(diffs, plan.codes, strata)):
            big_enough = False  # the gate would not accept this pass (gate.min_clusters_pass): go on
        if result.state != "open" and big_enough:
            reason = (f"pass: lower bound {100 * result.lower:+.1f} pt > -{100 * margin:.1f} pt"
                      if result.state == "pass" else
                      f"fail: upper bound {100 * result.upper:+.1f} pt < -{100 * margin:.1f} pt")
            break
    assert result is not None  # a slice has at least one item, hence one round
    stopped = len(trajectory)
    log.info("slice %s: sequential stop after round %d of %d (%d of %d items): %s", slice_.name, stopped,
             len(plan.rounds), result.n, len(ref_records), reason)
    aggregates = {task: float(group["correct"].astype(float).mean()) for task, group in answered.groupby("task")}
    record = {
        "items_total": int(len(ref_records)), "items_used": int(result.n),
        "clusters_total": len(plan.labels), "clusters_used": int(result.n_clusters),
        "rounds_total": len(plan.rounds), "rounds_used": stopped, "state": result.state, "reason": reason,
        "method": rule.method, "margin": margin, "alpha": rule.alpha, "family": rule.family, "seed": plan.seed,
        "round_items": plan.round_items, "delta": result.estimate, "lower": result.lower, "upper": result.upper,
        "trajectory": trajectory,
    }
    position = plan.position
    placement = pd.DataFrame({"item_id": ref_records["item_id"], "seq_round": item_round + 1,
                              "seq_order": [position[int(code)] for code in plan.codes]})
    placement = placement[placement["item_id"].isin(set(answered["item_id"]))].reset_index(drop=True)
    return answered.reset_index(drop=True), aggregates, record, placement


def gate_sequence(items: pd.DataFrame, not_evaluated: pd.DataFrame | None, record: dict[str, Any], margin: float,
                  alpha: float, family: int) -> seqstats.SequentialResult:
    """The slice's confidence sequence recomputed from its answered items and the ones it skipped,
    at the gate's own α, family and margin (the job's plan: its seed and round size)."""
    design_columns = ["cluster"] + (["stratum"] if "stratum" in items else [])
    rows = items[["item_id", *design_columns, "correct_ref", "correct_quant"]]
    if not_evaluated is not None and len(not_evaluated):
        skipped = not_evaluated.reindex(columns=["item_id", *design_columns])
        rows = pd.concat([rows, skipped.assign(correct_ref=np.nan, correct_quant=np.nan)], ignore_index=True)
    _, codes = _codes(rows["cluster"])
    diffs = rows["correct_quant"].to_numpy(float) - rows["correct_ref"].to_numpy(float)
    return run_test(record["method"], diffs, codes, margin, _strata(rows), alpha=alpha, family=family,
                    seed=int(record["seed"]), round_items=int(record["round_items"]), stop=False)


def not_evaluated_frame(ref_records: pd.DataFrame, answered_ids: set[str]) -> pd.DataFrame:
    """The reference's items the candidate was not asked (status "not evaluated", no score)."""
    columns = ["item_id", "slice", "task", "sub_slice", "cluster", "output_type", "target"]
    rest = ref_records.loc[~ref_records["item_id"].isin(answered_ids),
                           columns + (["stratum"] if "stratum" in ref_records else [])]
    return rest.assign(status="not evaluated").reset_index(drop=True)


def items_line(record: dict[str, Any]) -> str:
    """One line for the console / report: where the slice stopped and why."""
    share = record["items_used"] / max(1, record["items_total"])
    return (f"{record['items_used']}/{record['items_total']} items ({100 * share:.0f} %), round "
            f"{record['rounds_used']}/{record['rounds_total']}: {record['reason']}")


def fraction_saved(records: dict[str, dict[str, Any]]) -> float:
    """Share of the candidate's items not evaluated over the whole job."""
    total = sum(r["items_total"] for r in records.values())
    return math.nan if not total else 1 - sum(r["items_used"] for r in records.values()) / total
