"""benchmarks/gpu_check.py's CPU dry run: every section runs (tiny shapes), so the GPU check cannot rot."""
from __future__ import annotations

import importlib.util
import json
import sys
import pytest

from harness.config import REPO_DIR


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_DIR / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_dry_run_runs_every_section(gpu_check, tmp_path):
    out = tmp_path / "gpu_check.json"
    status = gpu_check.cli.main(gpu_check.TOOL, gpu_check.body,
                                ["--dry-run", f"out={out}", "schemes=[none,int4_g128,gptq_w4g128,awq_w4g128,kv4,nvfp4]"])
    rows = json.loads(out.read_text())["rows"]
    failed = [r for r in rows if r["status"] == "FAIL"]
    assert status == 0 and not failed, failed
    names = {r["check"] for r in rows}
    assert {"env", "8b/prefill", "8b/decode", "schemes/none", "schemes/gptq_w4g128", "schemes/kv4",
            "formats/nvfp4", "formats/fp8_block", "fp8_gemm/q_proj", "fp8_gemm/down_proj", "fp8_gemm/model",
            "generation/greedy == generate",
            "moe/build", "moe/quantize", "moe/decode", "prompts/scale", "thinking/kl_split", "thinking/trace_stats",
            "e2e/none@cpu", "e2e/gptq_w4g128@cpu", "e2e/kv8@cpu", "parity",
            "total"} <= names
    kl = {r["check"]: r.get("kl") for r in rows}
    assert kl["schemes/none"] == 0.0 and kl["schemes/int4_g128"] > 0


def test_a_broken_step_is_a_fail_line_not_a_crash(gpu_check, tmp_path, capsys):
    check = gpu_check.Check(gpu_check.Options(dry_run=True))
    check.step("broken", lambda: 1 / 0)
    check.step("fine", lambda: check.line("PASS", "fine", "ok"))
    assert [r["status"] for r in check.rows] == ["FAIL", "PASS"]
    assert "ZeroDivisionError" in capsys.readouterr().out


def test_without_cuda_the_real_check_says_how_to_dry_run(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.cli.main(gpu_check.TOOL, gpu_check.body, []) == 2
    assert "--dry-run" in capsys.readouterr().err
