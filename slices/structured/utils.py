"""Scoring for the structured-output slice: parse, validate against the schema, compare values.

An answer scores 1 iff (a) a JSON object can be taken from the response: the whole
response, the inside of a Markdown fence, or, unless the item demands JSON only, the first
object embedded in prose; (b) it validates against the item's schema; (c) its values equal
the expected ones after normalisation (strings compared case- and whitespace-insensitively,
numbers numerically, booleans exactly, lists in order); and (d) for ``check_key_order``
items, its top-level keys come in the expected order.

Parsing is strict JSON: trailing commas, single quotes, comments, NaN/Infinity and
duplicate keys make an answer wrong, because a consumer's JSON parser would reject or
misread it.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from jsonschema import Draft202012Validator

_FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n(.*?)\n?[ \t]*```", re.DOTALL | re.IGNORECASE)


class _Rejected(ValueError):
    """Valid for Python's json module but not for a strict JSON consumer."""


def _no_constants(name: str) -> Any:
    raise _Rejected(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _Rejected(f"duplicate keys in {keys}")
    return dict(pairs)


_DECODER = json.JSONDecoder(parse_constant=_no_constants, object_pairs_hook=_unique_keys)


def parse_strict(text: str) -> Any:
    """``json.loads`` without Python's extensions; raises ValueError on anything a strict parser rejects."""
    value, end = _DECODER.raw_decode(text.strip())
    if end != len(text.strip()):
        raise ValueError(f"extra text after the JSON value: {text.strip()[end:end + 40]!r}")
    return value


def extract_json(response: str, *, json_only: bool = False) -> dict | None:
    """The JSON object a response carries, or None.

    ``json_only``: only a response that is exactly one JSON object (surrounding whitespace aside) counts.
    Otherwise a fenced block is tried first, then the whole response, then each ``{`` in turn as
    the start of an object followed by anything.
    """
    candidates: list[str] = [response]
    if not json_only:
        candidates = [m.group(1) for m in _FENCE.finditer(response)] + candidates
    for candidate in candidates:
        try:
            value = parse_strict(candidate)
        except ValueError:
            continue
        return value if isinstance(value, dict) else None
    if json_only:
        return None
    for match in re.finditer(r"\{", response):
        try:
            value, _ = _DECODER.raw_decode(response, match.start())
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _normal_text(text: str) -> str:
    return " ".join(text.split()).casefold()


def values_match(actual: Any, expected: Any) -> bool:
    """Equality after normalisation; bool is never a number, a number never a string."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, (int, float)):
        return isinstance(actual, (int, float)) and math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(expected, str):
        return isinstance(actual, str) and _normal_text(actual) == _normal_text(expected)
    if isinstance(expected, list):
        return (isinstance(actual, list) and len(actual) == len(expected)
                and all(values_match(a, e) for a, e in zip(actual, expected)))
    if isinstance(expected, dict):
        return (isinstance(actual, dict) and set(actual) == set(expected)
                and all(values_match(actual[k], v) for k, v in expected.items()))
    return actual == expected


def score(doc: dict, response: str) -> dict[str, int]:
    """Per-check verdicts for one item: parsed, schema_valid, values_match and their conjunction acc."""
    expected = json.loads(doc["expected"])
    answer = extract_json(response, json_only=bool(doc.get("json_only", False)))
    parsed = answer is not None
    valid = parsed and not any(Draft202012Validator(json.loads(doc["schema"])).iter_errors(answer))
    right = valid and values_match(answer, expected)
    if right and doc.get("check_key_order", False):
        right = list(answer) == list(expected)
    return {"acc": int(right), "parsed": int(parsed), "schema_valid": int(valid)}


def process_results(doc: dict, results: list[str]) -> dict[str, int]:
    """lm-eval hook: ``acc`` is the item's score; ``parsed`` and ``schema_valid`` say where a miss happened."""
    return score(doc, results[0])
