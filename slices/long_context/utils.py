"""Scoring for the long-context slice: every expected value present, no distractor present.

Needle values are 7-digit numbers and variable names five capital letters. A response is
right when it names every expected answer and none of the distractors (another key's
value in multi-key retrieval, a variable of the decoy chain in variable tracking), so a
model that lists everything it saw earns nothing. Numbers are matched as whole digit runs
after removing group separators ("4,821,937" and "4 821 937" read as 4821937, while
"48219370" does not contain 4821937); names are matched as whole words, ignoring case.
"""
from __future__ import annotations

import re

# A grouped number: 1-3 leading digits, then groups of three behind one repeated separator.
_GROUPED = re.compile(r"(?<![\d,.])\d{1,3}([,.\u00a0\u202f ])\d{3}(?:\1\d{3})*(?![\d])")
_DIGITS = re.compile(r"\d+")
_WORD = re.compile(r"[A-Za-z]+")


def numbers_in(response: str) -> set[str]:
    """Whole digit runs in the response, with thousands separators removed."""
    ungrouped = _GROUPED.sub(lambda m: re.sub(r"\D", "", m.group(0)), response)
    return set(_DIGITS.findall(ungrouped))


def words_in(response: str) -> set[str]:
    """Whole alphabetic words in the response, upper-cased."""
    return {word.upper() for word in _WORD.findall(response)}


def found(response: str, expected: str) -> bool:
    """Whether one expected answer (a number or a variable name) occurs in the response as a whole token."""
    expected = expected.strip()
    if expected.isdigit():
        return expected in numbers_in(response)
    return expected.upper() in words_in(response)


def is_correct(response: str, answers: list[str], distractors: list[str]) -> bool:
    return all(found(response, a) for a in answers) and not any(found(response, d) for d in distractors)


def process_results(doc: dict, results: list[str]) -> dict[str, int]:
    return {"acc": int(is_correct(results[0], list(doc["answers"]), list(doc["distractors"] or [])))}
