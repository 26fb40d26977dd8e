"""Content-addressed on-disk cache with atomic writes and cross-process locks.

Keys are hashes of JSON-serialisable descriptions of what was computed (model identity,
item set, settings), so two jobs that would compute the same thing share one entry, and
a change in any input gives a new entry instead of a stale hit. Writers hold an owned lock
file (harness.infra.locks: owner, heartbeat, stale-lock breaking; safe across the nodes of a shared
filesystem, where flock may not be) so concurrent jobs of a sweep never corrupt an entry; readers only see complete entries
because every write goes to a temporary path first and is renamed into place.

Every entry verifies itself on use: its ``COMPLETE`` marker is a manifest (size and SHA-256 of
each file), written when the entry is, and :meth:`Cache.usable` checks the files against it. A
damaged entry (a truncated copy, a disk error, a quota hit mid-``rsync`` of a shared cache) is
moved aside to ``<entry>.corrupt-<time>`` with a one-line warning and reported as missing, so the
caller recomputes it; this happens under the entry's lock, so two jobs never both recompute it
or move each other's fresh entry aside. Entries written before manifests existed (``COMPLETE``
holding ``ok``) are checked once by reading every file with its format's reader, then given a
manifest.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

from harness.errors import UsageError
from harness.infra.locks import OwnedLock, holds

log = logging.getLogger(__name__)

# How long a job waits for another job's lock (whose heartbeat is alive) before giving up with an error.
LOCK_TIMEOUT_S = float(os.environ.get("HARNESS_LOCK_TIMEOUT_S", 12 * 3600))


class CacheDirError(PermissionError, UsageError):
    """The cache directory cannot hold the harness's entries or locks; the message names the fix."""


def check_cache_dir(root: str | os.PathLike) -> None:
    """Fail in one line, before any work, when ``root`` is not writable or lacks what the locks need.

    The locks (harness.infra.locks) need an exclusive create (``O_CREAT | O_EXCL``) that fails on an
    existing file, hard links (a broken lock taken meanwhile is put back with one) and renames;
    entries need renames and writes. All are tried on a probe file.
    """
    root = Path(root).expanduser()
    fix = f"set paths.cache_dir to a writable directory on a local disk or a shared file system with these (now {root})"
    probe = root / f".probe-{os.getpid()}-{time.monotonic_ns()}"
    linked, moved = probe.with_name(probe.name + ".link"), probe.with_name(probe.name + ".moved")
    step = "create the cache directory"
    try:
        root.mkdir(parents=True, exist_ok=True)
        step = "create a file in it"
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        step = "see an exclusive create fail on an existing file (the locks rely on it)"
        try:
            os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            pass
        else:
            raise CacheDirError(f"paths.cache_dir={root}: an exclusive create (O_EXCL) succeeded on an existing file, "
                                f"so two jobs could both hold a lock; {fix}")
        step = "hard-link a file (the locks put a lock back with one)"
        os.link(probe, linked)
        step = "rename a file"
        os.rename(linked, moved)
    except OSError as exc:
        if isinstance(exc, CacheDirError):
            raise
        raise CacheDirError(f"paths.cache_dir={root}: cannot {step} ({exc.strerror or exc}); {fix}") from None
    finally:
        for path in (probe, linked, moved):
            with contextlib.suppress(OSError):
                path.unlink()


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


MARKER = "COMPLETE"
MANIFEST_VERSION = 1


def _entry_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MARKER)


def manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """Size and SHA-256 of every file under ``directory`` (the marker aside), by relative path."""
    directory = Path(directory)
    files = _entry_files(directory)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1, max(1, len(files)))) as pool:
        digests = list(pool.map(file_sha256, files))  # hashlib releases the GIL: shards hash in parallel
    return {"version": MANIFEST_VERSION,
            "files": {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": d}
                      for p, d in zip(files, digests)}}


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest in an entry's ``COMPLETE`` marker; None for an entry written before manifests (``ok``)."""
    try:
        value = json.loads((Path(directory) / MARKER).read_text())
    except ValueError:
        return None
    return value if isinstance(value, dict) and isinstance(value.get("files"), dict) else None


