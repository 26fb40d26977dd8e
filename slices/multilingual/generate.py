"""Multilingual slice: the same CLDR-derived items in eleven languages and eight scripts.

Every item is a *concept* (e.g. "the day after Tuesday, shown as the list Sunday, Monday,
Tuesday") asked in each language, with English as the control: a language's gap to English
on the same concepts is what quantization may widen. The text of each item comes from the
Unicode CLDR data shipped with ``babel`` (day and month names, country and language names,
list separators), so the prompts need no translated instructions: each is a list or a table
to continue, after one fixed English line ("Continue the list with the next item."). The
task YAMLs put that line in the user turn and the list itself at the start of the answer
(``gen_prefix``), so a base model completes the list and an instruct model continues it in
its own turn.

Kinds (``kind`` field; the item id names it):

- ``day_next``: three consecutive weekdays, choose the next;
- ``month_next``: three consecutive months, choose the next;
- ``country``: three "ISO 3166 code: country name" lines, then a code; choose its name;
- ``language``: the same with ISO 639 codes and language names ("de: Deutsch", "de: allemand");
- ``day_gen`` / ``month_gen``: as day_next / month_next, but the model writes the name
  (scored by ``utils.process_results``, which normalises script-specific variants).

(A backwards weekday list was tried and dropped: Gemma 3 270M answered it at chance level,
0% with three days shown and 21% with five, continuing forwards in every language.)

Sub-slice = language and script ("ar-Arab"); cluster = the concept, shared by its
translations. ``n_items`` overrides the number of concepts per kind (each asked in every
language). Deterministic: ``random.Random`` with string seeds, CLDR from the installed babel.
"""
from __future__ import annotations

import random
from typing import Any

SIZES = {"quick": 2, "full": 6}  # concepts per kind; items = concepts x kinds x languages
LANGUAGES = {  # language -> ISO 15924 script of its CLDR names
    "en": "Latn", "de": "Latn", "fr": "Latn", "es": "Latn", "ru": "Cyrl", "el": "Grek",
    "ar": "Arab", "hi": "Deva", "zh": "Hans", "ja": "Jpan", "ko": "Kore",
}
CONTROL = "en"  # the control language: every concept is asked in it too
MC_KINDS = ("day_next", "month_next", "country", "language")
GEN_KINDS = ("day_gen", "month_gen")
KINDS = MC_KINDS + GEN_KINDS
N_CHOICES = 4
SHOWN = 3  # list entries (or example table rows) before the one asked for
# Well-known countries, so that the item tests the language rather than geography.
COUNTRIES = (
    "JP", "BR", "EG", "IN", "CN", "DE", "FR", "ES", "IT", "RU", "GR", "MX", "CA", "AU", "KR", "TR",
    "AR", "NG", "KE", "SE", "NO", "PL", "PT", "NL", "CH", "TH", "VN", "ID", "SA", "IR", "PE", "CL",
    "ZA", "MA", "UA", "FI", "IE", "NZ", "CU", "PK",
)
LANGUAGE_CODES = (
    "de", "fr", "es", "it", "pt", "ru", "ja", "zh", "ar", "hi", "ko", "nl", "sv", "pl", "tr", "el",
    "he", "fi", "da", "cs", "hu", "th", "vi", "id", "fa", "uk", "ro", "sw",
)
TABLES = {"country": COUNTRIES, "language": LANGUAGE_CODES}  # kinds shown as "code: name" rows
# One English line before every item, the same in every language. Without it an instruct
# model answers a bare list with an apology (SmolLM2: 0% on the generation items).
INSTRUCTIONS = {"list": "Continue the list with the next item.\n", "table": "Complete the last line of the table.\n"}
# CLDR's Arabic list pattern joins with the conjunction "و"; a list of names needs the comma.
SEPARATOR_OVERRIDES = {"ar": "، "}


def separator(language: str) -> str:
    """The list separator of a language, from CLDR's 'middle' list pattern ("{0}, {1}" -> ", ")."""
    from babel import Locale

    if language in SEPARATOR_OVERRIDES:
        return SEPARATOR_OVERRIDES[language]
    pattern = Locale.parse(language).list_patterns["standard"]["middle"]
    return pattern.replace("{0}", "").replace("{1}", "")


def day_names(language: str) -> list[str]:
    """Monday..Sunday, stand-alone wide forms (nominative where grammar distinguishes)."""
    from babel.dates import get_day_names

    names = get_day_names("wide", context="stand-alone", locale=language)
    return [names[i] for i in range(7)]


def month_names(language: str) -> list[str]:
    from babel.dates import get_month_names

    names = get_month_names("wide", context="stand-alone", locale=language)
    return [names[i] for i in range(1, 13)]


def table_name(kind: str, language: str, code: str) -> str:
    """The CLDR name, in ``language``, of a country (ISO 3166 code) or a language (ISO 639 code)."""
    from babel import Locale

    locale = Locale.parse(language)
    return (locale.territories if kind == "country" else locale.languages)[code]


