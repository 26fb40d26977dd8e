"""The engine tier: ``python -m harness.parity`` makes its three runs with a REAL vLLM (CPU build, .venv-engine).

SmolLM2's FP8 W8A8 simulation, the same scheme's export served by vLLM, and the reference's own weights served
by vLLM (the engine-noise floor), on four math items; the table must pair every item of the three runs and
its counts must equal those read from the runs' own items.parquet. Slow (two server starts); skipped without
.venv-engine unless HARNESS_REQUIRE_SYSTEM_TESTS=1.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from harness.job import parity_runs as parity
from tests.test_endpoint_vllm import ENGINE_ENV, ENGINE_PYTHON, ITEMS, _engine

pytestmark = pytest.mark.slow


def test_parity_makes_the_simulation_the_served_export_and_the_floor(tmp_path, shared_model_cache, monkeypatch,
                                                                     capsys):
    _engine()
    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "cache").mkdir()
    os.symlink(shared_model_cache, tmp_path / "cache" / "models")
    serve = (f"{ENGINE_PYTHON} -m vllm.entrypoints.openai.api_server --model {{model}} --host 127.0.0.1 "
             "--port {port} --dtype float32 --max-model-len 2048 --enforce-eager")
    out = tmp_path / "parity"
    code = parity.main([*ITEMS, "quant=fp8", f"serve={serve}", f"out={out}", f"paths.cache_dir={tmp_path / 'cache'}",
                        f"paths.results_dir={tmp_path / 'results'}", "tracking.enabled=false"])
    assert code == 0, capsys.readouterr()
    runs = json.loads((out / "parity.json").read_text())
    items = {side: pd.read_parquet(Path(runs[side]) / "items.parquet").set_index("item_id")
             for side in ("simulation", "served", "floor")}
    assert len(items["simulation"]) == 4 and all(set(t.index) == set(items["simulation"].index) for t in items.values())
    summaries = {side: json.loads((Path(runs[side]) / "summary.json").read_text()) for side in items}
    assert summaries["simulation"]["scheme"] == "fp8"
    assert summaries["served"]["candidate"]["candidate.format"] == "float-quantized"  # vLLM served the fp8 export
    assert summaries["floor"]["candidate"]["candidate.method"] == "served"
    overall = pd.read_parquet(out / "parity.parquet").set_index("slice").loc["overall"]
    sim = items["simulation"]
    served, floor = items["served"].loc[sim.index], items["floor"].loc[sim.index]
    assert overall["disagree_sim_served"] == pytest.approx((sim["response_quant"] != served["response_quant"]).mean())
    assert overall["disagree_floor"] == pytest.approx((floor["response_ref"] != floor["response_quant"]).mean())
    assert overall["delta"] == pytest.approx(served["correct_quant"].mean() - sim["correct_quant"].mean())
    assert "Parity: smollm2_135m · fp8" in (out / "parity.md").read_text()
    # vLLM returns top-k prompt log-probs: the served runs' KL is a lower bound, and named so
    assert overall["kl_served_on"] == "top-k lower bound" and overall["kl_served"] >= 0
    assert overall["kl_floor"] == pytest.approx(summaries["floor"]["metrics"]["overall/kl_lower_bound_mean"])
