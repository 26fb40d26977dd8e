"""The staged production comparison on a REAL engine: two ``vllm serve`` processes (vLLM's CPU build in .venv-engine),
the reference's own SmolLM2 weights and the harness's INT8 W8A8 export, answer the same items, started and stopped by
the job (``reference.serve`` beside ``candidate.serve``). Checked against the comparison the harness already trusts,
the same served candidate against the reference computed in this process: the reference server's teacher-forced NLL
along the same texts agrees with the in-process reference's (two fp32 implementations), and the two-sided KL bound
never exceeds the one-sided one. Slow (four server starts), skipped without .venv-engine unless
HARNESS_REQUIRE_SYSTEM_TESTS=1."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.config import to_config
from harness.job import pipeline as run_mod
from harness.models.loading import serving_directory
from tests.test_endpoint_vllm import ENGINE_ENV, ITEMS, _engine_processes, harness_export, vllm_command

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def int8_export(tmp_path_factory, shared_model_cache):
    return harness_export(tmp_path_factory, shared_model_cache, "int8_w8a8")


def _run(make_cfg, where: Path, *extra: str):
    result = run_mod.run(make_cfg(*ITEMS, "quant=external", "slices.math.divergence_texts=2",
                                  f"paths.results_dir={where}", *extra))
    (found,) = [d for d in where.iterdir() if (d / "summary.json").exists()]
    return result, found


def test_two_vllm_servers_pair_as_a_served_candidate_against_the_in_process_reference(make_cfg, int8_export,
                                                                                      tmp_path, monkeypatch):
    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    reference_dir = serving_directory(to_config(make_cfg(*ITEMS)).model, to_config(make_cfg(*ITEMS)).paths.cache_dir)
    candidate = f"candidate.serve='{vllm_command(int8_export, 'smollm2-int8')}'"
    staged, staged_dir = _run(make_cfg, tmp_path / "staged", candidate,
                              f"reference.serve='{vllm_command(reference_dir, 'smollm2-reference')}'")
    one_sided, one_dir = _run(make_cfg, tmp_path / "one_sided", candidate)
    params = staged["candidate"]
    assert params["reference.served_model"] == "smollm2-reference" and params["reference.engine"] == "vllm-serve"
    assert params["candidate.served_model"] == "smollm2-int8" and "both sides served" in params["candidate.divergence"]
    assert (staged_dir / "reference" / "serve.log").exists() and (staged_dir / "serve.log").exists()
    items = pd.read_parquet(staged_dir / "items.parquet")
    assert len(items) == 4 and items["response_ref"].notna().all() and items["response_quant"].notna().all()
    # the same candidate server's answers in both runs (greedy, one request at a time)
    other = pd.read_parquet(one_dir / "items.parquet").set_index("item_id").loc[items["item_id"]]
    assert (items["response_quant"].to_numpy() == other["response_quant"].to_numpy()).all()
    ta = pd.read_parquet(staged_dir / "tokens.parquet")
    tb = pd.read_parquet(one_dir / "tokens.parquet")
    assert len(ta) and (ta["kl_bound"] == "topk_partition").all() and np.isfinite(ta["kl"]).all()
    same = items.set_index("item_id")["response_ref"].loc[other.index] == other["response_ref"]
    assert same.sum() >= 3  # vLLM's greedy replies of the reference's own weights are the in-process reference's
    if same.all():  # the same texts: position by position
        key = ["slice", "text", "position"]
        ta, tb = ta.sort_values(key).reset_index(drop=True), tb.sort_values(key).reset_index(drop=True)
        # vLLM's fp32 forward against the in-process fp32 reference's, along the same tokens
        # (measured: 1e-5 nats mean, 4e-5 at most)
        assert np.abs(ta["nll_ref"] - tb["nll_ref"]).mean() < 1e-3
        # fewer cells: never above, up to the two forwards' rounding (measured: 9 of 188 positions above, by at most
        # 5e-6 nats, 0.07 % of their value)
        assert (ta["kl"] <= tb["kl"] * 1.001 + 1e-5).all() and ta["kl"].mean() <= tb["kl"].mean()
    assert ta["kl"].mean() > 0  # INT8 W8A8 differs from its reference, and the bound sees it
    assert not _engine_processes(int8_export) and not _engine_processes(reference_dir)
