"""The bf16 tier: the whole pipeline in bfloat16 on the CPU, against the same pipeline in float32.

A GPU run is bf16; the rest of the suite runs float32. Here every method family runs end to end
in bf16 on ``tiny_random`` (RTN int4, FP8 W8A8, NVFP4, GPTQ, AWQ, SmoothQuant, an FP8 KV cache),
with the default ``hidden`` reference store (whose output-head self-check is what broke bf16),
and is held to three things:

- every divergence number is finite;
- the null scheme is exactly null (KL 0, no flips, identical responses): both passes compute in
  the same dtype on the same device, so bf16 rounding cannot leak into the comparison;
- each scheme's mean KL agrees with the float32 run within the stated bound
  ``|KL_bf16 - KL_fp32| <= 0.25 * KL_fp32 + 4 * KL(fp32 reference || bf16 reference)``:
  bf16 is a second, independent perturbation of the weights and activations (relative step
  2^-8, versus 2^-4 for FP8 and ~2^-3 for int4), so the scheme's damage dominates and what is
  left is of the order of bf16's own divergence from fp32 (the second term, measured here on
  the same texts) plus a quarter for the discrete choices of calibrated methods (AWQ's grid,
  GPTQ's rounding order) that flip under bf16 rounding.

The SmolLM2 variant (a few items, bf16 is ~5x slower than fp32 on this CPU) is marked slow.
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from harness.divergence import scoring as divergence
from harness.job import identity
from harness.job import divergence_texts
from harness.config import to_config
from harness.models import loading as models
from harness.job import pipeline as run_mod
from harness.config import compose
from harness.evaluation.slices import resolve

SCHEMES = ["int4_g128", "fp8", "nvfp4", "gptq_w4g128", "awq_w4g128", "int8_w8a8_sq", "kv8"]
TINY = ["model=tiny_random", "slices=[math]", "slices.math.n_items=18", "slices.math.divergence_texts=4",
        "eval.max_gen_toks=8"]  # tiny_random never stops: its replies run to the cap
RELATIVE = 0.25
FLOOR_FACTOR = 4.0

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(root: Path, dtype: str, scheme: str, extra: list[str], results: str | None = None):
    return compose([*extra, f"quant={scheme}", f"model.dtype={dtype}", "tracking.enabled=false",
                    "compare.n_resamples=1000", f"paths.results_dir={root / 'results' / (results or dtype)}",
                    f"paths.cache_dir={root / 'cache'}"])


def _cache_root(tmp_path_factory, shared_model_cache: Path) -> Path:
    root = tmp_path_factory.mktemp("bf16")
    (root / "cache").mkdir()
    (root / "cache" / "models").symlink_to(shared_model_cache)
    return root


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, shared_model_cache):
    """{(dtype, scheme): summary} for the null scheme and every scheme of SCHEMES, in both dtypes."""
    root = _cache_root(tmp_path_factory, shared_model_cache)
    out = {}
    for dtype in ("float32", "bfloat16"):
        for scheme in ["none", *SCHEMES]:
            out[dtype, scheme] = run_mod.run(_cfg(root, dtype, scheme, TINY))
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def bf16_floor(tiny_runs) -> float:
    """Mean KL(fp32 tiny_random || bf16 tiny_random) on the math slice's divergence texts."""
    cache_dir = tiny_runs["root"] / "cache"
    cfg = to_config(compose([*TINY, "quant=none", f"paths.cache_dir={cache_dir}"]))
    fp32 = models.load(cfg.model, cache_dir)
    cfg.model.dtype = "bfloat16"
    bf16 = models.load(cfg.model, cache_dir)
    slice_ = resolve(cfg.slices)[0]
    texts = divergence_texts.divergence_texts(slice_, identity.eval_settings(cfg, identity.tokenizer_dir(fp32)))
    reference = divergence.score_reference(fp32.model, fp32.tokenizer, texts, max_tokens=1024, store="logprobs")
    return float(divergence.compare_to_reference(bf16.model, reference, "math")["kl"].mean())


