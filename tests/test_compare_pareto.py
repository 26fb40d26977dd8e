"""harness.compare with measured serving speed: quality against speed-up and its Pareto front (stated by hand for
synthetic runs whose flips and speed-ups are fixed), a slower scheme said so, and the ledger's predicted weight
memory and decode floor beside the engine's measurements (vLLM log lines as the CPU build and a GPU write them;
the ledger against a hand computation from the parameter counts)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.compare import CompareOptions, RunData, analyse, load_results_dir, write_report
from harness.compare.render import plots
from harness.compare.render.tables import speed_findings, speed_text_table
from harness.compare.render.terminal import terminal_table
from harness.compare.speed import pareto_front
from harness.engines import perf
from harness.sizing import measured
from harness.quant.report import QuantReport
from harness.sizing.ledger import DEFAULT_GPUS, GPU_BANDWIDTH, decode_floor_metrics, decode_floor_table

N_RIGHT, N_WRONG = 150, 50  # the reference's answers on the 200 items of every synthetic run

# vLLM 0.32's CPU build (tests/test_perf.py) and a GPU build's weight line
CPU_LOG = ("(Worker pid=7618) INFO 12-06 08:06:19 [weight_utils.py:1108] Filesystem type for checkpoints: EXT4. "
           "Checkpoint size: 0.21 GiB. Available RAM: 19.88 GiB.\n"
           "(Worker pid=7618) INFO 12-06 08:06:22 [cpu_worker.py:260] Explicitly set (1.0/23.54) GiB for KV cache on "
           "node 0.\n(EngineCore pid=7554) INFO 12-06 08:06:22 [kv_cache_utils.py:2327] CPU KV cache size: 23,296 "
           "tokens, Maximum concurrency for 4,096 tokens per request: 5.69x\n")


def _items(right_to_wrong: int) -> pd.DataFrame:
    ref = [1.0] * N_RIGHT + [0.0] * N_WRONG
    quant = [0.0 if k < right_to_wrong else r for k, r in enumerate(ref)]
    return pd.DataFrame({"item_id": [f"math/{k:03d}" for k in range(len(ref))], "slice": "math", "task": "t",
                         "sub_slice": None, "cluster": None, "output_type": "generate_until", "target": "x",
                         "correct_ref": ref, "correct_quant": quant, "response_ref": "a",
                         "response_quant": ["a" if r == q else "b" for r, q in zip(ref, quant)]})


def _perf(speedup: tuple[float, float, float], tpot_s: float = 0.02) -> dict:
    point, low, high = speedup
    side = {"output_tok_s": 10.0, "tpot_p50": tpot_s}
    return {"settings": {}, "levels": [{"concurrency": 1, "candidate": side, "reference": dict(side),
                                        "candidate_engine": {}, "reference_engine": {},
                                        "speedup": point, "speedup_ci_low": low, "speedup_ci_high": high}],
            "log": {}, "device": "cpu"}


def _run(scheme: str, right_to_wrong: int, speedup: tuple[float, float, float] | None) -> RunData:
    summary = {"run_key": f"k-{scheme}", "model": "toy", "scheme": scheme, "method": "rtn", "slices": ["math"],
               "quant": {"bits_per_weight": 8.0}}
    return RunData(run_id=None, summary=summary, items=_items(right_to_wrong), tokens=pd.DataFrame(),
                   generation=pd.DataFrame(), source=f"synthetic/{scheme}", perf=_perf(speedup) if speedup else {})


def _runs() -> list[RunData]:
    # Δ = −flips / 200: int8 −1 pt at 1.8×, int4 −5 pt at 2.5×, nvfp4 −6 pt at 2.0× (int4 is faster and better),
    # fp8 −0.5 pt at 0.06× (the reference, at 1× and 0 pt, is faster and better); bf16 has no speed measured.
    return [_run("int8", 2, (1.8, 1.7, 1.9)), _run("int4", 10, (2.5, 2.4, 2.6)), _run("nvfp4", 12, (2.0, 1.9, 2.1)),
            _run("fp8", 1, (0.06, 0.059, 0.061)), _run("bf16", 0, None)]


def test_pareto_front_stated_by_hand_and_slower_scheme_in_words(tmp_path):
    report = analyse(_runs(), CompareOptions(n_resamples=200, out=str(tmp_path)))
    speed = report.speed.set_index("label")
    assert "bf16" not in speed.index  # no perf measured: no point
    assert speed.loc["int8", "delta"] == pytest.approx(-2 / 200) and speed.loc["int4", "delta"] == pytest.approx(-0.05)
    front = set(speed.index[speed["pareto"]])
    assert front == {"int8", "int4", "reference (own weights)"}
    assert speed.loc["fp8", "speed"].startswith("SLOWER than its reference (0.06×")
    assert speed.loc["int8", "speed"].startswith("faster than its reference")
    lines = speed_findings(report)
    assert lines[0].startswith("Pareto front at 1 in flight") and all(n in lines[0] for n in ("int8", "int4"))
    assert "nvfp4" not in lines[0] and "fp8" not in lines[0].replace("(own weights)", "")
    assert any(line.startswith("fp8 is SLOWER than its reference at 1 in flight") for line in lines)
    table = speed_text_table(report).set_index("scheme")
    assert table.loc["int4", "Pareto"] == "★ yes" and table.loc["nvfp4", "Pareto"] == "no"
    assert table.loc["int8", "speed-up [CI]"] == "1.80 [1.70, 1.90]"
    assert "fp8 is SLOWER" in terminal_table(report)

    written = write_report(report, tmp_path)
    md = written["markdown"].read_text()
    section = md[md.index("## Quality against measured speed"):md.index("## Plots")]
    assert "![quality_vs_speed](quality_vs_speed.png)" in section and "SLOWER" in section
    assert written["quality_vs_speed"].stat().st_size > 10_000
    assert 'data-plot="quality_vs_speed"' in written["html"].read_text()
    assert pd.read_parquet(written["speed"])["pareto"].sum() == 3


def test_pareto_plot_names_the_front():
    report = analyse(_runs(), CompareOptions(n_resamples=200))
    fig = plots.quality_vs_speed(report.speed, margin=0.02)
    names = {text.get_text() for text in fig.axes[0].texts}
    assert {"int8 ★", "int4 ★", "nvfp4", "fp8 (slower)"} == names
    legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert "reference (own weights) ★" in legend


def _front_by_sweep(points: list[tuple[float, float]]) -> list[bool]:
    """Independent reference: sort by speed (then quality) descending, keep a point when its quality beats every
    faster point's (equal points all stay)."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1]))
    keep, best, previous = [False] * len(points), -math.inf, None
    for i in order:
        if points[i] == previous or points[i][1] > best:
            keep[i] = True
        if points[i][1] > best:
            best = points[i][1]
        previous = points[i] if keep[i] else previous
    return keep


