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

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import queue as queue_module
from dataclasses import dataclass
from typing import Any, Iterator

from harness import models, progress, resources
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
    done: Any  # the queue the child reports its tokens, seconds and memory on

    def join(self) -> dict[str, Any] | None:
        """Wait for the child; its report (None if it sent none)."""
        try:
            report = self.done.get(timeout=60)
        except queue_module.Empty:
            report = None
        self.process.join(timeout=60)
        if self.process.is_alive():
            log.warning("reference process %s still running after its references were read; stopping it",
                        self.process.pid)
            self.process.terminate()
            self.process.join()
        return report


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
    ready, done = context.Queue(), context.Queue()
    events = context.Queue() if progress.current().active else None  # its progress and log, for the display
    process = context.Process(target=_child, args=(cfg, missing, child_threads, ready, done, events), daemon=True,
                              name="harness-reference")
    process.start()
    if events is not None:
        progress.current().follow(events)
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
    return Background(process, held, (threads - child_threads, child_threads), done)


def collect(background: Background | None, meter: resources.StageMeter) -> dict[str, Any]:
    """Wait for the child (its references have been read); its tokens and seconds become the job's
    ``reference`` stage in ``meter`` (throughput in summary.json). Returns what summary.json's
    ``runtime`` records of it."""
    if background is None:
        return {"reference_process": []}
    report = background.join() or {}
    progress.current().drain()  # its last counts and log lines, before the job goes on
    if report.get("stage"):
        use = meter.stages.setdefault("reference", resources.StageUse())
        child = resources.StageUse(**report["stage"])
        use.seconds += child.seconds
        use.prefill_tokens += child.prefill_tokens
        use.generated_tokens += child.generated_tokens
    return {"reference_process": background.slices, "reference_process_threads": background.threads[1],
            "reference_process_rss_peak_gb": report.get("rss_peak_gb")}


@contextlib.contextmanager
def scoring_threads(background: Background | None, threads: int) -> Iterator[None]:
    """The child's thread count while the candidate is scored against what the child computed.

    CPU matmuls sum in an order that depends on the thread count, so the divergence stage uses
    the threads the reference was scored with: a null scheme then gives a KL of exactly 0, as in
    a job that computed its reference itself. All threads again afterwards.
    """
    import torch

    if background is not None:
        torch.set_num_threads(background.threads[1])
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _child(cfg: RunConfig, slice_names: list[str], threads: int, ready: Any, done: Any, events: Any = None) -> None:
    """The second process: take the references' locks, say which, compute them, report the cost.

    With ``events`` (the parent shows a progress display) its item counts and log records go there.
    """
    import time

    import torch

    from harness.reference_stage import compute_reference

    torch.set_num_threads(threads)
    if events is None:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][reference process][%(levelname)s] - %(message)s")
    else:
        from harness.joblog import child_logging
        child_logging(events, "reference process")
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
    meter = resources.StageMeter()
    meter.watch(loaded.model)
    if events is not None:  # this process's item counts and tokens, for the parent's display
        progress.install(progress.QueueReporter(events), "reference",
                         lambda: sum(u.prefill_tokens + u.generated_tokens for u in meter.stages.values()))
    meter.begin("reference")
    start = time.perf_counter()
    for slice_, lock in zip(mine, locks):
        try:
            compute_reference(loaded, slice_, cfg, cache)
        except BaseException:  # noqa: BLE001 - the parent finds the entry missing and computes it
            log.exception("reference for slice %s failed in the reference process; the job computes it", slice_.name)
        finally:
            lock.release()
    meter.end("reference", time.perf_counter() - start)
    done.put({"stage": dataclasses.asdict(meter.stages["reference"]), "rss_peak_gb": resources.host_rss_peak_gb()})
    if events is not None:
        progress.end_of_events(events)
