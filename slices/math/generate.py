"""Math slice: multi-step integer arithmetic with exact answers, generated from a seed.

Difficulty is two sub-slice axes: the number of operations (steps) and operand size
(digits). The full size covers steps=1..3 x digits=1..3; the quick size keeps the easy corner
(steps + digits <= 3: 1/1, 1/2, 2/1), where SmolLM2-135M (the default model) is right often
enough for a drop to show: measured 0.62 on steps=1/digits=1, 0.08 on 1/2, 0.04 on 2/1, 0.00 on
2/2 (24 items each); the 3-step and 3-digit cells are a floor for it. Sampling design (docs/explanation/strata.md):
the stratum is the (kind, steps, digits) cell, which the generator enumerates; every item is its own
cluster, since its numbers and its template are drawn independently of every other item's (the
template is a random attribute of an item, not a cell: its count per cell varies by seed). The same seed gives the same items on every machine (Python's
``random.Random`` with a string seed is stable across platforms and versions).
"""
from __future__ import annotations

import random
from typing import Any

SIZES = {"quick": 96, "full": 360}
# (steps, digits) cells per size: full is the whole 3 x 3 grid, quick its easy corner (steps + digits <= 3).
GRIDS = {"quick": ((1, 1), (1, 2), (2, 1)), "full": tuple((s, d) for s in (1, 2, 3) for d in (1, 2, 3))}
TEMPLATES = (
    "Compute {expr}.",
    "What is {expr}?",
    "Calculate the value of {expr}.",
)
WORD_TEMPLATES = (
    "A shop has {a} apples. It receives {b} more and then sells {c}. How many apples are left?",
    "Tom has {a} coins. He finds {b} more coins and gives away {c}. How many coins does Tom have now?",
)


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 1, 10**digits - 1)


def _expression(rng: random.Random, steps: int, digits: int) -> tuple[str, int]:
    value = _operand(rng, digits)
    text = str(value)
    for _ in range(steps):
        op = rng.choice("+-*" if digits == 1 else "+-")
        operand = _operand(rng, digits)
        text = f"{text} {op} {operand}"
        value = eval(text)  # noqa: S307 - integers and + - * only; usual precedence
    return text, int(value)


def _choices(rng: random.Random, answer: int) -> tuple[list[str], int]:
    offsets = rng.sample([-10, -2, -1, 1, 2, 10, 3, -3], 3)
    options = [answer] + [answer + o for o in offsets]
    rng.shuffle(options)
    return [str(o) for o in options], options.index(answer)


def items(size: str = "quick", seed: int = 1234, n_items: int | None = None, **_: Any) -> list[dict]:
    """The slice's items; every item carries id, sub_slice, stratum, cluster and gold_text."""
    if size not in SIZES:
        raise ValueError(f"math slice: size={size!r} is unknown; use one of {sorted(SIZES)}")
    total = n_items or SIZES[size]
    rng = random.Random(f"math/{seed}")
    grid = GRIDS[size]
    out: list[dict] = []
    for index in range(total):
        steps, digits = grid[index % len(grid)]
        kind = "word" if index % 5 == 4 and steps == 2 else "expr"
        if kind == "word":
            a, b = _operand(rng, digits + 1), _operand(rng, digits)
            c = rng.randint(1, a + b)
            template = rng.randrange(len(WORD_TEMPLATES))
            question, answer = WORD_TEMPLATES[template].format(a=a, b=b, c=c), a + b - c
        else:
            expr, answer = _expression(rng, steps, digits)
            template = rng.randrange(len(TEMPLATES))
            question = TEMPLATES[template].format(expr=expr)
        choices, label = _choices(rng, answer)
        out.append({
            "id": f"math-{seed}-{index:05d}",
            "sub_slice": f"steps={steps}/digits={digits}",
            # stratum: the enumerated (kind, steps, digits) cell; cluster: the item (numbers and template drawn per item)
            "stratum": f"{kind}-s{steps}-d{digits}",
            "cluster": f"math-{seed}-{index:05d}",
            "template": template,
            "question": question,
            "answer": str(answer),
            "choices": choices,
            "label": label,
            "gold_text": f"{question} Answer: {answer}",
        })
    return out


def dataset(**metadata: Any):
    """lm-eval ``custom_dataset`` hook: the item set as a DatasetDict with a test split."""
    from datasets import Dataset, DatasetDict

    return DatasetDict({"test": Dataset.from_list(items(**metadata))})
