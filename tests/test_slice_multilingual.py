"""The multilingual slice: deterministic CLDR items in every language and script, the same
concepts as the English control, answers checked against independent references (Python's
calendar module and hand-written names), the normalising scorer, and an lm-eval run on the
tiny random model."""
from __future__ import annotations

import calendar

import pytest

from harness.config import SLICES_DIR, compose
from harness.evaluation.slices import import_slice_module, resolve

generate = import_slice_module(SLICES_DIR / "multilingual", "generate")
utils = import_slice_module(SLICES_DIR / "multilingual", "utils")


def test_same_seed_same_items_other_seed_other_items() -> None:
    first = generate.items(size="quick", seed=7)
    assert first == generate.items(size="quick", seed=7)
    other = generate.items(size="quick", seed=8)
    assert [i["context"] for i in first] != [i["context"] for i in other]
    assert len({i["id"] for i in first}) == len(first)


def test_quick_items_are_a_subset_of_full() -> None:
    quick = {i["id"]: i for i in generate.items(size="quick", seed=3)}
    full = {i["id"]: i for i in generate.items(size="full", seed=3)}
    assert len(full) == 3 * len(quick)
    assert all(full[key] == item for key, item in quick.items())


def test_languages_scripts_and_kinds_covered() -> None:
    items = generate.items(size="quick", seed=1)
    languages = {i["language"] for i in items}
    scripts = {i["script"] for i in items}
    assert len(languages) >= 8 and generate.CONTROL == "en" and "en" in languages
    assert len(scripts) >= 4
    assert {"Latn", "Cyrl", "Grek", "Arab", "Deva", "Hans", "Jpan"} <= scripts
    assert {i["sub_slice"] for i in items} == {f"{lang}-{script}" for lang, script in generate.LANGUAGES.items()}
    assert {i["kind"] for i in items} == set(generate.KINDS)


def test_every_concept_is_asked_in_every_language_with_the_same_answer_position() -> None:
    items = generate.items(size="full", seed=2)
    by_cluster: dict[str, list[dict]] = {}
    for item in items:
        by_cluster.setdefault(item["cluster"], []).append(item)
    for cluster, members in by_cluster.items():
        assert sorted(m["language"] for m in members) == sorted(generate.LANGUAGES), cluster
        assert len({m["label"] for m in members}) == 1
        assert len({len(m["choices"]) for m in members}) == 1


def test_english_answers_match_python_calendar() -> None:
    """Independent reference: the C locale's day and month names in the calendar module."""
    days, months = list(calendar.day_name), list(calendar.month_name)[1:]
    for item in generate.items(size="full", seed=5, languages=["en"]):
        if item["kind"] in generate.TABLES:
            continue
        names = months if item["kind"].startswith("month") else days
        shown = item["context"].rstrip(",").split(", ")
        for before, after in zip(shown, shown[1:]):
            assert names[(names.index(before) + 1) % len(names)] == after
        assert item["answer"] == names[(names.index(shown[-1]) + 1) % len(names)]
        assert item["choices"][item["label"]] == " " + item["answer"]


def test_choices_are_distinct_and_hold_the_answer() -> None:
    for item in generate.items(size="full", seed=6):
        assert item["instruction"] in generate.INSTRUCTIONS.values()
        assert len(set(item["choices"])) == generate.N_CHOICES, item["id"]
        assert item["choices"][item["label"]].strip() == item["answer"]


@pytest.mark.parametrize("kind,code,english,german,russian", [
    ("country", "JP", "Japan", "Japan", "Япония"), ("country", "EG", "Egypt", "Ägypten", "Египет"),
    ("language", "fr", "French", "Französisch", "французский"), ("language", "ja", "Japanese", "Japanisch", "японский"),
])
def test_table_names_against_hand_written_ones(kind: str, code: str, english: str, german: str, russian: str) -> None:
    assert [generate.table_name(kind, lang, code) for lang in ("en", "de", "ru")] == [english, german, russian]


