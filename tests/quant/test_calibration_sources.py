"""Calibration sources: deterministic windows per domain, their content, the cache key, bad input.

Literal values below were computed on main before sources existed (commit 0b51037): the default
must keep its calibration windows and calibrated-weight cache keys.
"""
from __future__ import annotations

import ast
import re
import sys
import unicodedata
from dataclasses import replace

import pytest

from harness.quant import calibration_sources
from harness.infra.cache import Cache, stable_hash
from harness.config import CalibrationConfig, compose, load_model_config
from harness.quant import SchemeError, validate_scheme
from harness.quant.calibrated_cache import calibrated_key
from harness.quant.calibration import available_sources, calibration_tokens, validate_calibration
from tests.conftest import USER_CACHE

OFFLINE = ("prose", "code", "multilingual", "math")
# On main before sources existed: calibrated_key("m", <preset>, "h") and the default windows' token hash.
MAIN_KEYS = {"gptq_w4g128": "814ff5ecf0ff7c13558b6381", "awq_w4g128": "e0c852b270393a14375acbfa"}
# AWQ's defaults changed since (search_samples 8 -> 4, coarse-to-fine grid): its keys from before
# are those of the old settings, which must still find their cache entries.
BEFORE = {"awq_w4g128": ("quant.settings.search_samples=8", "quant.settings.coarse_to_fine=false")}
MAIN_DEFAULT_WINDOWS = {"python": (3, 11), "num_samples": 4, "seq_len": 64, "hash": "5bdde8c9eb014472"}


@pytest.fixture(scope="module")
def tokenizer():
    from harness.models.loading import load_tokenizer
    return load_tokenizer(load_model_config("smollm2_135m"), Cache(USER_CACHE))


def scheme(preset: str, *overrides: str):
    from omegaconf import OmegaConf
    return OmegaConf.to_object(compose(["model=tiny_random", f"quant={preset}", *overrides])).quant


@pytest.mark.slow
@pytest.mark.parametrize("source", OFFLINE)
def test_each_source_yields_deterministic_windows_of_the_right_shape(tokenizer, source):
    config = CalibrationConfig(source=source, num_samples=6, seq_len=96, seed=3)
    first, again = calibration_tokens(tokenizer, config), calibration_tokens(tokenizer, config)
    assert first.shape == (6, 96) and not first.is_floating_point()
    assert (first == again).all()
    other_seed = calibration_tokens(tokenizer, replace(config, seed=4))
    assert not (other_seed == first).all()  # the seed picks the windows
    # Windows read as their domain: code has Python keywords, multilingual non-Latin scripts, math equations.
    windows = [tokenizer.decode(row) for row in first]
    marker = {"prose": lambda w: re.search(r"\b(the|is|a)\b", w),
              "code": lambda w: re.search(r"\b(def|return|self|if|import|for)\b", w),
              "multilingual": lambda w: any(ord(c) > 0x24F for c in w),
              "math": lambda w: re.search(r"\d+ [+×÷-] \d+ = \d+", w)}[source]
    assert sum(bool(marker(w)) for w in windows) >= 5, windows


@pytest.mark.slow
def test_sources_give_different_windows(tokenizer):
    sets = {s: calibration_tokens(tokenizer, CalibrationConfig(source=s, num_samples=4, seq_len=64)) for s in OFFLINE}
    assert len({stable_hash(t.tolist()) for t in sets.values()}) == len(OFFLINE)


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info[:2] != MAIN_DEFAULT_WINDOWS["python"],
                    reason="the prose source is the installed standard library's docstrings")
def test_default_windows_are_unchanged_from_before_sources(tokenizer):
    for source in ("offline", "prose"):  # the default's value, and its name
        config = CalibrationConfig(source=source, num_samples=MAIN_DEFAULT_WINDOWS["num_samples"],
                                   seq_len=MAIN_DEFAULT_WINDOWS["seq_len"])
        assert stable_hash(calibration_tokens(tokenizer, config).tolist(), 16) == MAIN_DEFAULT_WINDOWS["hash"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(MAIN_KEYS))
