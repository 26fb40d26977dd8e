"""benchmarks/gpu_check.py's thinking section on the CPU dry run (tiny Qwen3 shape, random weights): the split, the
KL along trace and answer, and the trace statistics checked against what the section builds by construction."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from harness.config import REPO_DIR


@pytest.mark.slow
def test_thinking_section_passes_on_the_dry_run(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_DIR / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    check = module.Check(module.Options(dry_run=True))
    check.step("thinking", lambda: module.section_thinking(check, module.torch.device("cpu"), tmp_path))
    status = {row["check"]: row["status"] for row in check.rows}
    assert status == {"thinking/model": "INFO", "thinking/split": "PASS", "thinking/kl_split": "PASS",
                      "thinking/trace_stats": "PASS"}, check.rows
    kl = next(row for row in check.rows if row["check"] == "thinking/kl_split")
    assert kl["kl_trace"] > 0 and kl["kl_answer"] > 0  # int4 RTN of random weights moves both
