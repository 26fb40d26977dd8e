"""Per-reply checks of the long-generation slice (lm-eval ``process_results``).

A reply **passes** (``acc = 1``) when it is long and not degenerate:

* ``repeat_rate`` ≤ ``MAX_REPEAT_RATE``: the fraction of its word 4-grams that repeat an
  earlier 4-gram of the same reply (fluent prose stays far below; a model that circles back
  to the same sentence climbs fast);
* no ``loop``: the reply does not end in a block of 1–32 words repeated at least
  ``LOOP_REPEATS`` times back to back (the classic low-bit failure: "and the and the ...");
* no ``early_stop``: at least ``MIN_WORDS`` words (the prompts ask for long output; a reply
  that ends after a sentence has lost the task).

The paired statistics then count flips of this criterion; :mod:`harness.results.longgen` adds what
needs both replies (first differing token, survival curve, length ratio).
"""
from __future__ import annotations

import re

MAX_REPEAT_RATE = 0.25
LOOP_REPEATS = 3
MIN_WORDS = 60
_WORD = re.compile(r"\S+")


def words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def repeat_rate(tokens: list[str], n: int = 4) -> float:
    """Fraction of the ``n``-grams of ``tokens`` that already occurred earlier in it (0 for < n tokens)."""
    seen: set[tuple[str, ...]] = set()
    repeats = total = 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        total += 1
        repeats += gram in seen
        seen.add(gram)
    return repeats / total if total else 0.0


def ends_in_loop(tokens: list[str], repeats: int = LOOP_REPEATS, min_block: int = 1, max_block: int = 32) -> bool:
    """Whether ``tokens`` end in a block of ``min_block``..``max_block`` tokens repeated ``repeats`` times."""
    for size in range(min_block, max_block + 1):
        if size * repeats > len(tokens):
            break
        block = tokens[-size:]
        if all(tokens[-size * (k + 1): len(tokens) - size * k] == block for k in range(repeats)):
            return True
    return False


def score(response: str) -> dict[str, float]:
    tokens = words(response)
    rate = repeat_rate(tokens)
    loop = ends_in_loop(tokens)
    early = len(tokens) < MIN_WORDS
    passed = rate <= MAX_REPEAT_RATE and not loop and not early
    return {"acc": int(passed), "repeat_rate": rate, "loop": int(loop), "early_stop": int(early),
            "n_words": float(len(tokens))}


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval hook: ``acc`` is the pass criterion; the rest say why a reply failed."""
    return score(results[0])
