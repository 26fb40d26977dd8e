"""No idle GPU in a sweep: a job whose reference another live job is computing quantizes and
evaluates meanwhile, then compares once the reference is ready (or computes it itself, with the
unquantized model loaded again, if that job dies).

Real ``python -m harness`` processes on one cache. The first job runs the harness with its
reference's divergence scoring held until the second job's log shows the stage named in
``OVERLAP_PATTERN`` (a wrapper that patches ``harness.divergence.scoring.score_reference``, then runs
``python -m harness``): the reference provably finishes after the second job started
evaluating, whatever the machine's speed. Both must end with the numbers of a serial run.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.job import pipeline as run_mod
from harness.config import compose
from tests.test_sweeps import TINY as SWEEP_TINY
from tests.test_sweeps import harness_command, job_env, paths, summaries

# One torch thread in every job: the serial comparison must run the same kernels (CPU matmuls
# with another thread count sum in another order, a relative 1e-3 in the tails of the metrics).
TINY = [*SWEEP_TINY, "runtime.threads=1"]

pytestmark = pytest.mark.slow

HOLD = '''
import os, runpy, sys, time
from pathlib import Path
from harness.divergence import scoring as divergence

original = divergence.score_reference

def held(*args, **kwargs):
    watch, mark = Path(os.environ["OVERLAP_WATCH"]), Path(os.environ["OVERLAP_MARK"])
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if watch.exists() and os.environ["OVERLAP_PATTERN"] in watch.read_text(errors="replace"):
            mark.write_text("seen")
            break
        time.sleep(0.1)
    else:
        mark.write_text("not seen")
    if os.environ.get("OVERLAP_HANG"):
        time.sleep(3600)  # killed by the test while it holds the reference lock
    return original(*args, **kwargs)

divergence.score_reference = held
runpy.run_module("harness", run_name="__main__", alter_sys=True)
'''


def start_pair(tmp_path: Path, cache: Path, pattern: str, hang: bool = False) -> tuple[subprocess.Popen, ...]:
    """Start the held first job (int8), wait until it holds the reference lock, start the second (int4)."""
    common = [*TINY, *paths(tmp_path, cache), "tracking.enabled=false"]
    (tmp_path / "hold.py").write_text(HOLD)
    second_log = tmp_path / "second.log"
    env = job_env(OVERLAP_WATCH=str(second_log), OVERLAP_MARK=str(tmp_path / "mark"), OVERLAP_PATTERN=pattern,
                  **({"OVERLAP_HANG": "1"} if hang else {}))
    first = subprocess.Popen([sys.executable, str(tmp_path / "hold.py"), *common, "quant=int8"], cwd=tmp_path,
                             env=env, stdout=(tmp_path / "first.log").open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while not list((cache / "reference").glob("*.lease")):
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
        assert time.monotonic() < deadline, "the first job never took the reference lock"
        time.sleep(0.1)
    second = subprocess.Popen(harness_command(*common, "quant=int4"), cwd=tmp_path, env=job_env(),
                              stdout=second_log.open("w"), stderr=subprocess.STDOUT)
    return first, second


def serial(tmp_path: Path, cache_dir: Path, *schemes: str) -> dict[str, dict]:
    """The same jobs one after another in this process, on a cache of their own."""
    cache = tmp_path / "serial_cache"
    cache.mkdir()
    (cache / "models").symlink_to((cache_dir / "models").resolve())
    for scheme in schemes:
        run_mod.run(compose([*TINY, *paths(tmp_path, cache, results="serial"), "tracking.enabled=false",
                             f"quant={scheme}"]))
    return summaries(tmp_path / "serial")


def same_numbers(found: dict, expected: dict) -> None:
    """Accuracies and flips exactly; token metrics to float rounding. A job that waited for its reference could
    not keep its states while answering (the reference's replies were not known yet), so the divergence stage
    runs its texts again, batched otherwise than the serial job's capture: 2.1e-6 relative at most, measured."""
    assert found == pytest.approx(expected, rel=1e-5, abs=1e-9, nan_ok=True)
    exact = [k for k in expected if "acc" in k or "flip" in k]
    assert exact and {k: found[k] for k in exact} == {k: expected[k] for k in exact}


def test_second_job_evaluates_while_the_first_computes_the_reference(tmp_path, cache_dir):
    # held until the second job has chosen to evaluate its slice without the reference ("▶ evaluate" alone
    # comes before that choice: a fast first job could finish in between, and nothing would be deferred)
    first, second = start_pair(tmp_path, cache_dir, "evaluated before its reference is ready")
    for proc, log in ((first, "first.log"), (second, "second.log")):
        assert proc.wait(timeout=900) == 0, (tmp_path / log).read_text()[-4000:]
    # the first job's reference was still unfinished when the second job's evaluation began
    assert (tmp_path / "mark").read_text() == "seen"
    found = summaries(tmp_path / "results")
    assert found["int8"]["reference_deferred"] == [] and found["int8"]["reference_cached"] == {"math": False}
    assert found["int4"]["reference_deferred"] == ["math"] and found["int4"]["reference_cached"] == {"math": True}
    assert "reference_wait" in found["int4"]["timings"] and "reference_wait" not in found["int8"]["timings"]
    log = (tmp_path / "second.log").read_text()
    assert log.index("another job is computing it") < log.index("▶ quantize") < log.index("▶ reference_wait")
    entries = [p for p in (cache_dir / "reference").iterdir() if p.is_dir()]
    assert len(entries) == 1 and (entries[0] / "COMPLETE").exists()  # computed once
    expected = serial(tmp_path, cache_dir, "int8", "int4")
    for scheme in ("int8", "int4"):
        same_numbers(found[scheme]["metrics"], expected[scheme]["metrics"])
        assert found[scheme]["metrics"]["math/kl_mean"] > 0


def test_second_job_computes_the_reference_itself_when_the_first_dies(tmp_path, cache_dir):
    first, second = start_pair(tmp_path, cache_dir, "▶ reference_wait", hang=True)
    try:
        deadline = time.monotonic() + 900
        while not (tmp_path / "mark").exists():  # the second job is waiting for the reference
            assert second.poll() is None, (tmp_path / "second.log").read_text()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert (tmp_path / "mark").read_text() == "seen"
        first.send_signal(signal.SIGKILL)  # dies holding the reference lock, its entry unwritten
        first.wait(timeout=60)
        assert second.wait(timeout=900) == 0, (tmp_path / "second.log").read_text()[-4000:]
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = (tmp_path / "second.log").read_text()
    assert "broke the stale lock" in log and "ended without finishing it" in log
    found = summaries(tmp_path / "results")
    assert set(found) == {"int4"} and found["int4"]["reference_deferred"] == ["math"]
    expected = serial(tmp_path, cache_dir, "int4")
    same_numbers(found["int4"]["metrics"], expected["int4"]["metrics"])
