"""Run a slice's lm-eval tasks on an in-memory model and return per-item records.

lm-eval is wrapped once, here: the model is handed to ``HFLM`` as an object, the slice's
directory is the TaskManager's include path (the ~14,700-task registry is only indexed
for registry slices), and the item-set settings travel as task metadata to the slice's
generator. Per-item records keep a stable item id, slice, sub-slice, cluster, score and
the model's response, so two models' records join on the item id.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from harness.slices import Slice

log = logging.getLogger(__name__)

RECORD_COLUMNS = ["item_id", "slice", "task", "sub_slice", "cluster", "output_type", "correct", "response", "target"]


@dataclass(frozen=True)
class EvalSettings:
    batch_size: int = 8
    max_length: int = 2048
    device: str = "cpu"
    chat_template: bool = False
    seed: int = 1234
    tokenizer_path: str | None = None


def make_lm(model: Any, tokenizer: Any, settings: EvalSettings):
    """lm-eval's HF wrapper around an already-loaded (possibly quantized) model."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size,
                max_length=settings.max_length, device=settings.device)


def _response(sample: dict, output_type: str) -> str:
    if output_type == "multiple_choice":
        scores = [r[0] if isinstance(r, (list, tuple)) else r for r in sample["filtered_resps"]]
        return str(max(range(len(scores)), key=lambda i: scores[i]))
    resp = sample["filtered_resps"]
    while isinstance(resp, (list, tuple)) and resp:
        resp = resp[0]
    return str(resp)


def _metric(sample: dict, metric_names: list[str]) -> float:
    for name in metric_names:
        if name in sample:
            return float(sample[name])
    raise KeyError(f"no metric among {metric_names} in lm-eval sample keys {sorted(sample)}")


def checkpoint_files(prefix: str | Path) -> list[Path]:
    """The SQLite files of lm-eval's request cache at ``prefix`` (one per rank: ``<prefix>_rank<N>.db``)."""
    prefix = Path(prefix)
    return sorted(prefix.parent.glob(f"{prefix.name}_rank*.db"))


def checkpoint_rows(prefix: str | Path) -> int:
    """How many requests the checkpoint at ``prefix`` holds (0 when there is none)."""
    total = 0
    for path in checkpoint_files(prefix):
        with contextlib.closing(sqlite3.connect(path)) as db:  # read-write: rolls back a killed writer's journal
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if "unnamed" in tables:  # SqliteDict's default table
                total += db.execute("SELECT COUNT(*) FROM unnamed").fetchone()[0]
    return total


def drop_checkpoint(prefix: str | Path) -> None:
    """Delete the checkpoint at ``prefix`` once the results it protected are safely written."""
    for path in checkpoint_files(prefix):
        path.unlink(missing_ok=True)


def evaluate_slice(lm: Any, slice_: Slice, settings: EvalSettings,
                   checkpoint: str | Path | None = None) -> tuple[pd.DataFrame, dict[str, float]]:
    """Evaluate one slice; returns (per-item records, lm-eval's own aggregate per task).

    ``checkpoint`` is the path prefix of lm-eval's per-request cache (its ``CachingLM``): each
    request's result is written to SQLite as soon as it is computed, so a job killed mid-way and
    started again with the same prefix recomputes only the requests that were not stored. Its
    keys are hashes of the requests alone, not of the model: the prefix must be unique per
    (model, scheme, settings, slice), e.g. under the run's results directory.
    """
    results = run_lm_eval(lm, slice_, settings, checkpoint)
    return records_from_results(results, slice_)


def run_lm_eval(lm: Any, slice_: Slice, settings: EvalSettings, checkpoint: str | Path | None = None) -> dict:
    """``simple_evaluate`` on the slice's tasks with per-sample logs (see :func:`evaluate_slice`)."""
    from lm_eval import simple_evaluate
    from lm_eval.api.model import CacheHook
    from lm_eval.tasks import TaskManager

    registry = slice_.directory is None
    metadata = slice_.metadata(settings.seed, settings.tokenizer_path, settings.max_length)
    manager = TaskManager(include_path=None if registry else str(slice_.directory),
                          include_defaults=registry, metadata=metadata)
    results = simple_evaluate(
        model=lm, tasks=list(slice_.config.tasks), task_manager=manager,
        num_fewshot=slice_.config.num_fewshot, limit=slice_.config.limit,
        apply_chat_template=settings.chat_template, log_samples=True, bootstrap_iters=0,
        random_seed=settings.seed, numpy_random_seed=settings.seed, torch_random_seed=settings.seed,
        fewshot_random_seed=settings.seed, use_cache=None if checkpoint is None else str(checkpoint))
    lm.set_cache_hook(CacheHook(None))  # a later call on this lm must not write into this checkpoint
    return results


def _chosen_filter(task: str, samples: list[dict], wanted: str | None) -> str | None:
    """The lm-eval filter whose scores become the records (None: the task logs no filter name).

    lm-eval logs every item once per filter (gsm8k: strict-match and flexible-extract), so one
    filter per task is kept: ``wanted`` if given (tasks with a single filter keep theirs), else the first.
    """
    names = list(dict.fromkeys(sample.get("filter") for sample in samples))
    if wanted is None or len(names) <= 1:
        return names[0] if names else None
    if wanted not in names:
        raise ValueError(f"task {task!r} has no lm-eval filter {wanted!r}; its filters are {names} "
                         "(set the slice's filter to one of them, or to null for the first)")
    return wanted


def records_from_results(results: dict, slice_: Slice) -> tuple[pd.DataFrame, dict[str, float]]:
    """Per-item records and per-task aggregates from ``simple_evaluate``'s output (``log_samples=True``)."""
    frames = []
    aggregates: dict[str, float] = {}
    for task, all_samples in results["samples"].items():
        task_cfg = results["configs"][task]
        output_type = task_cfg.get("output_type", "generate_until")
        metric_names = [m["metric"] for m in task_cfg.get("metric_list", [])] or ["acc", "exact_match"]
        chosen = _chosen_filter(task, all_samples, slice_.config.filter)
        samples = [sample for sample in all_samples if sample.get("filter") == chosen]
        rows = []
        for sample in samples:
            doc = sample["doc"]
            rows.append({
                "item_id": f"{task}/{doc.get('id', sample['doc_hash'])}",
                "slice": slice_.name,
                "task": task,
                "sub_slice": str(doc.get("sub_slice", "all")),
                "cluster": str(doc.get("cluster", doc.get("id", sample["doc_id"]))),
                "output_type": output_type,
                "correct": _metric(sample, metric_names),
                "response": _response(sample, output_type),
                "target": str(sample.get("target", "")),
            })
        frames.append(pd.DataFrame(rows, columns=RECORD_COLUMNS))
        task_results = results["results"][task]
        for name in metric_names:
            value = task_results.get(f"{name},{chosen or 'none'}")
            if isinstance(value, (int, float)) and not math.isnan(value):
                aggregates[task] = float(value)
                break
    records = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=RECORD_COLUMNS)
    if records["item_id"].duplicated().any():
        dupes = records.loc[records["item_id"].duplicated(), "item_id"].head(3).tolist()
        raise ValueError(f"slice {slice_.name!r} produced duplicate item ids {dupes}: ids must be unique per task")
    return records, aggregates
