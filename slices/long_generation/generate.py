"""Long-generation slice: prompts that ask for long free-form output, written for this project.

Four kinds (the sub-slices): ``explain`` (explanations of everyday science and technology),
``story`` (short stories from a premise), ``instructions`` (step-by-step how-tos) and
``code`` (a commented program). Each item is one kind × topic; items of a kind share
phrasing, so the kind's phrasing template is the cluster. Both models generate greedily
from the same prompt (256 new tokens at the quick size, ``harness_longgen``; 1,024 at full,
``harness_longgen_full``); the scorer (``utils.py``) checks each reply for degeneration and
early stops, and :mod:`harness.longgen` compares the two replies token by token.
"""
from __future__ import annotations

from typing import Any

SIZES = {"quick": 24, "full": 48}
KINDS: dict[str, tuple[str, ...]] = {
    "explain": ("Explain in detail how {topic} works, as you would to a curious teenager.",
                "Write a long, clear explanation of {topic}, covering its history and how it works today."),
    "story": ("Write a long story about {topic}. Give the characters names and describe the setting.",
              "Tell a detailed story in which {topic}. Include dialogue and a surprising ending."),
    "instructions": ("Give detailed step-by-step instructions for {topic}. Number the steps and explain each one.",
                     "Write a complete beginner's guide to {topic}, with numbered steps and tips."),
    "code": ("Write a Python program that {topic}. Comment every function and explain how it works.",
             "Implement, in Python, a program that {topic}. Add docstrings and comments, then explain the design."),
}
TOPICS: dict[str, tuple[str, ...]] = {
    "explain": ("a refrigerator", "the internet", "vaccines", "a rainbow", "solar panels", "an airplane wing",
                "the stock market", "photosynthesis", "a microwave oven", "GPS navigation", "the human heart",
                "a compass"),
    "story": ("a lighthouse keeper who finds a message in a bottle", "two friends lost in a snowstorm",
              "a robot learning to paint", "a girl who can talk to birds", "a chef who loses his sense of taste",
              "a village where it never stops raining", "an old map found in a library book",
              "a train that arrives a day late", "a dog waiting at a station", "a musician who forgets every song",
              "a garden that grows overnight", "the last day of summer camp"),
    "instructions": ("baking a loaf of bread", "planting a vegetable garden", "changing a bicycle tyre",
                     "setting up a home aquarium", "learning to juggle", "painting a room",
                     "making a budget for a month", "training a puppy to sit", "building a birdhouse",
                     "preparing for a job interview", "cleaning a laptop keyboard", "brewing a cup of tea"),
    "code": ("keeps a to-do list in a text file", "converts temperatures between units",
             "counts the words in a document", "plays tic-tac-toe against the user", "simulates a bank account",
             "finds prime numbers below a limit", "manages a small library of books",
             "checks whether a password is strong", "sorts a list of students by grade",
             "generates a multiplication table", "reads a CSV file and prints a summary",
             "implements a simple calculator"),
}


def items(size: str = "quick", seed: int = 1234, n_items: int | None = None, **_: Any) -> list[dict]:
    """Kinds in turn, topics in order; the phrasing alternates by topic (``seed`` only names ids)."""
    if size not in SIZES:
        raise ValueError(f"long_generation slice: size={size!r} is unknown; use one of {sorted(SIZES)}")
    total = n_items if n_items is not None else SIZES[size]
    per_kind = -(-total // len(KINDS))
    if per_kind > min(len(t) for t in TOPICS.values()):
        raise ValueError(f"long_generation slice: n_items={total} exceeds the {len(KINDS) * 12} prompts written")
    out: list[dict] = []
    for rank in range(per_kind):
        for kind, templates in KINDS.items():
            template = rank % len(templates)
            prompt = templates[template].format(topic=TOPICS[kind][rank])
            # stratum: the kind (enumerated); cluster: the phrasing template its prompts share (as before)
            out.append({"id": f"longgen-{kind}-{rank:02d}", "sub_slice": kind, "stratum": kind,
                        "cluster": f"{kind}/t{template}", "prompt": prompt, "gold_text": prompt})
    return out[:total]


def dataset(**metadata: Any):
    """lm-eval ``custom_dataset`` hook: the item set as a DatasetDict with a test split."""
    from datasets import Dataset, DatasetDict

    return DatasetDict({"test": Dataset.from_list(items(**metadata))})
