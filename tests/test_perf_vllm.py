"""The engine tier: serving speed (harness.engines.perf) measured on a REAL vLLM (CPU build, .venv-engine).

SmolLM2's FP8 W8A8 export and the reference's own weights, each served by vLLM in turn, on two prompts at 1 and 2
requests in flight, 8 tokens each: every request streams exactly 8 tokens (ignore_eos), the engine's own /metrics
count the same tokens the client received, its log gives the KV-cache capacity, and the speed-up's interval holds
its estimate. Slow (two server starts); skipped without .venv-engine unless HARNESS_REQUIRE_SYSTEM_TESTS=1.
"""
from __future__ import annotations

import os

import pytest

from harness.config import PerfConfig, compose, to_config
from harness.engines import perf
from harness.models.loading import serving_directory
from tests.test_endpoint_vllm import ENGINE_ENV, ENGINE_PYTHON, _engine, fp8_export  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow


def test_fp8_export_against_the_reference_on_vllm(fp8_export, tmp_path, shared_model_cache, monkeypatch):  # noqa: F811
    _engine()
    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "cache").mkdir()
    os.symlink(shared_model_cache, tmp_path / "cache" / "models")
    cfg = to_config(compose(["model=smollm2_135m", f"paths.cache_dir={tmp_path / 'cache'}"]))
    command = (f"{ENGINE_PYTHON} -m vllm.entrypoints.openai.api_server --model {{model}} --host 127.0.0.1 "
               "--port {port} --dtype float32 --max-model-len 1024 --enforce-eager")
    settings = PerfConfig(concurrency=[1, 2], n_prompts=2, rounds=1, max_tokens=8, n_resamples=200)
    prompts = ["<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"]
    result = perf.measure_pair(command, fp8_export, serving_directory(cfg.model, cfg.paths.cache_dir), prompts,
                               settings, tmp_path)
    for level in result["levels"]:
        for side in ("candidate", "reference"):
            summary, engine = level[side], level[f"{side}_engine"]
            assert summary["errors"] == 0 and summary["output_tokens"] == 2 * 8
            assert 0 < summary["ttft_p50"] <= summary["e2e_p50"]
            assert engine["generation_tokens"] == 16  # vLLM counted what the client received
            assert engine["ttft_s_mean"] > 0
        assert level["speedup_ci_low"] <= level["speedup"] <= level["speedup_ci_high"]
    assert result["log"]["reference"].get("kv_cache_tokens", 0) > 0
    assert set(perf.flat_metrics(result)) >= {"perf/c1/speedup", "perf/c2/candidate/output_tok_s"}
