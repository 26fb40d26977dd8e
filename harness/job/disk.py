"""Disk space: what a job will write, checked against the free space before the expensive stages,
and the one line a job that still runs out of disk ends with (exit status :data:`EXIT_DISK_FULL`).
"""
from __future__ import annotations

import contextvars
import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.errors import UsageError

if TYPE_CHECKING:
    from harness.config import QuantConfig
    from harness.job.identity import ReferenceSpec

log = logging.getLogger("harness")

# Before the expensive stages, the job estimates what it will write and refuses when a file system has
# less free (one line, both numbers, the paths); a disk that fills up anyway ends the job with one line
# and EXIT_DISK_FULL, everything already stored kept (cache entries are written whole or not at all, and
# lm-eval's request checkpoint keeps every finished request), so the same command resumes once there is space.
EXIT_DISK_FULL = 75  # sysexits' EX_TEMPFAIL: a temporary failure, the same command may be run again
_FULL_TEXTS = ("no space left on device", "database or disk is full", "disk quota exceeded")
REQUEST_BYTES = 4096  # an lm-eval request cache row (key, pickled reply, SQLite page share), generous
ITEM_BYTES = 8192  # an item's row of items.parquet / records.parquet and its lm-eval sample log
TOKEN_ROW_BYTES = 96  # a row of tokens.parquet (per scored token)
CHOICES_PER_ITEM = 8  # log-likelihood requests of a multiple-choice item, at most (an upper bound)
ITEMS_PER_TASK = 400  # when a slice names no item count (its offline full sizes are <= 360 items)
MARGIN = 1.25
FIXED_BYTES = 4 * 1024 ** 2  # plots, reports, configs, SQLite journals
_estimate: contextvars.ContextVar[str | None] = contextvars.ContextVar("disk_estimate", default=None)


class DiskSpaceError(UsageError):
    """The job would write more than a file system has free; the message names both numbers and the paths."""


@dataclass(frozen=True)
class Write:
    """Bytes a job will write under one directory, and what they are."""

    path: Path
    bytes: int
    what: str


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (what statvfs can be asked about)."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike) -> int:
    stat = os.statvfs(_existing(Path(path)))
    return stat.f_bavail * stat.f_frsize


def gib(n: float) -> str:
    """Bytes for a message: 3.2 GB, 41 MB, 60 kB."""
    for unit, size in (("GB", 1024 ** 3), ("MB", 1024 ** 2), ("kB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def job_writes(spec: ReferenceSpec, scheme: QuantConfig, loaded: Any, slices: list[Any], cache: Any,
               results_dir: Path) -> list[Write]:
    """What a job writes, estimated from its reference settings, its scheme and its model (upper bounds; see the
    constants above).

    The results directory (records, token rows, the candidate's lm-eval request checkpoint), the
    reference cache entries still missing (records, the reference distribution in the configured
    store, its request checkpoint) and the frozen head, and the calibrated weights of a cacheable
    method. The model cache is written while loading, before this estimate: a full disk there
    ends the job in one line like any other.
    """
    from harness.job.divergence_texts import max_divergence_tokens
    from harness.job.identity import reference_key
    from harness.quant import get_method, target_linears

    model, model_key = loaded.model, loaded.key
    config = model.config
    hidden, vocab = int(getattr(config, "hidden_size", 0) or 0), int(getattr(config, "vocab_size", 0) or 0)
    store = spec.reference_store
    per_token = {"hidden": hidden * 4, "logprobs": vocab * 4}.get(store, spec.reference_topk * 12 + 8)
    results = reference = 0
    for slice_ in slices:
        items = len(slice_.config.tasks) * (slice_.config.n_items or slice_.config.limit or ITEMS_PER_TASK)
        requests = items * (1 + CHOICES_PER_ITEM)
        tokens = slice_.config.divergence_texts * max_divergence_tokens(slice_, spec)
        results += items * 2 * ITEM_BYTES + requests * REQUEST_BYTES + tokens * TOKEN_ROW_BYTES
        if not cache.complete("reference", reference_key(loaded, slice_, spec)):
            reference += items * ITEM_BYTES + requests * REQUEST_BYTES + tokens * per_token
    if store == "hidden" and reference and not cache.complete("heads", model_key):
        reference += vocab * hidden * 4
    calibrated = 0
    if get_method(scheme.method).cacheable:  # whether its entry exists needs the calibration set: counted
        linears = target_linears(model, scheme)[0].values()
        calibrated = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    writes = [Write(results_dir, int(MARGIN * results) + FIXED_BYTES, "results")]
    if reference:
        writes.append(Write(cache.root / "reference", int(MARGIN * reference), "reference cache"))
    if calibrated:
        writes.append(Write(cache.root / "calibrated", int(MARGIN * calibrated), "calibrated-weight cache"))
    return writes


def check_disk_space(writes: list[Write]) -> None:
    """Refuse, in one line, a job whose writes exceed the free space of a file system they land on."""
    by_device: dict[int, list[Write]] = {}
    for write in writes:
        by_device.setdefault(os.stat(_existing(write.path)).st_dev, []).append(write)
    notes = []
    for group in by_device.values():
        need, free = sum(w.bytes for w in group), free_bytes(group[0].path)
        where = ", ".join(f"{w.what} {gib(w.bytes)} in {w.path}" for w in group)
        notes.append(f"{gib(need)} ({where}), {gib(free)} free")
        if need > free:
            settings = " / ".join(dict.fromkeys("paths.results_dir" if w.what == "results" else "paths.cache_dir"
                                                for w in group))
            raise DiskSpaceError(f"not enough disk space: this job writes about {gib(need)} ({where}) and that file "
                                 f"system has {gib(free)} free; free some space or set {settings}=<a larger disk>")
    _estimate.set("; ".join(notes))
    log.info("disk: this job writes about %s", "; ".join(notes))


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a full disk or quota: ENOSPC, EDQUOT, SQLite's "disk is full"."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(exc).lower() for text in _FULL_TEXTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_message(exc: BaseException, paths: dict[str, str]) -> str:
    """The one line a job that ran out of disk ends with: where, how much, what is kept, how to resume.

    ``paths``: the job's directories by setting (``paths.results_dir``, ``paths.cache_dir``). The path
    that failed is the exception's file name where it has one, else the directory whose file system has
    the least free space now.
    """
    failed = getattr(exc, "filename", None)
    free = {name: free_bytes(path) for name, path in paths.items()}
    fullest = min(free, key=free.get)
    where = f"{failed} ({gib(free_bytes(failed))} free there)" if failed else \
        f"{paths[fullest]} ({fullest}; {gib(free[fullest])} free there)"
    estimate = _estimate.get()
    needed = f"; this job was estimated to write {estimate}" if estimate else ""
    return (f"disk full while writing {where}: {str(exc).splitlines()[0][:120]}{needed}. Everything already "
            "stored is kept (cache entries, lm-eval's request checkpoint in the results directory): free space or "
            f"set {fullest}=<a larger disk> and run the same command again to resume (exit {EXIT_DISK_FULL})")