@pytest.mark.parametrize("language,thursday,april", [
    ("de", "Donnerstag", "April"), ("fr", "jeudi", "avril"), ("es", "jueves", "abril"),
    ("ru", "четверг", "апрель"), ("el", "Πέμπτη", "Απρίλιος"), ("ar", "الخميس", "أبريل"),
    ("hi", "गुरुवार", "अप्रैल"), ("zh", "星期四", "四月"), ("ja", "木曜日", "4月"), ("ko", "목요일", "4월"),
])
def test_cldr_names_against_hand_written_ones(language: str, thursday: str, april: str) -> None:
    assert generate.day_names(language)[3] == thursday
    assert generate.month_names(language)[3] == april


def test_separators_follow_the_script() -> None:
    by_language = {i["language"]: i for i in generate.items(size="quick", seed=1, kinds=["day_next"])}
    assert by_language["zh"]["context"].count("、") == 3 and not by_language["zh"]["choices"][0].startswith(" ")
    assert by_language["ar"]["context"].count("،") == 3 and by_language["ar"]["choices"][0].startswith(" ")
    assert by_language["de"]["context"].count(", ") == 2 and by_language["de"]["context"].endswith(",")
    for item in by_language.values():
        assert item["gold_text"] == item["context"] + item["choices"][item["label"]]


@pytest.mark.parametrize("kind", ["country", "language"])
def test_table_items_use_iso_codes_and_localised_names(kind: str) -> None:
    items = {i["language"]: i for i in generate.items(size="quick", seed=1, kinds=[kind])}
    en, de = items["en"], items["de"]
    assert en["context"].splitlines()[:-1] != de["context"].splitlines()[:-1]
    assert [line.split(":")[0] for line in en["context"].splitlines()] == \
           [line.split(":")[0] for line in de["context"].splitlines()]


def test_unknown_language_or_size_is_refused() -> None:
    with pytest.raises(ValueError, match="xx"):
        generate.items(languages=["xx"])
    with pytest.raises(ValueError, match="size='huge'"):
        generate.items(size="huge")


def test_divergence_texts_one_per_language() -> None:
    texts = generate.divergence_texts(size="quick", seed=1)
    assert len(texts) == len(generate.LANGUAGES)
    assert "星期" in texts[list(generate.LANGUAGES).index("zh")]


@pytest.mark.parametrize("response,gold,expected", [
    (" Thursday", "Thursday", True),
    (" thursday, Friday", "Thursday", True),
    ("THURSDAY\nFriday", "Thursday", True),
    (" Thursday evening", "Thursday", True),
    (" Thursdays", "Thursday", False),  # spaced script: a longer word is another word
    (" Friday", "Thursday", False),
    ("", "Thursday", False),
    ("   ", "Thursday", False),
    (" ΠΕΜΠΤΗ", "Πέμπτη", True),  # Greek capitals drop the tonos
    (" πέμπτη.", "Πέμπτη", True),
    (" miercoles", "miércoles", False),  # Spanish accents are spelling
    (" MIÉRCOLES", "miércoles", True),
    (" الخَمِيس", "الخميس", True),  # short-vowel marks
    (" الخـميس", "الخميس", True),  # tatweel
    (" ابريل", "أبريل", True),  # hamza on alef
    (" الجمعة", "الخميس", False),
    ("木曜日です", "木曜日", True),  # no spaces in Japanese
    ("４月", "4月", True),  # full-width digit
    ("星期四、星期五", "星期四", True),
    ("星期五", "星期四", False),
    (" четверг\u200b", "четверг", True),  # zero-width space
    (" Четверг", "четверг", True),
    (" «Donnerstag»", "Donnerstag", True),
    (" फ़रवरी", "फ\u093cरवरी", True),  # precomposed vs combining nukta
])
def test_scorer_normalisation(response: str, gold: str, expected: bool) -> None:
    assert utils.process_results({"answer": gold}, [response]) == {"acc": int(expected)}


