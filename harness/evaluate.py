"""Run a slice's lm-eval tasks on an in-memory model and return per-item records.

lm-eval is wrapped once, here: the model is handed to ``HFLM`` as an object, the slice's
directory is the TaskManager's include path (the ~14,700-task registry is only indexed
for registry slices), and the item-set settings travel as task metadata to the slice's
generator. Per-item records keep a stable item id, slice, sub-slice, cluster, score and
the model's response, so two models' records join on the item id.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
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


def evaluate_slice(lm: Any, slice_: Slice, settings: EvalSettings) -> tuple[pd.DataFrame, dict[str, float]]:
    """Evaluate one slice; returns (per-item records, lm-eval's own aggregate per task)."""
    from lm_eval import simple_evaluate
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
        fewshot_random_seed=settings.seed)
    frames = []
    aggregates: dict[str, float] = {}
    for task, samples in results["samples"].items():
        task_cfg = results["configs"][task]
        output_type = task_cfg.get("output_type", "generate_until")
        metric_names = [m["metric"] for m in task_cfg.get("metric_list", [])] or ["acc", "exact_match"]
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
            value = task_results.get(f"{name},none")
            if isinstance(value, (int, float)) and not math.isnan(value):
                aggregates[task] = float(value)
                break
    records = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=RECORD_COLUMNS)
    if records["item_id"].duplicated().any():
        dupes = records.loc[records["item_id"].duplicated(), "item_id"].head(3).tolist()
        raise ValueError(f"slice {slice_.name!r} produced duplicate item ids {dupes}: ids must be unique per task")
    return records, aggregates
