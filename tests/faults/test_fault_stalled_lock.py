"""A job that holds a reference lock but stops making progress loses the lock to a waiting job (another node)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.infra.locks import LockTimeout, OwnedLock

REPO = Path(__file__).resolve().parents[2]


def _holder(lock: Path, progress_for_s: float, then_s: float) -> subprocess.Popen:
    """A process that takes ``lock`` (stall_s=1), reports progress for a while, then hangs without any."""
    code = f"""
        import time
        from harness.infra import locks
        lock = locks.OwnedLock({str(lock)!r}, heartbeat_s=0.1, stall_s=1.0)
        lock.acquire()
        print("held", flush=True)
        end = time.monotonic() + {progress_for_s}
        while time.monotonic() < end:
            locks.progress()
            time.sleep(0.05)
        time.sleep({then_s})  # hung: the heartbeat thread is alive, the work is not
    """
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_holder_that_stops_making_progress_lets_its_lock_go_stale(tmp_path, caplog):
    lock = tmp_path / "reference" / "k.lease"
    lock.parent.mkdir()
    holder = _holder(lock, progress_for_s=1.0, then_s=60)
    try:
        assert holder.stdout.readline().strip() == "held"
        begin = time.monotonic()
        with caplog.at_level(logging.WARNING), OwnedLock(lock, stale_s=1.0, timeout_s=30):
            waited = time.monotonic() - begin
        assert holder.poll() is None  # the holder is alive (hung), yet its lock was taken over
        assert 1.5 < waited < 20  # progress for 1 s + stall_s 1 s + stale_s 1 s, give or take polling
        assert "broke the stale lock" in caplog.text and "no heartbeat for" in caplog.text
    finally:
        holder.kill()
        _, err = holder.communicate()
    assert "no progress for" in err and "its heartbeat stops" in err


@pytest.mark.slow
def test_a_holder_that_keeps_making_progress_keeps_its_lock(tmp_path):
    lock = tmp_path / "k.lease"
    holder = _holder(lock, progress_for_s=60, then_s=0)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockTimeout):
            OwnedLock(lock, stale_s=1.0, timeout_s=4).acquire()
    finally:
        holder.kill()
        holder.communicate()
