"""The whole pipeline on the tiny random model: config → quantize → evaluate → compare → MLflow."""
from __future__ import annotations

import copy
import json

import mlflow
import pandas as pd
import pytest
import torch

from harness.config import to_config
from harness.job import pipeline as run_mod
from tests.conftest import TINY_MATH


@pytest.mark.slow
def test_null_scheme_gives_zero_flips_and_zero_kl(make_cfg, tmp_path):
    result = run_mod.run(make_cfg(*TINY_MATH, "quant=none"))
    metrics = result["metrics"]
    assert metrics["overall/flips_right_to_wrong"] == 0
    assert metrics["overall/flips_wrong_to_right"] == 0
    assert metrics["math/kl_mean"] == 0.0
    assert metrics["math/kl_max"] == 0.0
    assert metrics["math/top1_agree"] == 1.0
    assert metrics["math/ppl_ratio"] == pytest.approx(1.0, abs=0)
    items = pd.read_parquet(next((tmp_path / "results").glob("*")) / "items.parquet")
    assert (items["response_ref"] == items["response_quant"]).all()


def test_int4_run_writes_results_and_logs_mlflow(make_cfg, tmp_path):
    cfg = make_cfg(*TINY_MATH, "quant=int4_g128")
    result = run_mod.run(cfg)
    directory = next((tmp_path / "results").glob("*"))
    for name in ("items.parquet", "summary.json", "config.yaml", "config.json", "tokens.parquet",
                 "item_stats.parquet", "token_stats.parquet", "quant_layers.parquet", "report.md"):
        assert (directory / name).exists(), name
    items = pd.read_parquet(directory / "items.parquet")
    assert len(items) == 36 and items["item_id"].is_unique
    assert set(items.columns) >= {"correct_ref", "correct_quant", "response_ref", "response_quant", "sub_slice"}
    assert result["metrics"]["math/kl_mean"] > 0
    clusters = items.groupby("slice")["cluster"].nunique()
    assert result["metrics"]["math/n_clusters"] == clusters["math"]  # beside n, in MLflow too
    assert result["quant"]["bits_per_weight"] == pytest.approx(4.125)
    # lm-eval's own aggregate equals the harness's per-item mean, per task and model.
    for task, value in result["lm_eval_aggregates"]["quantized"].items():
        assert items.loc[items["task"] == task, "correct_quant"].mean() == pytest.approx(value)
    for task, value in result["lm_eval_aggregates"]["reference"].items():
        assert items.loc[items["task"] == task, "correct_ref"].mean() == pytest.approx(value)
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("quant-harness").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.data.tags["scheme"] == "int4_g128" and run.data.tags["model"] == "tiny_random"
    assert run.data.metrics["kl_mean/math"] == pytest.approx(result["metrics"]["math/kl_mean"], abs=5e-5)  # rounded
    assert run.data.params["quant.weights.group_size"] == "128"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"items.parquet", "summary.json", "config.yaml"} <= artifacts


@pytest.mark.slow
def test_run_leaves_the_callers_config_as_given_and_writes_summary_once(make_cfg, tmp_path, monkeypatch):
    cfg = to_config(make_cfg(*TINY_MATH, "quant=int4_g128", "tracking.tags.sweep_id=night-1",
                                      "tracking.enabled=false", "runtime.threads=1"))
    given = copy.deepcopy(cfg)
    assert given.quant.weights.ragged_groups is None  # the job fills it from the model's default
    writes: list[str] = []
    original = run_mod.atomic_write_json
    monkeypatch.setattr(run_mod, "atomic_write_json", lambda path, data: (writes.append(path.name), original(path, data)))
    result = run_mod.run(cfg)
    assert cfg == given
    assert result["tags"] == {"harness.sweep_id": "night-1"}
    assert writes.count("summary.json") == 1 and writes[-1] == "summary.json"
    on_disk = json.loads((next((tmp_path / "results").glob("*")) / "summary.json").read_text())
    assert on_disk["metrics"] == result["metrics"] and "write" in on_disk["timings"]
    assert on_disk["runtime"] == {"threads": 1, "threads_from": "runtime.threads", "reference_process": []} and torch.get_num_threads() == 1


