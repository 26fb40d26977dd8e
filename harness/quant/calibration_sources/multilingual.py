"""The ``multilingual`` calibration source: CLDR phrases in 30 locales, from the installed babel.

Per locale, in its own script: each currency's name with an amount formatted the locale's way
("dirham des Émirats arabes unis : 1 234,50 AED"), measurement units spelled out with numbers
("3 kilomètres par heure"), relative durations ("dans 3 jours", "il y a 2 semaines") and the
names of writing systems, joined with the locale's own list pattern. The numbers come from a
seeded generator. Weekday, month, country and language names are left out: the multilingual
slice asks about exactly those, and calibration never sees evaluation content.
"""
from __future__ import annotations

import random
from datetime import timedelta

# The multilingual slice's eleven languages first, then nineteen more; fixed so machines agree.
LOCALES = (
    "en", "de", "fr", "es", "ru", "el", "ar", "hi", "zh", "ja", "ko",
    "it", "pt", "nl", "pl", "tr", "uk", "cs", "sv", "fi", "hu", "ro", "he", "fa", "th", "vi", "id",
    "sw", "bn", "ta",
)
DURATIONS = ("second", "minute", "hour", "day", "week", "month", "year")
_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 604800, "month": 2592000,
            "year": 31536000}
UNITS_PER_LINE = 4


def _currency_lines(locale: str, rng: random.Random) -> list[str]:
    from babel import Locale
    from babel.numbers import format_currency

    lines = []
    for code, name in sorted(Locale.parse(locale).currencies.items()):
        amount = rng.randint(1, 999_999) / 100
        lines.append(f"{name}: {format_currency(amount, code, locale=locale)}")
    return lines


def _unit_lines(locale: str, rng: random.Random) -> list[str]:
    from babel import Locale
    from babel.lists import format_list
    from babel.units import format_unit

    phrases = []
    for unit in sorted(Locale.parse(locale)._data["unit_patterns"]):
        try:
            phrases.append(format_unit(rng.choice((1, 2, 3, 5, 12, 21, 100, 2.5)), unit, length="long", locale=locale))
        except (KeyError, ValueError):  # a unit this locale has no long pattern for
            continue
    return [format_list(phrases[i:i + UNITS_PER_LINE], locale=locale) for i in range(0, len(phrases), UNITS_PER_LINE)]


def _duration_lines(locale: str, rng: random.Random) -> list[str]:
    from babel.dates import format_timedelta

    lines = []
    for unit in DURATIONS:
        for sign in (1, -1):
            count = rng.randint(2, 9)
            lines.append(format_timedelta(timedelta(seconds=sign * count * _SECONDS[unit]), threshold=10,
                                          granularity=unit, add_direction=True, locale=locale))
    return lines


def _script_lines(locale: str) -> list[str]:
    from babel import Locale
    from babel.lists import format_list

    names = [name for _, name in sorted(Locale.parse(locale).scripts.items())]
    return [format_list(names[i:i + 6], locale=locale) for i in range(0, len(names), 6)]


def locale_text(locale: str) -> str:
    """One locale's phrases, one per line (seeded by the locale, so each is reproducible alone)."""
    rng = random.Random(f"calibration-multilingual/{locale}")
    sections = (_currency_lines(locale, rng), _unit_lines(locale, rng), _duration_lines(locale, rng),
                _script_lines(locale))
    return "\n\n".join("\n".join(lines) for lines in sections if lines)


def multilingual_text() -> str:
    return "\n\n".join(locale_text(locale) for locale in LOCALES)