def _concept(kind: str, index: int, seed: int) -> dict[str, Any]:
    """Language-independent content of one item: which entries are shown, asked and offered."""
    rng = random.Random(f"multilingual/{seed}/{kind}/{index}")
    if kind in TABLES:
        codes = rng.sample(TABLES[kind], SHOWN + N_CHOICES)
        shown, target, distractors = codes[:SHOWN], codes[SHOWN], codes[SHOWN + 1:]
        options = [target, *distractors]
        rng.shuffle(options)
        return {"shown": shown, "target": target, "options": options}
    period = 12 if kind.startswith("month") else 7
    start = rng.randrange(period)
    shown = [(start + i) % period for i in range(SHOWN)]
    target = (start + SHOWN) % period
    others = [i for i in range(period) if i != target]
    options = [target, *rng.sample(others, N_CHOICES - 1)]
    rng.shuffle(options)
    return {"shown": shown, "target": target, "options": options}


def render(kind: str, concept: dict[str, Any], language: str) -> dict[str, Any]:
    """The concept in one language: context, choices (with the separator's space) and answer."""
    if kind in TABLES:
        rows = [f"{code}: {table_name(kind, language, code)}" for code in concept["shown"]]
        context = "\n".join(rows + [f"{concept['target']}:"])
        names = {code: table_name(kind, language, code) for code in concept["options"]}
        lead = " "
    else:
        names = dict(enumerate(month_names(language) if kind.startswith("month") else day_names(language)))
        sep = separator(language)
        context = sep.join(names[i] for i in concept["shown"]) + sep.rstrip()
        lead = sep[len(sep.rstrip()):]
    answer = names[concept["target"]]
    return {
        "instruction": INSTRUCTIONS["table" if kind in TABLES else "list"],
        "context": context,
        "choices": [lead + names[option] for option in concept["options"]],
        "label": concept["options"].index(concept["target"]),
        "answer": answer,
        "gold_text": context + lead + answer,
    }


def items(size: str = "quick", seed: int = 1234, n_items: int | None = None, kinds: list[str] | None = None,
          languages: list[str] | None = None, **_: Any) -> list[dict]:
    """Every concept of every kind in every language; ``kinds``/``languages`` select a subset."""
    if size not in SIZES:
        raise ValueError(f"multilingual size={size!r} is not one of {sorted(SIZES)}")
    chosen_kinds = list(kinds or KINDS)
    chosen_languages = list(languages or LANGUAGES)
    unknown = [k for k in chosen_kinds if k not in KINDS] + [lang for lang in chosen_languages if lang not in LANGUAGES]
    if unknown:
        raise ValueError(f"multilingual: unknown kinds/languages {unknown}; kinds are {KINDS}, "
                         f"languages {list(LANGUAGES)}")
    per_kind = n_items if n_items is not None else SIZES[size]
    out = []
    for kind in chosen_kinds:
        for index in range(per_kind):
            concept = _concept(kind, index, int(seed))
            for language in chosen_languages:
                item = render(kind, concept, language)
                out.append({
                    "id": f"ml-{seed}-{kind}-{index:03d}-{language}",
                    "sub_slice": f"{language}-{LANGUAGES[language]}",
                    # stratum: the language (enumerated); cluster: the concept, asked in every language
                    # (a parallel question, drawn at random: clusters cross the strata)
                    "stratum": language,
                    "cluster": f"{kind}-{index:03d}",
                    "language": language,
                    "script": LANGUAGES[language],
                    "kind": kind,
                    **item,
                })
    return out


def divergence_texts(seed: int = 1234, languages: list[str] | None = None, **_: Any) -> list[str]:
    """One text per language: its gold texts of the first concept of each multiple-choice kind
    (the same concepts in every language), so KL can be read per language. Kept short on
    purpose, whatever the size: the exact reference stores tokens x vocabulary floats, and
    Gemma 3's vocabulary is 262k (1 MB per token)."""
    by_language: dict[str, list[str]] = {}
    for item in items(seed=seed, n_items=1, kinds=list(MC_KINDS), languages=languages):
        by_language.setdefault(item["language"], []).append(item["gold_text"])
    return ["\n\n".join(texts) for texts in by_language.values()]


def dataset(task_kinds: str = "mc", **metadata: Any):
    """lm-eval ``custom_dataset`` hook: the multiple-choice (``mc``) or generation (``gen``) items."""
    from datasets import Dataset, DatasetDict

    groups = {"mc": MC_KINDS, "gen": GEN_KINDS}
    if task_kinds not in groups:
        raise ValueError(f"multilingual dataset_kwargs.task_kinds={task_kinds!r} is not one of {sorted(groups)}")
    return DatasetDict({"test": Dataset.from_list(items(kinds=list(groups[task_kinds]), **metadata))})
