"""Per-stage memory and token accounting (harness.job.stage_meter) and its place in summary.json / MLflow."""
from __future__ import annotations

import json

import mlflow
import pandas as pd
import pytest
import torch

from harness.models import loading as models
from harness.job import stage_meter
from harness.job import pipeline as run_mod
from harness.config import to_config
from tests.conftest import TINY_MATH


def _vm_hwm_gb() -> float:
    """Peak RSS from /proc (independent of getrusage)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024 ** 2
    pytest.skip("no /proc/self/status")


@pytest.mark.slow
def test_meter_counts_prefill_and_decode_tokens_of_a_real_model(make_cfg):
    cfg = to_config(make_cfg("model=tiny_random"))
    model = models.load(cfg.model, cfg.paths.cache_dir).model
    meter = stage_meter.StageMeter()
    meter.watch(model)
    ids = torch.randint(0, 100, (2, 5))
    meter.begin("a")
    with torch.inference_mode():
        model(ids)
    meter.end("a", 1.0)
    meter.begin("b")
    with torch.inference_mode():
        model.generate(ids[:, :4], attention_mask=torch.ones(2, 4, dtype=torch.long), max_new_tokens=3,
                       min_new_tokens=3, do_sample=False, pad_token_id=0)
    meter.end("b", 2.0)
    meter.begin("c")
    with torch.inference_mode():
        out = model(ids[:, :4], use_cache=True)
        model(ids[:, 2:], past_key_values=out.past_key_values, use_cache=True)  # 3 tokens per row after the cache
    meter.end("c", 1.0)
    with torch.inference_mode():
        model(ids)  # outside any stage: not counted
    meter.unwatch()
    assert (meter.stages["a"].prefill_tokens, meter.stages["a"].generated_tokens) == (10, 0)
    # generate: one prefill of 2 x 4 prompt tokens (it yields the first new token), then 2 decode steps x 2 rows
    assert (meter.stages["b"].prefill_tokens, meter.stages["b"].generated_tokens) == (8, 4)
    assert meter.throughput()["b"]["tokens_per_s"] == pytest.approx(12 / 2.0)
    # a teacher-forced pass (several tokens per row after a KV cache) is computed as a prefill is: counted there
    c = meter.stages["c"]
    assert (c.prefill_tokens, c.generated_tokens, c.teacher_forced_tokens, meter.stages["b"].teacher_forced_tokens) \
        == (14, 0, 6, 0)
    assert "cuda_peak_gb" not in meter.resources() or torch.cuda.is_available()


@pytest.mark.slow
def test_run_records_memory_and_throughput_in_summary_and_mlflow(make_cfg, tmp_path):
    result = run_mod.run(make_cfg(*TINY_MATH, "quant=int4_g128"))
    directory = next((tmp_path / "results").glob("*"))
    written = json.loads((directory / "summary.json").read_text())
    rss = written["resources"]["host_rss_peak_gb"]
    assert 0.05 < rss <= _vm_hwm_gb() * 1.01 + 1e-3
    through = written["throughput"]
    # math: 9 generation + 36 log-likelihood requests through the quantized model
    assert through["evaluate"]["generated_tokens"] > 0 and through["evaluate"]["prefill_tokens"] > 0
    # the reference stage ran the same lm-eval requests on the same items, plus the texts it could not take
    # from those forwards (its replies teacher-forced, texts cut to the divergence limit)
    assert through["reference"]["prefill_tokens"] > through["evaluate"]["prefill_tokens"]
    # one prefill per prompt: the divergence stage scores every token row but runs forward only the reference's
    # replies (teacher-forced after the prompt's captured states) and what answering the items left uncaptured
    rows = len(pd.read_parquet(directory / "tokens.parquet"))
    assert 0 < through["divergence"]["prefill_tokens"] < rows
    assert through["divergence"]["generated_tokens"] == 0
    assert result["throughput"] == through
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run, = client.search_runs([client.get_experiment_by_name("quant-harness").experiment_id])
    assert run.data.metrics["detail/throughput/evaluate/tokens_per_s"] == pytest.approx(through["evaluate"]["tokens_per_s"])
    assert run.data.metrics["detail/resources/host_rss_peak_gb"] == pytest.approx(rss)