def test_default_cache_key_is_unchanged_and_every_source_has_its_own(preset):
    assert CalibrationConfig().source == "offline"
    before = BEFORE.get(preset, ())
    assert calibrated_key("m", scheme(preset, *before), "h") == MAIN_KEYS[preset]
    default = calibrated_key("m", scheme(preset), "h")
    assert (default == MAIN_KEYS[preset]) == (not before)  # new AWQ defaults: new entries
    assert calibrated_key("m", scheme(preset, "quant.calibration.source=prose"), "h") == default
    # Same token hash on purpose: the source itself separates the entries.
    keys = {s: calibrated_key("m", scheme(preset, f"quant.calibration.source={s}"), "h") for s in OFFLINE}
    keys["dataset"] = calibrated_key("m", scheme(preset, "quant.calibration.source=dataset",
                                                 "quant.calibration.dataset=wikitext"), "h")
    assert keys["prose"] == default and len(set(keys.values())) == len(keys)


def test_the_text_digest_is_part_of_a_non_default_key(monkeypatch):
    code = scheme("gptq_w4g128", "quant.calibration.source=code")
    before = calibrated_key("m", code, "h")
    monkeypatch.setattr(calibration_sources, "source_digest", lambda name: "0" * 16)  # e.g. a Python upgrade
    assert calibrated_key("m", code, "h") != before
    assert calibrated_key("m", scheme("gptq_w4g128"), "h") == MAIN_KEYS["gptq_w4g128"]  # the default has none


@pytest.mark.slow
def test_unknown_source_and_missing_dataset_are_refused_at_config_time():
    with pytest.raises(SchemeError) as error:
        validate_scheme(scheme("gptq_w4g128", "quant.calibration.source=wiki"))
    message = str(error.value)
    assert "'wiki'" in message and all(name in message for name in available_sources())
    with pytest.raises(SchemeError, match="quant.calibration.dataset"):
        validate_scheme(scheme("awq_w4g128", "quant.calibration.source=dataset"))
    with pytest.raises(SchemeError, match="num_samples=0"):
        validate_calibration(CalibrationConfig(num_samples=0))
    validate_scheme(scheme("kv8", "quant.calibration.source=math"))  # static scales take a source too


def test_math_source_equations_are_true():
    """Every "a op b = c" and every solved equation in the text, recomputed independently."""
    text = calibration_sources.source_text("math")
    checked = 0
    for expression, result in re.findall(r"((?:\d+ [+×÷-] )+\d+) = (\d+)", text):
        value = eval(expression.replace("×", "*").replace("÷", "/"))  # noqa: S307 - digits and + - * / only
        assert value == int(result), (expression, result)
        checked += 1
    for a, b, c, x in re.findall(r"Solve for x: (\d+)x \+ (\d+) = (\d+)\.\n(?:.*\n)*?Answer: x = (\d+)\.", text):
        assert int(a) * int(x) + int(b) == int(c)
        checked += 1
    for price, percent, sale in re.findall(r"costs (\d+) euros\. It is on sale for (\d+)% off.*?\n(?:.*\n)*?Answer: (\d+) euros", text):
        assert int(price) * (100 - int(percent)) == int(sale) * 100
    assert checked > 10_000
    assert "apples" not in text and "coins" not in text  # the math slice's word-problem templates


@pytest.mark.slow
def test_code_source_is_parseable_python_without_humaneval():
    from harness.quant.calibration_sources.code import MODULES, module_sources
    from slices.code.generate import humaneval_problems

    sources = module_sources()
    assert len(sources) == len(MODULES)
    for name, source in sources:
        tree = ast.parse(source)  # docstring removal leaves valid code
        assert ast.get_docstring(tree) is None or len(tree.body) == 1, name
    text = calibration_sources.source_text("code")
    solutions = [p["canonical_solution"].strip() for p in humaneval_problems()]
    assert not [s for s in solutions if len(s) > 40 and s in text]  # no evaluation item is calibration data


