"""Content-addressed on-disk cache with atomic writes and cross-process locks.

Keys are hashes of JSON-serialisable descriptions of what was computed (model identity,
item set, settings), so two jobs that would compute the same thing share one entry, and
a change in any input gives a new entry instead of a stale hit. Writers hold an owned lock
file (harness.locks: owner, heartbeat, stale-lock breaking; safe across the nodes of a shared
filesystem, where flock may not be) so concurrent jobs of a sweep never corrupt an entry; readers only see complete entries
because every write goes to a temporary path first and is renamed into place.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from harness.locks import OwnedLock

# How long a job waits for another job's lock (whose heartbeat is alive) before giving up with an error.
LOCK_TIMEOUT_S = float(os.environ.get("HARNESS_LOCK_TIMEOUT_S", 12 * 3600))


def stable_hash(obj: Any, length: int = 16) -> str:
    """Hash of a JSON-serialisable object, independent of dict key order."""
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a file so that readers see either the old content or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory that is renamed to ``path`` when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class Cache:
    """A directory of entries ``<root>/<namespace>/<key>/`` guarded by per-entry locks."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser()

    def entry(self, namespace: str, key: str) -> Path:
        return self.root / namespace / key

    def lock(self, namespace: str, key: str, timeout: float | None = None) -> OwnedLock:
        """Lock for computing one entry: the first job computes, the others wait and reuse.

        An owned lock file with a heartbeat (harness.locks): safe across nodes of a shared
        filesystem, broken with a warning when its holder died, and waited on at most
        ``timeout`` seconds (default ``$HARNESS_LOCK_TIMEOUT_S``, 12 h; negative: forever).
        """
        lock_dir = self.root / namespace
        lock_dir.mkdir(parents=True, exist_ok=True)
        # ".lease", not ".lock": filelock (this cache's former lock) leaves empty <key>.lock files behind
        return OwnedLock(lock_dir / f"{key}.lease", timeout_s=LOCK_TIMEOUT_S if timeout is None else timeout)

    def complete(self, namespace: str, key: str) -> bool:
        return (self.entry(namespace, key) / "COMPLETE").exists()

    @contextlib.contextmanager
    def writing(self, namespace: str, key: str) -> Iterator[Path]:
        """Write an entry atomically; a ``COMPLETE`` marker is added on success."""
        with atomic_directory(self.entry(namespace, key)) as tmp:
            yield tmp
            (tmp / "COMPLETE").write_text("ok\n")