@pytest.mark.slow
def test_records_are_on_disk_before_statistics_fail(make_cfg, tmp_path, monkeypatch):
    from harness import stats

    def broken(*args, **kwargs):
        raise ZeroDivisionError("cluster-robust SE is 0")

    monkeypatch.setattr(stats, "compare_frame", broken)
    with pytest.raises(ZeroDivisionError):
        run_mod.run(make_cfg(*TINY_MATH, "quant=int8", "tracking.enabled=false"))
    directory = next((tmp_path / "results").glob("*"))
    items = pd.read_parquet(directory / "items.parquet")
    assert len(items) == 36 and items["item_id"].is_unique  # both tasks' items, both models' answers
    assert {"correct_ref", "correct_quant", "response_ref", "response_quant"} <= set(items.columns)
    tokens = pd.read_parquet(directory / "tokens.parquet")
    assert len(tokens) > 0 and (tokens["kl"] >= 0).all()
    assert (directory / "config.json").exists() and (directory / "quant_layers.parquet").exists()
    assert not (directory / "summary.json").exists()  # not finished: a rerun computes the statistics
    assert (directory / "checkpoint").exists()  # ... from the kept lm-eval checkpoint, without re-evaluating


@pytest.mark.slow
def test_second_scheme_reuses_the_reference(make_cfg, tmp_path, caplog):
    first = run_mod.run(make_cfg(*TINY_MATH, "quant=int8"))
    second = run_mod.run(make_cfg(*TINY_MATH, "quant=int4"))
    assert first["reference_cached"] == {"math": False}
    assert second["reference_cached"] == {"math": True}
    assert second["timings"]["reference"] < first["timings"]["reference"]


@pytest.mark.slow
def test_finished_config_is_reused_not_recomputed(make_cfg, tmp_path):
    cfg = make_cfg(*TINY_MATH, "quant=int8")
    first = run_mod.run(cfg)
    again = run_mod.run(make_cfg(*TINY_MATH, "quant=int8"))
    assert again["run_key"] == first["run_key"]
    assert again["finished_at"] == first["finished_at"]
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("quant-harness").experiment_id])
    assert len(runs) == 1  # logging is idempotent


@pytest.mark.slow
def test_batch_composition_does_not_change_answers(make_cfg, tmp_path):
    one = run_mod.run(make_cfg(*TINY_MATH, "quant=none", "eval.batch_size=1", "tracking.enabled=false"))
    eight = run_mod.run(make_cfg(*TINY_MATH, "quant=none", "eval.batch_size=7", "tracking.enabled=false",
                                 f"paths.results_dir={tmp_path / 'other'}"))
    a = pd.read_parquet(next((tmp_path / "results").glob("*")) / "items.parquet").set_index("item_id")
    b = pd.read_parquet(next((tmp_path / "other").glob("*")) / "items.parquet").set_index("item_id")
    assert (a.loc[b.index, "response_quant"] == b["response_quant"]).all()
    assert (a.loc[b.index, "correct_quant"] == b["correct_quant"]).all()


@pytest.mark.slow
def test_real_model_tier_smollm2_handful_of_items(make_cfg, tmp_path):
    """SmolLM2-135M end to end on a handful of math items: real weights, real lm-eval, real MLflow."""
    result = run_mod.run(make_cfg("slices=[math]", "slices.math.n_items=9", "slices.math.divergence_texts=4",
                                  "quant=int4_g128"))
    m = result["metrics"]
    assert m["overall/n"] == 9  # the written-answer task only (multiple choice is opt-in)
    assert 0 < m["math/kl_mean"] < 5 and 0 < m["math/top1_agree"] < 1
    assert m["math/ppl_ref"] > 1 and m["math/ppl_quant"] > 1
    # SmolLM2's 576-wide layers take a ragged last group: 4 groups of 128 + 1 of 64.
    assert result["quant"]["bits_per_weight"] > 4.125