def _script(char: str) -> str:
    return unicodedata.name(char, "?").split()[0]


@pytest.mark.slow
def test_multilingual_source_covers_scripts_but_not_the_slice_vocabulary():
    from babel import Locale

    from slices.multilingual.generate import LANGUAGES

    text = calibration_sources.source_text("multilingual")
    scripts = {_script(c) for c in set(text) if c.isalpha()}
    assert {"LATIN", "CYRILLIC", "GREEK", "ARABIC", "DEVANAGARI", "CJK", "HIRAGANA", "HANGUL", "HEBREW",
            "THAI", "BENGALI", "TAMIL"} <= scripts
    found = []
    for language in LANGUAGES:  # the weekday and month names the multilingual slice asks about
        locale = Locale.parse(language)
        names = [*locale.days["format"]["wide"].values(), *locale.months["format"]["wide"].values()]
        found += [n for n in names if re.search(rf"(?<!\w){re.escape(n)}(?!\w)", text)]
    assert not found


SWEEP = ["quant=gptq_w4g128,awq_w4g128", "quant.calibration.source=prose,code", "slices=[code,math,multilingual]"]


@pytest.mark.slow
def test_the_documented_calibration_domain_sweep_plans(tmp_path, cache_dir):
    """`python -m harness -m <SWEEP>` (the README's command) expands to four valid jobs."""
    from harness.planning import plan as plan_mod

    overrides = ["model=tiny_random", f"paths.results_dir={tmp_path / 'results'}", f"paths.cache_dir={cache_dir}",
                 "tracking.enabled=false", *SWEEP]
    plan = plan_mod.plan_sweep(overrides, tokens_per_s=1000.0, decode_tokens_per_s=100.0)
    jobs = [(job.scheme, next(o for o in job.overrides if "calibration.source" in o)) for job in plan.jobs]
    # each job is named after its calibration domain: runs that differ in a field never share a name
    assert sorted(jobs) == sorted((f"{q}+calibration.source={s}", f"quant.calibration.source={s}")
                                  for q in ("gptq_w4g128", "awq_w4g128") for s in ("prose", "code"))
    assert all(job.calibration == 128 * 512 for job in plan.jobs)
    assert {s.slice for job in plan.jobs for s in job.slices} == {"code", "math", "multilingual"}
    keys = {calibrated_key("m", plan_mod._job_config(job.overrides).quant, "h") for job in plan.jobs}
    assert len(keys) == 4


def test_bench_head_to_head_counts_and_kl_difference_on_a_hand_made_pair():
    import importlib.util
    from pathlib import Path

    import pandas as pd

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_calibration_domain.py"
    spec = importlib.util.spec_from_file_location("bench_calibration_domain", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    ids = [f"i{k}" for k in range(6)]
    base = pd.DataFrame({"item_id": ids, "cluster": ids, "slice": "code", "correct_quant": [1, 1, 0, 0, 1, 0]})
    other = base.assign(correct_quant=[1, 0, 1, 1, 1, 0])  # one item lost, two gained
    pair = bench.head_to_head(base, other, "code", n_resamples=200)
    assert (pair["n"], pair["other_only_right"], pair["base_only_right"]) == (6, 2, 1)
    assert pair["acc_diff"] == pytest.approx(1 / 6)
    # Text 0: 3 tokens, KL 1 -> 0.5; text 1: 1 token, KL 2 -> 2. Token-weighted mean diff = -1.5 / 4.
    tokens = pd.DataFrame({"slice": "code", "text": [0, 0, 0, 1], "position": [1, 2, 3, 1], "kl": [1.0, 1, 1, 2]})
    kl = bench.kl_difference(tokens, tokens.assign(kl=[0.5, 0.5, 0.5, 2]), "code", n_resamples=500)
    assert kl["kl_diff"] == pytest.approx(-0.375) and kl["kl_tokens"] == 4
    assert kl["kl_ci_low"] == pytest.approx(-0.5) and kl["kl_ci_high"] == pytest.approx(0.0)  # all-one-text resamples