def test_pareto_front_agrees_with_a_sort_and_sweep():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 9))
        points = [(float(rng.integers(0, 4)), float(rng.integers(0, 4))) for _ in range(n)]  # ties on purpose
        assert pareto_front(points) == _front_by_sweep(points), points
    assert pareto_front([(1.0, math.nan), (0.5, 0.0)]) == [False, True]


def test_perf_json_beside_a_run_or_given_and_matched(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    source = _run("int8", 2, None)
    (run_dir / "summary.json").write_text(json.dumps(source.summary))
    source.items.to_parquet(run_dir / "items.parquet")
    assert load_results_dir(run_dir).perf == {}
    given = tmp_path / "parity" / "perf.json"
    given.parent.mkdir()
    given.write_text(json.dumps({**_perf((1.5, 1.4, 1.6)), "run": str(run_dir)}))
    report = analyse([load_results_dir(run_dir)], CompareOptions(n_resamples=200, perf=[str(given.parent)]))
    assert report.speed.set_index("label").loc["int8", "speedup"] == 1.5
    (run_dir / "perf.json").write_text(json.dumps(_perf((0.5, 0.4, 0.6))))
    assert load_results_dir(run_dir).perf["levels"][0]["speedup"] == 0.5
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**_perf((1.5, 1.4, 1.6)), "model": "toy", "scheme": "awq"}))
    with pytest.raises(ValueError, match="matches no compared run"):
        analyse([load_results_dir(run_dir)], CompareOptions(n_resamples=200, perf=[str(other)]))
    with pytest.raises(ValueError, match="perf=.*no perf.json there"):
        CompareOptions(perf=[str(tmp_path / "missing")]).check()
    with pytest.raises(ValueError, match="perf_device="):
        CompareOptions(perf_device="L40S:48").check()


# ------------------------------------------------------------------ predicted beside measured

P, VOCAB, HIDDEN, QUANTIZED = 1_000_000_000, 50_000, 2_048, 800_000_000  # toy model: untied embedding


def _ledger_summary() -> dict:
    report = QuantReport(scheme="int8", method="rtn", total_params=P, input_embedding=(VOCAB, HIDDEN))
    report.add_stored_layer("layers", 40_000, 20_000, 8.25)  # 800M parameters at 8.25 bits (scales included)
    table = decode_floor_table(report, {g: GPU_BANDWIDTH[g] for g in DEFAULT_GPUS}, model_name="toy")
    return {"model": "toy", "scheme": "int8", "quant": {**report.summary(), **decode_floor_metrics(table)}}


