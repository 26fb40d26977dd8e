"""Bad input fails early with a message that names the problem and the fix."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.config import to_config
from harness.models import loading as models
from harness.job import pipeline as run_mod
from harness.config import SliceConfig, load_model_config
from harness.quant import SchemeError
from harness.evaluation.slices import SliceError
from tests.conftest import TINY_MATH

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HYDRA_FULL_ERROR": "0"})


def test_unknown_group_option_lists_the_available_ones(tmp_path):
    out = _cli("model=no_such_model", "--cfg", "job", cwd=tmp_path)
    assert out.returncode != 0
    assert "no_such_model" in out.stderr
    assert "smollm2_135m" in out.stderr and "tiny_random" in out.stderr


@pytest.mark.slow
def test_unknown_key_and_wrong_type_fail_at_start(tmp_path):
    typo = _cli("quant=int4_g128", "quant.weights.bitz=3", "--cfg", "job", cwd=tmp_path)
    assert typo.returncode != 0 and "bitz" in typo.stderr
    wrong_type = _cli("model.batch_size=many", "--cfg", "job", cwd=tmp_path)
    assert wrong_type.returncode != 0 and "model.batch_size" in wrong_type.stderr


@pytest.mark.slow
def test_cfg_job_prints_the_resolved_config(tmp_path):
    out = _cli("--cfg", "job", cwd=tmp_path)
    assert out.returncode == 0
    assert "name: smollm2_135m" in out.stdout and "name: int4_g128" in out.stdout


@pytest.mark.slow
def test_group_size_that_does_not_divide_is_refused_before_evaluation(make_cfg, monkeypatch):
    calls = []
    monkeypatch.setattr(run_mod, "reference_unless_busy", lambda *a, **k: calls.append(a))
    with pytest.raises(SchemeError, match=r"group/block size 96 does not divide the input size 128"):
        run_mod.run(make_cfg(*TINY_MATH, "quant=int4_g128", "quant.weights.group_size=96"))
    assert calls == []  # nothing was evaluated


@pytest.mark.slow
def test_unknown_slice_names_the_offline_slices(make_cfg, tmp_path):
    out = _cli("slices=[nope]", "--cfg", "job", cwd=tmp_path)
    assert out.returncode != 0 and "unknown slices option(s) ['nope']" in out.stderr and "math" in out.stderr
    cfg = to_config(make_cfg(*TINY_MATH))
    cfg.slices["nope"] = SliceConfig(tasks=["x"], size="quick")  # configured, but no generator on disk
    with pytest.raises(SliceError, match="offline slices"):
        run_mod.run(cfg)


def test_unreachable_hub_fails_fast_with_a_clear_message(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_model_config("llama8b")
    cfg.device = "cpu"
    with pytest.raises(models.ModelLoadError, match="Llama-3.1-8B-Instruct"):
        models.check_available(cfg)


def test_unreachable_hub_without_offline_flag_fails_fast(monkeypatch):
    """With no network the hub probe errors quickly (DNS/connection), not after minutes."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    cfg = load_model_config("llama8b")
    cfg.device = "cpu"
    with pytest.raises(models.ModelLoadError, match="cannot reach the Hugging Face hub"):
        models.check_available(cfg)


def test_cuda_device_on_a_cpu_machine_is_refused():
    cfg = load_model_config("llama8b")
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(models.ModelLoadError, match="model.device=cpu"):
        models.check_available(cfg)


@pytest.mark.slow
def test_unwritable_results_dir_is_refused_before_evaluation(make_cfg, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    calls = []
    monkeypatch.setattr(run_mod, "reference_unless_busy", lambda *a, **k: calls.append(a))
    with pytest.raises(PermissionError, match="paths.results_dir"):
        run_mod.run(make_cfg(*TINY_MATH, "quant=int8", f"paths.results_dir={blocker}/sub"))
    assert calls == []


@pytest.mark.slow
def test_unreachable_tracking_server_keeps_results_on_disk(make_cfg, tmp_path, caplog):
    result = run_mod.run(make_cfg(*TINY_MATH, "quant=int8", "tracking.uri=http://127.0.0.1:9"))
    directory = next((tmp_path / "results").glob("*"))
    assert (directory / "summary.json").exists() and (directory / "items.parquet").exists()
    assert result["metrics"]["math/kl_mean"] >= 0
    assert any("harness.sync" in r.getMessage() for r in caplog.records)


def test_sync_command_line_errors_are_one_line(tmp_path, capsys):
    from harness.results import sync

    assert sync.main([]) == 2
    assert capsys.readouterr().err.strip() == "error: no results directory given; e.g. python -m harness.sync results/"
    assert sync.main([str(tmp_path), "--uri", "http://x"]) == 2
    assert "unknown flag '--uri'" in capsys.readouterr().err
    assert sync.main([str(tmp_path), "experimnt=x"]) == 2
    assert "unknown option 'experimnt'; python -m harness.sync options: experiment, paths, uri" in capsys.readouterr().err
    assert sync.main([str(tmp_path)]) == 2  # an empty directory holds no results
    assert capsys.readouterr().err.startswith(f"error: no results directories in {tmp_path}")
    assert sync.main(["--help"]) == 0
    assert "uri=None" in capsys.readouterr().out


@pytest.mark.slow
def test_a_user_fixable_error_of_the_job_is_one_line_without_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "harness", "model=llama8b", "model.device=cpu",
                          "tracking.enabled=false", f"paths.results_dir={tmp_path / 'results'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HYDRA_FULL_ERROR": "0", "PYTHONPATH": str(REPO)})
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "Error executing job" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Llama-3.1-8B-Instruct" in errors[0] and "model.path" in errors[0]


@pytest.mark.slow
def test_a_real_bug_keeps_its_traceback(tmp_path):
    program = ("import runpy, sys\n"
               "import harness.job.pipeline\n"
               "def broken(cfg):\n"
               "    raise RuntimeError('a bug, not the user')\n"
               "harness.job.pipeline.run = broken\n"
               "sys.argv = ['harness', 'model=tiny_random', 'tracking.enabled=false']\n"
               "runpy.run_module('harness', run_name='__main__', alter_sys=True)\n")
    out = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HYDRA_FULL_ERROR": "0", "PYTHONPATH": str(REPO)})
    assert out.returncode != 0
    assert "Traceback" in out.stderr and "RuntimeError: a bug, not the user" in out.stderr
    assert not any(line.startswith("error: ") for line in out.stderr.splitlines())
