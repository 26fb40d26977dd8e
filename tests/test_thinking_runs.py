"""Thinking runs end to end on the tiny model whose chat template opens a trace: budget and max_gen_toks sweeps
(``python -m harness -m ...``, in this process so the template holds), each value its own run key and reference
entry; the KL split, the trace metrics and the gate's thinking lines in summary.json, report.md, gate.json and
the MLflow store (read back with MlflowClient); a non-thinking run keeps its keys.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

from test_thinking import TEMPLATE


def _sweep(monkeypatch, tmp_path: Path, cache: Path, *overrides: str) -> list[tuple[Path, dict, dict]]:
    """``python -m harness -m <overrides>`` through Hydra's launcher in this process: each run's (directory,
    summary, resolved config)."""
    from harness import __main__ as entry
    from harness.models import loading

    original = loading.load

    def load(cfg, cache_dir):
        loaded = original(cfg, cache_dir)
        loaded.tokenizer.chat_template = TEMPLATE  # opens <think> after the generation prompt
        loaded.identity = {**loaded.identity, "chat_template": "test-thinking"}
        return loaded

    monkeypatch.setattr(loading, "load", load)
    results = tmp_path / "results"
    monkeypatch.setattr(sys, "argv", ["harness", "-m", "model=tiny_random", "model.chat_template=true", "slices=[math]",
                                      "slices.math.n_items=4",
                                      "slices.math.served_texts=4", "quant=int8", "runtime.reference_process=false",
                                      f"paths.results_dir={results}", f"paths.cache_dir={cache}",
                                      f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "compare.n_resamples=1000",
                                      f"hydra.sweep.dir={tmp_path / 'multirun'}", *overrides])
    entry.main()
    return [(p.parent, json.loads(p.read_text()), json.loads((p.parent / "config.json").read_text()))
            for p in sorted(results.glob("*/summary.json"))]


@pytest.mark.slow
def test_budget_and_cap_sweeps_of_a_thinking_model_are_keyed_apart(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    gate = ["gate.enabled=true", "+gate.thinking.cap_hit=0.5", "+gate.thinking.trace_ratio=0.5"]
    budgets = _sweep(monkeypatch, tmp_path / "budget", cache, "model.thinking=tags",
                     "eval.thinking_budget=4,8", *gate)
    assert sorted(config["eval"]["thinking_budget"] for _, _, config in budgets) == [4, 8]
    caps = _sweep(monkeypatch, tmp_path / "cap", cache, "model.thinking=tags", "eval.thinking_budget=64",
                  "eval.max_gen_toks=10,14")
    assert sorted(config["eval"]["max_gen_toks"] for _, _, config in caps) == [10, 14]
    runs = budgets + caps
    assert len({summary["run_key"] for _, summary, _ in runs}) == 4
    # each value its own reference entry: four computed, none read from another value's
    entries = [p for p in (cache / "reference").iterdir() if p.is_dir()]
    assert len(entries) == 4, entries
    assert not any(summary["reference_cached"]["math"] for _, summary, _ in runs)
    for directory, summary, config in runs:
        metrics = summary["metrics"]
        # random replies never close the opened trace: every one unclosed at its cap (math's 24 + the budget, or
        # eval.max_gen_toks), every token of every reply a trace token
        assert metrics["math/think_unclosed_ref"] == 1.0 and metrics["math/think_n"] == 4
        assert metrics["math/think_cap_hit_ref"] == 1.0
        assert metrics["math/n_tokens_trace"] > 0 and "math/kl_answer_mean" not in metrics
        assert metrics["overall/n_tokens_answer"] == 0
        cap = config["eval"]["max_gen_toks"] or 24 + config["eval"]["thinking_budget"]
        frame = pd.read_parquet(directory / "thinking.parquet")
        assert (frame["reply_tokens_ref"] >= cap).all()  # re-encoded random text may take a few more tokens
    first = budgets[0][0]
    report = (first / "report.md").read_text()
    assert "### Thinking: math" in report and "| trace never closed | 100.0 | 100.0 |" in report
    gate_json = json.loads((first / "gate.json").read_text())
    criteria = {c["criterion"]: c for c in gate_json["runs"][0]["criteria"]}
    assert {"thinking_cap_hit", "thinking_trace_ratio"} <= set(criteria)
    assert criteria["thinking_cap_hit"]["outcome"] == "inconclusive"  # 4 items < gate.min_items

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'budget' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("quant-harness").experiment_id])
    assert len(runs) == 2
    for run in runs:
        metrics = run.data.metrics
        for name in ("think_cap_hit_ref", "think_cap_hit_quant", "think_unclosed_ref", "think_unclosed_quant",
                     "think_unclosed_delta", "think_loop_ref", "think_tokens_ratio", "n_tokens_trace",
                     "kl_trace_mean", "top1_agree_trace"):
            assert f"detail/math/{name}" in metrics, name
        note = run.data.tags["mlflow.note.content"]
        assert "thinking_cap_hit" in note and "thinking_trace_ratio" in note  # the gate's rows on the run page


@pytest.mark.slow
def test_a_run_without_thinking_keeps_its_keys(make_cfg):
    """The same tiny job with thinking off: no think_*, no KL split, no Thinking section, no thinking.parquet."""
    from harness.config import to_config
    from harness.job.pipeline import run

    summary = run(to_config(make_cfg("model=tiny_random", "model.chat_template=true", "slices=[math]",
                                     "slices.math.n_items=4", "quant=int8", "eval.max_gen_toks=6",
                                     "runtime.reference_process=false")))
    keys = summary["metrics"]
    assert not [k for k in keys if "think_" in k or "_trace" in k or "_answer" in k]
    assert "math/kl_mean" in keys  # the headline KL is still measured on the served replies