def test_predicted_beside_measured_against_a_hand_computation():
    # hand: the scheme's bytes = (800M × 8.25 + 200M × 16) / 8; decode gathers one row of the untied embedding
    weight = (QUANTIZED * 8.25 + (P - QUANTIZED) * 16) / 8
    assert weight == 1.225e9
    gathered = (VOCAB - 1) * HIDDEN * 2
    result = _perf((1.5, 1.4, 1.6), tpot_s=0.0005)
    result["levels"].append({**result["levels"][0], "concurrency": 8})
    result["levels"][1]["candidate"] = {"tpot_p50": 0.1}  # not the level read: the lowest concurrency is
    result["log"] = {"candidate": perf.server_log_facts("INFO [gpu_model_runner.py] Model loading took 1.15 GiB "
                                                        "memory and 3.1 seconds\n"),
                     "reference": perf.server_log_facts(CPU_LOG)}
    result["device"] = "NVIDIA H200"
    rows = {r["side"]: r for r in measured.predicted_vs_measured(result, _ledger_summary())}
    cand, ref = rows["candidate"], rows["reference"]
    assert cand["predicted_weight_gb"] == pytest.approx(1.225)
    assert ref["predicted_weight_gb"] == pytest.approx(2.0)  # 1e9 parameters in BF16
    assert cand["measured_weight_gb"] == pytest.approx(1.15 * 1.073741824)
    assert cand["measured_weight_from"] == "weights loaded" and ref["measured_weight_from"] == "checkpoint size"
    assert ref["measured_weight_gb"] == pytest.approx(0.21 * 2**30 / 1e9)  # the CPU build's checkpoint line
    assert cand["weight_ratio"] == pytest.approx(1.15 * 1.073741824 / 1.225)
    assert cand["gpu"] == "H200"
    assert cand["predicted_floor_ms"] == pytest.approx((weight - gathered) / 4.8e12 * 1e3)
    assert ref["predicted_floor_ms"] == pytest.approx((2e9 - gathered) / 4.8e12 * 1e3)
    assert cand["measured_tpot_ms"] == pytest.approx(0.5) and cand["tpot_concurrency"] == 1
    assert cand["decode_ratio"] == pytest.approx(0.5 / ((weight - gathered) / 4.8e12 * 1e3))
    # a device given as NAME:memory_GB:bandwidth_TBps; a CPU gets no floor and the table says why
    custom = {r["side"]: r for r in measured.predicted_vs_measured(result, _ledger_summary(), "L40S:48:0.864")}
    assert custom["candidate"]["predicted_floor_ms"] == pytest.approx((weight - gathered) / 0.864e12 * 1e3)
    result["device"] = "cpu"
    cpu = measured.predicted_vs_measured(result, _ledger_summary())
    assert math.isnan(cpu[0]["predicted_floor_ms"])
    assert "has no bandwidth in the ledger" in perf.predicted_markdown(cpu)


def test_measured_figures_reach_perf_md_mlflow_metrics_and_the_comparison(tmp_path):
    result = _perf((1.5, 1.4, 1.6), tpot_s=0.0005)
    result["log"] = {"candidate": perf.server_log_facts(CPU_LOG), "reference": perf.server_log_facts(CPU_LOG)}
    result["settings"] = {"rounds": 2, "max_tokens": 32, "ignore_eos": True, "warmup": 1, "ci_level": 0.95}
    result["device"] = "NVIDIA H100 80GB HBM3"
    run_dir = tmp_path / "sim"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps(_ledger_summary()))
    measured.describe_run(result, run_dir)
    assert result["scheme"] == "int8" and result["run"] == str(run_dir.resolve())
    flat = perf.flat_metrics(result)
    assert flat["perf/log/candidate/checkpoint_gib"] == 0.21 and flat["perf/log/reference/kv_cache_tokens"] == 23296
    assert flat["perf/predicted/candidate/predicted_weight_gb"] == pytest.approx(1.225)
    assert "| candidate | 1.225 | 0.225 (checkpoint size) | 0.18 |" in perf.perf_markdown(result)

    run = _run("int8", 2, None)
    run.summary = {**run.summary, **_ledger_summary()}
    run.perf = result
    report = analyse([run], CompareOptions(n_resamples=200, out=str(tmp_path / "out")))
    shown = report.measured.set_index("side")
    assert shown.loc["candidate", "gpu"] == "H100"
    assert shown.loc["reference", "weight_ratio"] == pytest.approx(0.21 * 2**30 / 1e9 / 2.0)
    md = write_report(report, tmp_path / "out")["markdown"].read_text()
    assert "## Predicted against measured (memory and decode speed)" in md
    assert "0.225 (checkpoint size)" in md and "0.50 (1 in flight)" in md


def test_the_front_and_its_plot_reach_the_comparisons_mlflow_run(tmp_path):
    from mlflow.tracking import MlflowClient

    from harness.compare import log_comparison

    report = analyse(_runs(), CompareOptions(n_resamples=200, out=str(tmp_path / "out")))
    write_report(report, tmp_path / "out")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = log_comparison(report, tmp_path / "out", uri=uri, experiment="pareto")
    client = MlflowClient(tracking_uri=uri)
    logged = client.get_run(run_id)
    assert logged.data.metrics["n_pareto"] == 2 and logged.data.metrics["n_slower"] == 1  # int8, int4; fp8
    names = {entry.path for entry in client.list_artifacts(run_id)}
    assert {"quality_vs_speed.png", "speed.parquet", "comparison.md"} <= names