@pytest.mark.slow
def test_bf16_null_scheme_is_exactly_null(tiny_runs):
    metrics = tiny_runs["bfloat16", "none"]["metrics"]
    assert metrics["math/kl_mean"] == 0.0 and metrics["math/kl_max"] == 0.0
    assert metrics["math/top1_agree"] == 1.0
    assert metrics["overall/flips_right_to_wrong"] == 0 and metrics["overall/flips_wrong_to_right"] == 0
    directory = next((tiny_runs["root"] / "results" / "bfloat16").glob("*__none__*"))
    items = pd.read_parquet(directory / "items.parquet")
    assert (items["response_ref"] == items["response_quant"]).all()
    tokens = pd.read_parquet(directory / "tokens.parquet")
    assert (tokens["nll_ref"] == tokens["nll_quant"]).all()


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_bf16_scheme_is_finite_and_agrees_with_fp32(tiny_runs, bf16_floor, scheme):
    bf16, fp32 = tiny_runs["bfloat16", scheme], tiny_runs["float32", scheme]
    kl_bf16, kl_fp32 = bf16["metrics"]["math/kl_mean"], fp32["metrics"]["math/kl_mean"]
    directory = next((tiny_runs["root"] / "results" / "bfloat16").glob(f"*__{scheme}__*"))
    tokens = pd.read_parquet(directory / "tokens.parquet")
    for column in ("kl", "kl_reverse", "nll_ref", "nll_quant", "p_ref", "p_quant"):
        assert tokens[column].map(math.isfinite).all(), column
    assert kl_bf16 > 0 and kl_fp32 > 0  # the scheme changed something in both dtypes
    bound = RELATIVE * kl_fp32 + FLOOR_FACTOR * bf16_floor
    assert abs(kl_bf16 - kl_fp32) <= bound, (scheme, kl_bf16, kl_fp32, bf16_floor)
    assert bf16["quant"]["bits_per_weight"] == fp32["quant"]["bits_per_weight"]


@pytest.mark.slow
def test_bf16_floor_is_small_next_to_4bit_damage(tiny_runs, bf16_floor):
    """bf16 does change the model (the floor is not zero), by far less than any 4-bit scheme does."""
    four_bit = min(tiny_runs["float32", s]["metrics"]["math/kl_mean"]
                   for s in ("int4_g128", "nvfp4", "gptq_w4g128", "awq_w4g128"))
    assert 0 < bf16_floor < 0.1 * four_bit


@pytest.mark.slow
def test_bf16_every_reference_store(tiny_runs):
    """logprobs (exact, full distributions) gives the hidden store's KL; topk a finite lower bound."""
    root = tiny_runs["root"]
    hidden = tiny_runs["bfloat16", "int4_g128"]["metrics"]["math/kl_mean"]
    out = {}
    for store in ("logprobs", "topk"):
        cfg = _cfg(root, "bfloat16", "int4_g128", [*TINY, f"eval.reference_store={store}"], results=store)
        out[store] = run_mod.run(cfg)["metrics"]["math/kl_mean"]
    assert out["logprobs"] == pytest.approx(hidden, rel=1e-6, abs=0)
    assert math.isfinite(out["topk"]) and 0 < out["topk"] <= hidden * (1 + 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["hidden", "logprobs"])
def test_smollm2_bf16_few_items(make_cfg, store):
    """SmolLM2 in bf16, a handful of items, RTN int4: completes with each exact store, KL finite."""
    result = run_mod.run(make_cfg("model=smollm2_135m", "model.dtype=bfloat16", "quant=int4_g128", "slices=[math]",
                                  "slices.math.n_items=6", "slices.math.divergence_texts=2",
                                  f"eval.reference_store={store}", "tracking.enabled=false",
                                  "eval.max_gen_toks=8"))  # the stores differ in the divergence texts, not replies
    kl = result["metrics"]["math/kl_mean"]
    assert math.isfinite(kl) and kl > 0
