"""Offline calibration text of different kinds: the domain a calibrated method is fitted to.

``quant.calibration.source`` names one of these (or ``dataset``, a ``datasets`` dataset; see
``harness.quant.calibration``). Each source builds one deterministic text from what the
installed packages ship or from a seeded generator; none reads an evaluation item:

- ``prose`` (the default, also called ``offline``, its name before there were several): the
  docstrings of a fixed list of standard-library modules, English technical prose;
- ``code``: the Python source of a fixed list of standard-library modules with their
  docstrings cut out (HumanEval is *not* used: the code slice evaluates on it);
- ``multilingual``: CLDR data shipped with babel for 30 locales in 14 scripts — currency
  names with formatted amounts, measurement units, relative durations, script names (not the
  weekday, month, country or language names the multilingual slice asks about);
- ``math``: generated arithmetic word problems with worked step-by-step solutions (templates
  of this module, not the math slice's).

The text depends on the installed Python and babel versions, so a digest of it (with the
source's name) is part of the calibrated-weight cache key of every source except the default,
whose key is what it was before sources existed.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

DEFAULT = "prose"
ALIASES = {"offline": "prose"}  # the default's original name (quant.calibration.source's default value)


@dataclass(frozen=True)
class CalibrationSource:
    name: str
    kind: str  # one line for listings and error messages
    build: Callable[[], str]  # deterministic text (same packages -> same text)


def _prose() -> str:
    from harness.quant.calibration_sources.prose import prose_text
    return prose_text()


def _code() -> str:
    from harness.quant.calibration_sources.code import code_text
    return code_text()


def _multilingual() -> str:
    from harness.quant.calibration_sources.multilingual import multilingual_text
    return multilingual_text()


def _math() -> str:
    from harness.quant.calibration_sources.math_problems import math_text
    return math_text()


SOURCES: dict[str, CalibrationSource] = {s.name: s for s in (
    CalibrationSource("prose", "English prose: standard-library docstrings (the default)", _prose),
    CalibrationSource("code", "Python: standard-library source without docstrings", _code),
    CalibrationSource("multilingual", "CLDR phrases (babel) in 30 locales, 14 scripts", _multilingual),
    CalibrationSource("math", "generated arithmetic word problems with worked solutions", _math),
)}


def canonical(name: str) -> str:
    """The source a name (or alias) refers to; KeyError for an unknown one."""
    name = ALIASES.get(name, name)
    if name not in SOURCES:
        raise KeyError(name)
    return name


def is_default(name: str) -> bool:
    return ALIASES.get(name, name) == DEFAULT


def names() -> list[str]:
    """Every accepted offline source name, aliases included."""
    return sorted(SOURCES) + sorted(ALIASES)


@lru_cache(maxsize=None)
def source_text(name: str) -> str:
    """The text of an offline source (built once per process)."""
    return SOURCES[canonical(name)].build()


@lru_cache(maxsize=None)
def source_digest(name: str) -> str:
    """sha256 of the source's text (16 hex digits): changes when an upgrade changes the text."""
    return hashlib.sha256(source_text(name).encode("utf-8")).hexdigest()[:16]
