"""eval.max_gen_toks: a cap on every generation task's reply length, for smoke runs.

Each generation task keeps the lower of its own ``max_gen_toks`` (read here from the task files
themselves) and the cap; the requests lm-eval builds carry it; the plan counts it; a capped run
is its own result (reference entry, run key) while an uncapped one keeps the keys it had before
the option; a cap below one token is refused before any work.
"""
from __future__ import annotations

import re

import pytest

from harness.evaluation import evaluate
from harness.job import identity
from harness.evaluation.evaluate import check_settings
from harness.config import config_dict, to_config
from harness.models import loading as models
from harness.planning import plan
from harness.evaluation.slices import resolve

TINY = ["model=tiny_random", "slices=[math]", "slices.math.n_items=9", "slices.math.divergence_texts=2",
        "slices.math.tasks=[harness_math_gen,harness_math_mc]", "quant=none"]


def own_max_gen_toks(slice_) -> dict[str, int]:
    """{task: max_gen_toks} as written in the slice's task files (lm-eval's default 256 where unset)."""
    found = {}
    for path in slice_.directory.glob("*.yaml"):
        text = path.read_text()
        name = re.search(r"^task:\s*(\S+)", text, re.M)
        if name is None or not re.search(r"^output_type:\s*generate_until", text, re.M):
            continue
        value = re.search(r"^\s+max_gen_toks:\s*(\d+)", text, re.M)
        found[name[1]] = int(value[1]) if value else 256
    return found


@pytest.mark.slow
@pytest.mark.parametrize("cap", [None, 20, 1000])
def test_each_generation_task_keeps_the_lower_of_its_own_and_the_cap(make_cfg, cap):
    cfg = to_config(make_cfg("model=tiny_random", "slices=[code,structured,long_context]",
                                      *([f"eval.max_gen_toks={cap}"] if cap else [])))
    checked = 0
    for slice_ in resolve(cfg.slices):
        own = own_max_gen_toks(slice_)
        settings = identity.eval_settings(cfg, None)
        loaded = evaluate.task_manager(slice_, settings).load(list(slice_.config.tasks))["tasks"]
        for name, task in loaded.items():
            if name not in own:
                assert task.get_config("output_type") != "generate_until", name
                continue
            expected = own[name] if cap is None else min(own[name], cap)
            assert task.get_config("generation_kwargs")["max_gen_toks"] == expected, name
            checked += 1
    assert checked >= 5
    if cap == 20:  # the cap lowers some tasks (code: 256 and 96) and leaves the shorter ones (long context: 16)
        assert any(v > 20 for s in resolve(cfg.slices) for v in own_max_gen_toks(s).values())
        assert any(v < 20 for s in resolve(cfg.slices) for v in own_max_gen_toks(s).values())


@pytest.mark.slow
def test_a_capped_evaluation_sends_the_cap_with_each_request_and_replies_shorter(make_cfg):
    out = {}
    for cap in (None, 4):
        cfg = to_config(make_cfg(*TINY, *([f"eval.max_gen_toks={cap}"] if cap else [])))
        loaded = models.load(cfg.model, cfg.paths.cache_dir)
        slice_ = resolve(cfg.slices)[0]
        settings = identity.eval_settings(cfg, None)
        results = evaluate.run_lm_eval(evaluate.make_lm(loaded.model, loaded.tokenizer, settings), slice_, settings)
        samples = results["samples"]["harness_math_gen"]
        assert len(samples) == 9
        assert {s["arguments"][0][1]["max_gen_toks"] for s in samples} == {cap or 24}
        out[cap] = sum(len(s["resps"][0][0]) for s in samples)
    # tiny_random never stops early: its uncapped replies run to the task's 24 tokens
    assert out[4] < out[None] / 2


@pytest.mark.slow
def test_the_plan_counts_the_capped_tokens(make_cfg):
    counts = {}
    for cap in (None, 5):
        cfg = to_config(make_cfg(*TINY, *([f"eval.max_gen_toks={cap}"] if cap else [])))
        tokenizer = models.load(cfg.model, cfg.paths.cache_dir).tokenizer
        counts[cap] = plan.count_slice_tokens(resolve(cfg.slices)[0], identity.ReferenceSpec.of(cfg), tokenizer)
    assert counts[None].generated == 9 * 24 and counts[5].generated == 9 * 5
    assert counts[None].scored == counts[5].scored


def test_a_capped_run_has_its_own_keys_and_an_uncapped_one_keeps_its_old_ones(make_cfg):
    from harness.infra.cache import stable_hash

    base = to_config(make_cfg("model=tiny_random"))
    capped = to_config(make_cfg("model=tiny_random", "eval.max_gen_toks=16"))
    config = config_dict(base)
    for key in ("sequential", "sequential_round_items", "sequential_method", "max_gen_toks", "thinking_budget"):
        config["eval"].pop(key)
    for key in identity.THINKING_MODEL_FIELDS:  # a model that does not think: keyed as before thinking existed
        config["model"].pop(key)
    for served_only in ("endpoint_divergence_topk", "endpoint_concurrency"):  # keyed only for served candidates
        config["candidate"].pop(served_only)
    config["candidate"].pop("endpoint_max_requests_per_s")  # a rate limit is in no key
    for section in ("reference", "judge"):  # keyed only when a served reference or a judge is set
        config.pop(section)
    for transient in identity.TRANSIENT_SECTIONS:
        config.pop(transient, None)
    config["quant"] = identity.keyed_quant(base.quant, config["quant"])  # the settings' layout from before
    config["slices"] = {name: {k: v for k, v in slice_config.items()  # unset design fields leave keys as they were
                               if not (k in identity.DESIGN_FIELDS and v is None)}
                        for name, slice_config in config["slices"].items()}
    assert identity.run_key(base) == stable_hash({"config": config, "model": None}, 16)  # as before the option
    assert identity.run_key(capped) != identity.run_key(base)
    loaded = models.LoadedModel(model=None, tokenizer=None, identity={"name": "stand-in"})
    slice_ = resolve(base.slices)[0]
    assert identity.reference_key(loaded, slice_, identity.ReferenceSpec.of(capped)) != \
        identity.reference_key(loaded, slice_, identity.ReferenceSpec.of(base))


@pytest.mark.parametrize("cap", [0, -3])
def test_a_cap_below_one_token_is_refused_before_work(make_cfg, cap):
    from harness.cli import UsageError

    with pytest.raises(UsageError, match=rf"eval.max_gen_toks={cap}: give a number of tokens >= 1"):
        check_settings(to_config(make_cfg(*TINY, f"eval.max_gen_toks={cap}")))
