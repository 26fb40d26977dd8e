"""Scoring of the multilingual generation items: a written name against the CLDR name.

A response is reduced to its first list entry (up to the first separator of any script or
a line break) and both sides are normalised so that spelling variants that are equally
correct compare equal, while different words do not:

- Unicode NFKC (full-width "１月" is "1月"; Devanagari nukta letters compose one way);
- case folding (Greek final sigma, German sharp s);
- Greek without tonos and diaeresis (Greek capitals are written without accents, so
  "ΠΕΜΠΤΗ" is a correct spelling of "Πέμπτη"); other scripts keep their accents;
- Arabic without short-vowel marks or tatweel, hamza-carrying alefs read as bare alef and
  Persian yeh/kaf as Arabic (common orthographic variants);
- zero-width characters removed, whitespace collapsed, surrounding punctuation dropped.

The prediction is right when it equals the gold name or starts with it followed by a space
(a spaced script) or by anything (scripts written without spaces: Han, kana, Thai).
"""
from __future__ import annotations

import re
import unicodedata

_SEPARATORS = re.compile(r"[,،、;；。.\n!?！？:：]")
_ZERO_WIDTH = re.compile(r"[\u200b-\u200f\u2060\ufeff]")
_ARABIC_MARKS = re.compile(r"[\u0610-\u061a\u064b-\u065f\u0670\u06d6-\u06ed\u0640]")
_ARABIC_LETTERS = str.maketrans({"أ": "ا", "إ": "ا", "آ": "ا", "ٱ": "ا", "ی": "ي", "ک": "ك"})
_GREEK_ACCENTS = {"\u0301", "\u0308", "\u0342", "\u0313", "\u0314", "\u0344", "\u0345"}
_EDGE_PUNCTUATION = "\"'«»“”„‘’()[]{}*-–—_·「」『』《》"


def _strip_greek_accents(text: str) -> str:
    decomposed = unicodedata.normalize("NFD", text)
    out: list[str] = []
    for char in decomposed:
        if char in _GREEK_ACCENTS and out and "GREEK" in unicodedata.name(out[-1], ""):
            continue
        out.append(char)
    return unicodedata.normalize("NFC", "".join(out))


def normalize(text: str) -> str:
    """The comparable form of a name (see the module docstring for the rules)."""
    text = unicodedata.normalize("NFKC", text)
    text = _ZERO_WIDTH.sub("", text)
    text = _ARABIC_MARKS.sub("", text).translate(_ARABIC_LETTERS)
    text = _strip_greek_accents(text.casefold())
    text = " ".join(text.split())
    return text.strip(_EDGE_PUNCTUATION + " ")


def first_entry(response: str) -> str:
    """The response up to its first list separator or line break, of any script."""
    return _SEPARATORS.split(response.strip(), maxsplit=1)[0]


def _unspaced(char: str) -> bool:
    name = unicodedata.name(char, "")
    return any(script in name for script in ("CJK", "HIRAGANA", "KATAKANA", "THAI", "IDEOGRAPH"))


def matches(response: str, gold: str) -> bool:
    """Whether the response's first entry names ``gold``."""
    predicted, expected = normalize(first_entry(response)), normalize(gold)
    if not expected or not predicted:
        return False
    if predicted == expected or predicted.startswith(expected + " "):
        return True
    return predicted.startswith(expected) and _unspaced(expected[-1])


def process_results(doc: dict, results: list[str]) -> dict[str, int]:
    return {"acc": int(matches(results[0], doc["answer"]))}
