"""The reference's second process dies (the kernel's OOM killer: SIGKILL) or stalls (SIGSTOP): reported, replaced.

The faults are real signals sent to the real child process of a job; what is injected is only the
cgroup's OOM-kill counter (a kernel OOM cannot be ordered on a shared test machine), so the
report can say "out-of-memory killer". The job then computes the reference itself, and its
per-item records equal those of an undisturbed job with one thread.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pandas as pd
import pytest

from harness.job import background_reference
from harness.job.pipeline import run

TINY = ["model=tiny_random", "slices=[math]", "slices.math.n_items=9", "slices.math.divergence_texts=2",
        "slices.math.tasks=[harness_math_gen,harness_math_mc]", "quant=int4_g128", "tracking.enabled=false"]


def test_the_oom_kill_counter_of_this_cgroup_is_read():
    kills = background_reference.oom_kills()
    assert kills is None or kills >= 0


def test_why_a_child_ended_is_said_in_words():
    assert "out-of-memory killer (cgroup oom_kill 2 -> 3)" in background_reference.why_ended(-signal.SIGKILL, 2, 3)
    assert "SIGKILL" in background_reference.why_ended(-signal.SIGKILL, 2, 2)
    assert background_reference.why_ended(-signal.SIGSEGV, None, None) == "killed by signal SIGSEGV"
    assert background_reference.why_ended(1, None, None) == "exited with status 1"


def _disturb_child(monkeypatch, action) -> tuple[list, list]:
    """Run ``action(pid)`` once the job's reference process has run its model; (backgrounds, pids acted on)."""
    started, acted = [], []
    original = background_reference.start

    def start(*args, **kwargs):
        background = original(*args, **kwargs)
        if background is not None:
            started.append(background)

            def later() -> None:
                try:
                    first = background.progress.stat().st_mtime
                    deadline = time.monotonic() + 300
                    while background.progress.stat().st_mtime == first and time.monotonic() < deadline:
                        time.sleep(0.05)  # the progress file moves once the child's model runs
                except FileNotFoundError:
                    return  # the child ended first (the test then fails: nothing was acted on)
                action(background.process.pid)
                acted.append(background.process.pid)

            threading.Thread(target=later, daemon=True).start()
        return background

    monkeypatch.setattr(background_reference, "start", start)
    return started, acted


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, shared_model_cache):
    from harness.config import compose

    tmp = tmp_path_factory.mktemp("undisturbed")
    (tmp / "cache").mkdir()
    (tmp / "cache" / "models").symlink_to(shared_model_cache)
    cfg = compose([*TINY, "runtime.threads=1", "runtime.reference_process=false", "compare.n_resamples=1000",
                   f"paths.results_dir={tmp / 'results'}", f"paths.cache_dir={tmp / 'cache'}"])
    run(cfg)
    return pd.read_parquet(next((tmp / "results").glob("*/items.parquet")))


def _items(tmp_path, name):
    return pd.read_parquet(next((tmp_path / name).glob("*/items.parquet")))


@pytest.mark.slow
def test_an_oom_killed_reference_process_is_reported_and_the_job_computes_it(make_cfg, tmp_path, monkeypatch,
                                                                             caplog, undisturbed):
    counts = iter([4, 5])  # the cgroup's oom_kill counter before and after (injected; the SIGKILL is real)
    monkeypatch.setattr(background_reference, "oom_kills", lambda: next(counts, 5))
    started, acted = _disturb_child(monkeypatch, lambda pid: os.kill(pid, signal.SIGKILL))
    with caplog.at_level(logging.WARNING):
        result = run(make_cfg(*TINY, "runtime.threads=2", "runtime.reference_process=true",
                              f"paths.results_dir={tmp_path / 'killed'}"))
    assert acted == [started[0].process.pid] and started[0].process.exitcode == -signal.SIGKILL
    reports = [r.getMessage() for r in caplog.records if "reference process pid" in r.getMessage()]
    assert len(reports) == 1 and "out-of-memory killer (cgroup oom_kill 4 -> 5)" in reports[0]
    assert result["runtime"]["reference_process_ended"].startswith("killed by the kernel's out-of-memory killer")
    pd.testing.assert_frame_equal(_items(tmp_path, "killed"), undisturbed)


@pytest.mark.slow
def test_a_stalled_reference_process_is_reported_killed_and_replaced(make_cfg, tmp_path, monkeypatch, caplog,
                                                                     undisturbed):
    started, acted = _disturb_child(monkeypatch, lambda pid: os.kill(pid, signal.SIGSTOP))  # alive, but stuck
    begin = time.monotonic()
    with caplog.at_level(logging.WARNING):
        result = run(make_cfg(*TINY, "runtime.threads=2", "runtime.reference_process=true",
                              "runtime.reference_stall_s=20", f"paths.results_dir={tmp_path / 'stalled'}"))
    assert acted == [started[0].process.pid] and started[0].process.exitcode == -signal.SIGKILL
    reports = [r.getMessage() for r in caplog.records if "reference process pid" in r.getMessage()]
    assert len(reports) == 1 and "made no progress for" in reports[0] and "reference_stall_s=20" in reports[0]
    assert "no progress" in result["runtime"]["reference_process_ended"]
    assert time.monotonic() - begin < 600  # not the lock's 12 h wait
    pd.testing.assert_frame_equal(_items(tmp_path, "stalled"), undisturbed)
