"""team_compare: which of two numbers is larger, as two-way multiple choice (a user's slice, outside the package).

Items are a pure function of the seed: each carries an id, a sub-slice (the digits of its numbers), a stratum
(the same cell) and a cluster (the item itself), and a gold text for the divergence measures.
"""
from __future__ import annotations

import random
from typing import Any

SIZES = {"quick": 24, "full": 120}


def items(size: str = "quick", seed: int = 1234, n_items: int | None = None, **_: Any) -> list[dict]:
    rng = random.Random(f"team_compare/{seed}")
    out = []
    for index in range(n_items or SIZES[size]):
        digits = 1 + index % 2
        low, high = 10 ** (digits - 1), 10 ** digits - 1
        a, b = rng.sample(range(low, high + 1), 2)
        larger = max(a, b)
        question = f"Which number is larger, {a} or {b}?"
        out.append({
            "id": f"team_compare-{seed}-{index:04d}",
            "sub_slice": f"digits={digits}",
            "stratum": f"digits={digits}",
            "cluster": f"team_compare-{seed}-{index:04d}",
            "question": question,
            "choices": [str(a), str(b)],
            "label": [a, b].index(larger),
            "gold_text": f"{question}\nAnswer: {larger}",
        })
    return out


def dataset(**metadata: Any):
    """lm-eval's ``custom_dataset`` hook: the items as a test split."""
    from datasets import Dataset, DatasetDict

    return DatasetDict({"test": Dataset.from_list(items(**metadata))})
