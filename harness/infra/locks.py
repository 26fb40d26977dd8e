"""A cross-process, cross-node lock file with an owner, a heartbeat and stale-lock breaking.

``flock`` (what ``filelock`` uses) is per node on several cluster filesystems (Lustre and BeeGFS
mounted without global locking, NFS without lockd): two nodes can both "hold" it. A lock
*file* created with ``O_CREAT | O_EXCL`` is atomic on those filesystems (NFSv3+ included), so it
is the lock here. The file records its owner (host, pid, start time, a random token); a thread
of the holder touches it every ``heartbeat_s``. A waiter breaks the lock, with a warning, when
its owner is on this host and no longer alive, or when its heartbeat is older than
``stale_s`` (the owner was killed, or its node died). Waiting longer than ``timeout_s`` raises
an error naming the lock file and its owner. Breaking renames the lock file aside first and
checks it is still the one judged stale, so a lock taken meanwhile by another job is put back.

A lock taken with ``stall_s`` also stops beating when its holder stops making progress: the
holder reports progress with :func:`progress` (the reference stage does on every forward of its
model), and once none came for ``stall_s`` the heartbeat thread, which would otherwise go on
beating for a hung main thread (a stuck file system read, a wedged GPU), says so once and lets
the lock go stale, so a waiting job (another node of a sweep) breaks it and takes over.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
STALE_S = 120.0  # twelve missed heartbeats
POLL_S = 0.25
_held: dict[str, "OwnedLock"] = {}  # path -> the lock this process holds (re-entrant per process)
_held_guard = threading.Lock()
_progress = [time.monotonic()]  # when this process last reported progress (see progress())


def progress() -> None:
    """Report that this process is making progress (keeps its ``stall_s`` locks beating)."""
    _progress[0] = time.monotonic()


class LockTimeout(TimeoutError):
    """Waited longer than allowed for a lock another job holds."""


def holds(path: str | os.PathLike) -> bool:
    """Whether this process holds the lock at ``path`` (taken with :class:`OwnedLock` and not released)."""
    with _held_guard:
        return str(Path(path).resolve()) in _held


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OwnedLock:
    """Context manager: ``with OwnedLock(path): ...``; see the module doc."""

    def __init__(self, path: str | os.PathLike, *, timeout_s: float | None = None, heartbeat_s: float = HEARTBEAT_S,
                 stale_s: float = STALE_S, stall_s: float | None = None):
        self.path = Path(path)
        self.stall_s = stall_s
        self.timeout_s = timeout_s if timeout_s is None or timeout_s >= 0 else None
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                      "token": uuid.uuid4().hex}
        self._depth = 0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # -- acquiring ---------------------------------------------------------------------------
    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            json.dump(self.owner, handle)
            handle.flush()
            os.fsync(handle.fileno())
        return True

    def _read_owner(self) -> tuple[dict[str, Any] | None, float | None]:
        """(owner, heartbeat time) of the lock file; (None, None) when there is none.

        A file without a readable owner (being written this instant, or left by something else)
        yields an empty owner: it is judged by its heartbeat age alone.
        """
        try:
            mtime = self.path.stat().st_mtime
            text = self.path.read_text()
        except FileNotFoundError:
            return None, None
        try:
            owner = json.loads(text)
        except ValueError:
            owner = None
        return (owner if isinstance(owner, dict) else {}), mtime

    def _stale_reason(self, owner: dict[str, Any], mtime: float) -> str | None:
        silent = time.time() - mtime
        if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int) \
                and not _alive(owner["pid"]):
            return f"its owner pid {owner['pid']} on this host is gone"
        if silent > self.stale_s:
            return f"no heartbeat for {silent:.0f} s (> {self.stale_s:.0f} s)"
        return None

    def _break(self, owner: dict[str, Any], reason: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # someone else broke or released it
        try:
            taken = json.loads(aside.read_text() or "null") or {}
        except (OSError, ValueError):
            taken = {}
        taken = taken if isinstance(taken, dict) else {}
        if taken.get("token") != owner.get("token"):  # a fresh lock was taken meanwhile: put it back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            return
        aside.unlink(missing_ok=True)
        log.warning("broke the stale lock %s held by %s (pid %s, since %s): %s", self.path, owner.get("host"),
                    owner.get("pid"), time.strftime("%H:%M:%S", time.localtime(owner.get("started", 0))), reason)

    def acquire(self) -> None:
        key = str(self.path.resolve())
        with _held_guard:
            held = _held.get(key)
        if held is not None and held is not self and held.owner["pid"] == os.getpid():
            held._depth += 1  # re-entrant within the process
            self._delegate = held
            return
        self._delegate = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        announced = False
        while not self._try_create():
            owner, mtime = self._read_owner()
            if owner is not None and mtime is not None:
                reason = self._stale_reason(owner, mtime)
                if reason:
                    self._break(owner, reason)
                    continue
                if not announced and self.timeout_s != 0:  # timeout 0 is one look, not a wait
                    log.info("waiting for %s (held by %s pid %s)", self.path, owner.get("host"), owner.get("pid"))
                    announced = True
            if self.timeout_s is not None and time.monotonic() - start > self.timeout_s:
                raise LockTimeout(
                    f"waited {self.timeout_s:.0f} s for the lock {self.path}, held by {(owner or {}).get('host')} pid "
                    f"{(owner or {}).get('pid')} with a live heartbeat; another job is computing this entry. Wait for "
                    "it, or if that job is gone for good, delete the lock file")
            time.sleep(POLL_S)
        self._depth = 1
        progress()  # the stall clock starts when the lock is taken
        with _held_guard:
            _held[key] = self
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name=f"lock-heartbeat {self.path.name}", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            silent = time.monotonic() - _progress[0]
            if self.stall_s is not None and silent > self.stall_s:
                log.warning("no progress for %.0f s while holding %s (stall_s=%.0f); its heartbeat stops so that "
                            "another job can take it over", silent, self.path, self.stall_s)
                return
            try:
                os.utime(self.path)
            except FileNotFoundError:
                log.warning("the lock %s vanished while held (broken as stale by another job?)", self.path)
                return

    def release(self) -> None:
        if self._delegate is not None:
            self._delegate._depth -= 1
            return
        self._depth -= 1
        if self._depth > 0:
            return
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        with _held_guard:
            _held.pop(str(self.path.resolve()), None)
        owner, _ = self._read_owner()
        if owner and owner.get("token") == self.owner["token"]:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "OwnedLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