@pytest.mark.slow
def test_lm_eval_run_on_tiny_model() -> None:
    """Both tasks load in lm-eval and yield one record per item with language sub-slices
    (three languages of three scripts, selected through the slice's metadata, to stay fast)."""
    from harness.evaluation import evaluate
    from harness.models import loading as models
    from harness.job.identity import eval_settings, tokenizer_dir
    from harness.config import to_config

    languages = {"en": "Latn", "ar": "Arab", "zh": "Hans"}
    cfg = to_config(compose(["model=tiny_random", "slices=[multilingual]", "slices.multilingual.n_items=1",
                             f"+slices.multilingual.metadata.languages=[{','.join(languages)}]"]))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    settings = eval_settings(cfg, tokenizer_dir(loaded))
    (slice_,) = resolve(cfg.slices)
    records, aggregates = evaluate.evaluate_slice(evaluate.make_lm(loaded.model, loaded.tokenizer, settings),
                                                  slice_, settings)
    n_languages = len(languages)
    assert len(records) == len(generate.KINDS) * n_languages
    assert set(records["task"]) == {"harness_ml_mc", "harness_ml_gen"}
    assert set(records["sub_slice"]) == {f"{lang}-{script}" for lang, script in languages.items()}
    assert records.groupby("cluster").size().eq(n_languages).all()
    assert set(records["correct"]) <= {0.0, 1.0}
    mc = records[records["task"] == "harness_ml_mc"]
    assert set(mc["response"]) <= {str(i) for i in range(generate.N_CHOICES)}
    assert set(aggregates) == {"harness_ml_mc", "harness_ml_gen"}
    texts = slice_.divergence_texts(**slice_.metadata(cfg.eval.seed))
    assert len(texts) == n_languages


@pytest.mark.slow
def test_some_language_discriminates_on_gemma() -> None:
    """Issue 5: at least one sub-slice where the reference model (Gemma 3 270M, base) scores
    between 20% and 80% (measured at quick: ar 33%, el 42%, ru/zh/ja 58%; see the README), and
    the English control beats the weakest language.

    Both are existence claims (the second: some language below English), so witnesses show them:
    English and two non-Latin scripts, each evaluated whole (36 of 132 items; the whole slice
    took ~80 s of a full suite run). Each is evaluated within the whole slice's documents (lm-eval
    ``samples``), so its items and prompts are the ones a job scores."""
    from harness.evaluation import evaluate
    from harness.models import loading as models
    from harness.job.identity import eval_settings, tokenizer_dir
    from harness.config import to_config

    cfg = to_config(compose(["model=gemma3_270m", "slices=[multilingual]"]))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    settings = eval_settings(cfg, tokenizer_dir(loaded))
    (slice_,) = resolve(cfg.slices)
    metadata = slice_.metadata(settings.seed, settings.tokenizer_path, settings.max_length)
    languages = ("en", "ar", "el")
    witness = {f"harness_ml_{group}": [index for index, item in enumerate(generate.items(**metadata, kinds=list(kinds)))
                                       if item["language"] in languages]
               for group, kinds in (("mc", generate.MC_KINDS), ("gen", generate.GEN_KINDS))}
    lm = evaluate.make_lm(loaded.model, loaded.tokenizer, settings)
    records, _ = evaluate.evaluate_slice(lm, slice_, settings, samples=witness)
    assert set(records["sub_slice"]) == {f"{lang}-{generate.LANGUAGES[lang]}" for lang in languages}
    in_languages = sum(item["language"] in languages for item in generate.items(**metadata))
    assert len(records) == sum(map(len, witness.values())) == in_languages == 3 * 132 // 11
    accuracy = records.groupby("sub_slice")["correct"].mean()
    assert accuracy.between(0.2, 0.8).any(), accuracy.to_dict()
    assert accuracy["en-Latn"] > accuracy.min()  # a language below the English control
