"""Scoring for the math slice: exact numeric answers, tolerant of formatting."""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str) -> Decimal | None:
    """'1,000', '1000', '1000.0' and ' 1000. ' all normalise to Decimal('1000')."""
    text = text.strip().rstrip(".").replace(",", "")
    try:
        return Decimal(text).normalize()
    except InvalidOperation:
        return None


def extract_answer(response: str) -> Decimal | None:
    """The first number after 'answer' if present, else the last number in the response."""
    lowered = response.lower()
    anchor = max(lowered.rfind("answer"), lowered.rfind("="))
    window = response[anchor:] if anchor >= 0 else response
    found = _NUMBER.findall(window) or _NUMBER.findall(response)
    if not found:
        return None
    return normalize_number(found[0] if anchor >= 0 and _NUMBER.findall(window) else found[-1])


def process_results(doc: dict, results: list[str]) -> dict[str, int]:
    predicted = extract_answer(results[0])
    return {"acc": int(predicted is not None and predicted == normalize_number(doc["answer"]))}
