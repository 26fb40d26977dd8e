"""On a CPU, the reference runs in a second process while this one quantizes and evaluates.

A job's two halves — the unquantized model's reference and the quantized model's evaluation —
are independent until the divergence stage. On a GPU they run one after the other (one model
fills the device). On a CPU with several threads, splitting the threads between two processes
beats giving them all to one: a decode step of a small model is a chain of small matmuls that
two threads barely speed up (SmolLM2, batch 8: 103 → 123 tokens/s from 1 to 2 threads), while
two processes with one thread each run at nearly twice one.

The split reuses the sweep machinery of :mod:`harness.reference_stage`: the child process takes
the reference locks of the slices whose reference is missing, says which it holds, and computes
them; this process finds those locks held by a live owner, evaluates meanwhile, and
``deferred_references`` waits for the entries (and computes any the child failed to finish).
``runtime.reference_process``: ``auto`` (CPU device, >= 2 threads, the model's weights small
enough to hold twice, and at least one reference missing), ``true`` or ``false``.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue as queue_module
from dataclasses import dataclass
from typing import Any

from harness import models
from harness.cache import Cache
from harness.config import RunConfig
from harness.identity import reference_key
from harness.locks import LockTimeout
from harness.slices import Slice, resolve

log = logging.getLogger("harness")

READY_TIMEOUT_S = 600.0  # the child's model load; past it this process computes the references itself
MAX_SHARE_OF_MEMORY = 0.25  # auto: a second copy of the weights at most this share of physical memory


@dataclass
class Background:
    process: Any
    slices: list[str]  # the references the child holds the locks of
    threads: tuple[int, int]  # (this process, the child)

    def join(self) -> None:
        self.process.join(timeout=60)
        if self.process.is_alive():
            log.warning("reference process %s still running after its references were read; stopping it",
                        self.process.pid)
            self.process.terminate()
            self.process.join()


def _weight_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def wanted(cfg: RunConfig, loaded: models.LoadedModel, threads: int, missing: int) -> tuple[bool, str]:
    """(split into two processes?, why) for this job; see the module docstring."""
    setting = str(cfg.runtime.reference_process).lower()
    if setting in ("false", "off", "0"):
        return False, "runtime.reference_process=false"
    if not missing:
        return False, "every reference is cached"
    if threads < 2:
        return False, "one thread"
    if setting in ("true", "on", "1"):
        return True, "runtime.reference_process=true"
    if cfg.model.device != "cpu" or cfg.eval.backend != "hf":
        return False, "not a CPU job"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if _weight_bytes(loaded.model) > MAX_SHARE_OF_MEMORY * memory:
        return False, "the weights are too large to hold twice"
    return True, f"{threads} threads on a CPU"


def start(cfg: RunConfig, loaded: models.LoadedModel, slices: list[Slice], cache: Cache,
          threads: int) -> Background | None:
    """Start the child for the slices whose reference is missing; None when the job should not split.

    On return this process runs with its share of the threads (restore with :func:`finish`).
    """
    missing = [s.name for s in slices if not cache.complete("reference", reference_key(loaded, s, cfg))]
    split, why = wanted(cfg, loaded, threads, len(missing))
    if not split:
        log.debug("reference in this process: %s", why)
        return None
    import torch

    child_threads = threads // 2
    context = mp.get_context("spawn")  # a fresh interpreter: no forked torch thread pools or locks
    ready = context.Queue()
    process = context.Process(target=_child, args=(cfg, missing, child_threads, ready), daemon=True,
                              name="harness-reference")
    process.start()
    try:
        held = ready.get(timeout=READY_TIMEOUT_S)
    except queue_module.Empty:
        log.warning("reference process did not start within %.0f s; computing the references here", READY_TIMEOUT_S)
        process.terminate()
        return None
    if isinstance(held, BaseException) or not held:
        log.warning("reference process could not start (%s); computing the references here", held)
        process.join()
        return None
    torch.set_num_threads(threads - child_threads)
    log.info("reference of %s in a second process (pid %d, %d thread(s)); this one evaluates with %d (%s)",
             ", ".join(held), process.pid, child_threads, threads - child_threads, why)
    return Background(process, held, (threads - child_threads, child_threads))


def finish(background: Background | None, threads: int) -> None:
    """Wait for the child (its references have been read) and take all threads back."""
    if background is None:
        return
    import torch

    background.join()
    torch.set_num_threads(threads)


def _child(cfg: RunConfig, slice_names: list[str], threads: int, ready: Any) -> None:
    """The second process: take the references' locks, say which, compute them."""
    import torch

    from harness.reference_stage import compute_reference

    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][reference process][%(levelname)s] - %(message)s")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    locks = []
    try:
        cache = Cache(cfg.paths.cache_dir)
        loaded = models.load(cfg.model, cfg.paths.cache_dir)
        slices = [s for s in resolve(cfg.slices) if s.name in slice_names]
        mine = []
        for slice_ in slices:
            lock = cache.lock("reference", reference_key(loaded, slice_, cfg), timeout=0)
            try:
                lock.acquire()
            except LockTimeout:
                continue  # another job is computing it; the parent waits for that job instead
            locks.append(lock)
            mine.append(slice_)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which computes the references
        for lock in locks:
            lock.release()
        ready.put(RuntimeError(f"{type(exc).__name__}: {exc}"))
        return
    ready.put([s.name for s in mine])
    for slice_, lock in zip(mine, locks):
        try:
            compute_reference(loaded, slice_, cfg, cache)
        except BaseException:  # noqa: BLE001 - the parent finds the entry missing and computes it
            log.exception("reference for slice %s failed in the reference process; the job computes it", slice_.name)
        finally:
            lock.release()