def check_manifest(directory: str | os.PathLike, recorded: dict[str, Any],
                   only: Callable[[str], bool] | None = None) -> str | None:
    """What differs between an entry's files and its manifest (None: nothing). Sizes first (cheap), then digests.

    ``only``: check just the files whose relative path it accepts (a tokenizer beside big weights).
    """
    directory = Path(directory)
    wanted = {name: meta for name, meta in recorded["files"].items() if only is None or only(name)}
    for name, meta in wanted.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != meta["size"]:
            return f"{name} is {size} bytes, its manifest says {meta['size']}"
    names = sorted(wanted)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1, max(1, len(names)))) as pool:
        digests = list(pool.map(lambda n: file_sha256(directory / n), names))
    for name, digest in zip(names, digests):
        if digest != wanted[name]["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest"
    return None


def check_readable(path: Path) -> None:
    """Read a file with its format's reader (raises when it is damaged); formats without one pass."""
    suffix = path.suffix
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        pq.read_table(path)
    elif suffix == ".json":
        json.loads(path.read_text())
    elif suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                handle.get_tensor(name)
    elif suffix in (".pt", ".bin"):
        import torch
        torch.load(path, map_location="cpu", weights_only=False)


class Cache:
    """A directory of entries ``<root>/<namespace>/<key>/`` guarded by per-entry locks."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser()

    def entry(self, namespace: str, key: str) -> Path:
        return self.root / namespace / key

    def lock(self, namespace: str, key: str, timeout: float | None = None, stall_s: float | None = None) -> OwnedLock:
        """Lock for computing one entry: the first job computes, the others wait and reuse.

        An owned lock file with a heartbeat (harness.infra.locks): safe across nodes of a shared
        filesystem, broken with a warning when its holder died, and waited on at most
        ``timeout`` seconds (default ``$HARNESS_LOCK_TIMEOUT_S``, 12 h; negative: forever). With
        ``stall_s``, the lock stops beating once its holder reported no progress for that long.
        """
        lock_dir = self.root / namespace
        lock_dir.mkdir(parents=True, exist_ok=True)
        # ".lease", not ".lock": filelock (this cache's former lock) leaves empty <key>.lock files behind
        return OwnedLock(lock_dir / f"{key}.lease", timeout_s=LOCK_TIMEOUT_S if timeout is None else timeout,
                         stall_s=stall_s)

    def complete(self, namespace: str, key: str) -> bool:
        """The entry has its ``COMPLETE`` marker (a cheap look; :meth:`usable` also checks its content)."""
        return (self.entry(namespace, key) / MARKER).exists()

    def usable(self, namespace: str, key: str, only: Callable[[str], bool] | None = None) -> bool:
        """The entry is complete and its files match its manifest; a damaged one is moved aside (False).

        Call with the entry's lock held (:meth:`lock`): the check, the move and the recomputation
        that follows are then one job's, never two. ``only`` limits the check to some of the files
        (by relative path). An entry without a manifest (written by an older harness) is read file
        by file (:func:`check_readable`); if that works it gets a manifest now.
        """
        if not holds(self.root / namespace / f"{key}.lease"):
            raise RuntimeError(f"Cache.usable({namespace!r}, {key!r}) needs the entry's lock (Cache.lock) held")
        entry = self.entry(namespace, key)
        if not (entry / MARKER).exists():
            return False
        recorded = read_manifest(entry)
        if recorded is not None:
            problem = check_manifest(entry, recorded, only)
        else:
            problem = self._check_legacy(entry, only)
        if problem is None:
            return True
        aside = entry.with_name(f"{entry.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        if aside.exists():
            aside = aside.with_name(f"{aside.name}-{os.getpid()}")
        os.rename(entry, aside)
        log.warning("damaged cache entry %s (%s): moved to %s; recomputing it", entry, problem, aside)
        return False

    def _check_legacy(self, entry: Path, only: Callable[[str], bool] | None) -> str | None:
        """An entry written before manifests: read every file; on success add its manifest."""
        for path in _entry_files(entry):
            if only is not None and not only(str(path.relative_to(entry))):
                continue
            try:
                check_readable(path)
            except Exception as exc:  # noqa: BLE001 - every reader's own error means "damaged"
                return f"{path.relative_to(entry)} cannot be read: {type(exc).__name__}: {str(exc)[:120]}"
        if only is None:
            try:
                atomic_write_json(entry / MARKER, manifest(entry))
                log.info("cache entry %s had no manifest; its files read back, manifest added", entry)
            except OSError as exc:  # a read-only shared cache: checked again next time
                log.debug("could not add a manifest to %s: %s", entry, exc)
        return None

    @contextlib.contextmanager
    def writing(self, namespace: str, key: str) -> Iterator[Path]:
        """Write an entry atomically; the ``COMPLETE`` marker, holding the files' manifest, is added on success."""
        with atomic_directory(self.entry(namespace, key)) as tmp:
            yield tmp
            (tmp / MARKER).write_text(json.dumps(manifest(tmp), indent=1, sort_keys=True) + "\n")
