"""harness.infra.locks.OwnedLock: exclusion across processes, stale locks broken, live ones waited on."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.infra.cache import Cache
from harness.infra.locks import LockTimeout, OwnedLock

REPO = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env)


def test_two_processes_never_hold_it_at_once(tmp_path: Path) -> None:
    counter, lock = tmp_path / "counter", tmp_path / "x.lock"
    counter.write_text("0")
    code = f"""
        import time
        from pathlib import Path
        from harness.infra.locks import OwnedLock
        for _ in range(15):
            with OwnedLock({str(lock)!r}):
                value = int(Path({str(counter)!r}).read_text())
                time.sleep(0.005)  # a lost update would show if both were inside
                Path({str(counter)!r}).write_text(str(value + 1))
    """
    procs = [_python(code) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert counter.read_text() == "30" and not lock.exists()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_lock_whose_owner_died_on_this_host_is_broken_with_a_warning(tmp_path: Path, caplog) -> None:
    path = tmp_path / "x.lock"
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "started": 0, "token": "t"}))
    caplog.set_level(logging.WARNING, "harness.infra.locks")
    start = time.monotonic()
    with OwnedLock(path, timeout_s=5):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert time.monotonic() - start < 2
    assert "broke the stale lock" in caplog.text and "is gone" in caplog.text


def test_a_silent_lock_of_another_node_is_broken_after_stale_s(tmp_path: Path, caplog) -> None:
    path = tmp_path / "x.lock"
    path.write_text(json.dumps({"host": "node-that-died", "pid": 1, "started": 0, "token": "t"}))
    os.utime(path, (time.time() - 10, time.time() - 10))
    caplog.set_level(logging.WARNING, "harness.infra.locks")
    with OwnedLock(path, timeout_s=5, stale_s=5):
        pass
    assert "no heartbeat for" in caplog.text and "node-that-died" in caplog.text


@pytest.mark.slow
def test_a_live_holder_is_waited_for_and_the_timeout_names_the_lock(tmp_path: Path) -> None:
    path, ready = tmp_path / "x.lock", tmp_path / "ready"
    holder = _python(f"""
        import time
        from pathlib import Path
        from harness.infra.locks import OwnedLock
        with OwnedLock({str(path)!r}, heartbeat_s=0.1):
            Path({str(ready)!r}).write_text("1")
            time.sleep(3)
    """)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline, "holder never took the lock"
            time.sleep(0.05)
        # stale_s well under the hold time: only the heartbeat keeps the lock from being broken
        with pytest.raises(LockTimeout, match=f"{path.name}.*held by .* pid {holder.pid}"):
            with OwnedLock(path, timeout_s=1.5, stale_s=0.8):
                pass
    finally:
        assert holder.wait(timeout=60) == 0
    with OwnedLock(path, timeout_s=5):  # released by its holder: free again
        pass


def test_reentrant_within_a_process_and_released_once(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    with cache.lock("ns", "k"):
        with cache.lock("ns", "k", timeout=1):
            assert (tmp_path / "ns" / "k.lease").exists()
        assert (tmp_path / "ns" / "k.lease").exists()
    assert not (tmp_path / "ns" / "k.lease").exists()


def test_an_ownerless_lock_file_is_judged_by_its_age(tmp_path: Path, caplog) -> None:
    """An empty or unreadable lock file (left by a crash mid-write) is not waited on forever."""
    path = tmp_path / "x.lock"
    path.write_text("")
    os.utime(path, (time.time() - 10, time.time() - 10))
    caplog.set_level(logging.WARNING, "harness.infra.locks")
    with OwnedLock(path, timeout_s=5, stale_s=5):
        pass
    assert "broke the stale lock" in caplog.text


def test_cache_leases_do_not_collide_with_filelock_leftovers(tmp_path: Path) -> None:
    (tmp_path / "ns").mkdir()
    (tmp_path / "ns" / "k.lock").write_text("")  # what filelock leaves behind, fresh
    with Cache(tmp_path).lock("ns", "k", timeout=2):
        pass
