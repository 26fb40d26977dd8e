"""Prompts slice: your prompt log as items (harness.evaluation.prompt_log reads, checks and samples it).

``path`` is ``prompts.path`` (unset: the packaged ``example_log.jsonl``, ~240 chat prompts of a fictional
product's traffic across seven use cases, written for this project by ``make_example_log.py``). An item keeps its
row's chat messages (as JSON, rendered by the model's chat template in utils.PromptLogTask), a plain rendering for
models without one, its group (the cluster), its stratum (the sub-slice) and its own token cap. ``sample`` (or
the slice's ``n_items``) draws a seeded sample, stratified by stratum. No gold answer: ``gold_text`` is absent, so
the divergence stage measures KL along the reference's own replies.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parent / "example_log.jsonl"


def log_path(path: str | None) -> Path:
    """The log a run reads: ``path`` as given (relative to the working directory), else the packaged example."""
    return EXAMPLE if path in (None, "") else Path(str(path)).expanduser().resolve()


def items(path: str | None = None, field: str | None = None, sample: int | None = None, seed: int = 1234,
          n_items: int | None = None, max_tokens: int | None = None, **_: Any) -> list[dict]:
    from harness.evaluation import prompt_log

    count = sample if sample is not None else n_items
    out = []
    for item in prompt_log.items(log_path(path), field=field, sample=count, seed=seed):
        cap = int(item.get("max_tokens") or 0)
        out.append({
            "id": str(item["item_id"]), "sub_slice": item["sub_slice"], "stratum": item["stratum"],
            "cluster": item["cluster"], "prompt": item["prompt"],
            "messages_json": json.dumps(item["messages"], ensure_ascii=False),
            "max_tokens": cap if cap > 0 else int(max_tokens or 0),
            "reference_reply": item.get("reference_reply") or "",
        })
    return out


def dataset(**metadata: Any):
    """lm-eval ``custom_dataset`` hook: the item set as a DatasetDict with a test split."""
    from datasets import Dataset, DatasetDict

    return DatasetDict({"test": Dataset.from_list(items(**metadata))})
