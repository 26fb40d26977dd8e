"""On a CPU, the reference runs in a second process while this one quantizes and evaluates.

A job's two halves — the unquantized model's reference and the quantized model's evaluation —
are independent until the divergence stage. On a GPU they run one after the other (one model
fills the device). On a CPU with several threads, splitting the threads between two processes
beats giving them all to one: a decode step of a small model is a chain of small matmuls that
two threads barely speed up (SmolLM2, batch 8: 103 → 123 tokens/s from 1 to 2 threads), while
two processes with one thread each run at nearly twice one.

The split reuses the sweep machinery of :mod:`harness.job.reference`: the child process takes
the reference locks of the slices whose reference is missing, says which it holds, and computes
them; this process finds those locks held by a live owner, evaluates meanwhile, and
``deferred_references`` waits for the entries (and computes any the child failed to finish).
``runtime.reference_process``: ``auto`` (CPU device, >= 2 threads, the model's weights small
enough to hold twice, and at least one reference missing), ``true`` or ``false``.

A watchdog thread of this process watches the child. A child that dies (the kernel's
out-of-memory killer, read from the cgroup's ``oom_kill`` counter, or any other end) is reported
in one line as what it was; a child whose progress file (touched as its model runs) is older
than ``runtime.reference_stall_s`` is reported as stalled and killed. Either way its locks'
owner is gone, so ``deferred_references`` breaks them and computes the references here, with
the child's thread count (the divergence stage scores with it too).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import queue as queue_module
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from harness.config import ModelConfig
from harness.evaluation.slices import Slice
from harness.infra import progress
from harness.infra.cache import Cache
from harness.infra.locks import LockTimeout
from harness.job import stage_meter
from harness.job.identity import ReferenceSpec, reference_key
from harness.models import loading as models

log = logging.getLogger("harness")

READY_TIMEOUT_S = 600.0  # the child's model load; past it this process computes the references itself
MAX_SHARE_OF_MEMORY = 0.25  # auto: a second copy of the weights at most this share of physical memory


@dataclass
class Background:
    process: Any
    slices: list[str]  # the references the child holds the locks of
    threads: tuple[int, int]  # (this process, the child)
    done: Any  # the queue the child reports its tokens, seconds and memory on
    progress: Path | None = None  # touched by the child as its model runs (the stall watchdog reads it)
    watchdog: Any = None
    _stop: threading.Event = field(default_factory=threading.Event)
    ended: str | None = None  # why the child ended early, as reported (None: it did not)

    def join(self) -> dict[str, Any] | None:
        """Wait for the child; its report (None if it sent none)."""
        self._stop.set()
        if self.watchdog is not None:
            self.watchdog.join()
        try:
            report = None if self.ended else self.done.get(timeout=60)
        except queue_module.Empty:
            report = None
        if self.progress is not None:
            self.progress.unlink(missing_ok=True)
        self.process.join(timeout=60)
        if self.process.is_alive():
            log.warning("reference process %s still running after its references were read; stopping it",
                        self.process.pid)
            self.process.terminate()
            self.process.join()
        return report


def oom_kills() -> int | None:
    """The kernel's out-of-memory kills in this process's memory cgroup so far (None where unreadable).

    cgroup v2 ``memory.events`` or v1 ``memory.oom_control``, both of which count ``oom_kill``.
    """
    base = Path("/sys/fs/cgroup")
    paths = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                paths.append(base / path.lstrip("/") / "memory.events")
            elif "memory" in controllers.split(","):
                paths.append(base / "memory" / path.lstrip("/") / "memory.oom_control")
    except (OSError, ValueError):
        pass
    paths += [base / "memory.events", base / "memory" / "memory.oom_control"]  # inside a cgroup namespace
    for path in paths:
        try:
            for line in path.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def why_ended(exitcode: int | None, kills_before: int | None, kills_after: int | None) -> str:
    """What ended the child, in words, from its exit code and the cgroup's OOM-kill counts around it."""
    if exitcode == -signal.SIGKILL:
        if kills_before is not None and kills_after is not None and kills_after > kills_before:
            return (f"killed by the kernel's out-of-memory killer (cgroup oom_kill {kills_before} -> {kills_after}); "
                    "two copies of the model did not fit: runtime.reference_process=false avoids the second")
        return "killed by SIGKILL (the kernel's out-of-memory killer, or a kill -9; dmesg says which)"
    if exitcode is not None and exitcode < 0:
        return f"killed by signal {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"


def _watch(background: Background, stall_s: float, kills_before: int | None) -> None:
    """The watchdog thread: report a child that ended early; report and kill one that stalled."""
    process, poll = background.process, min(1.0, stall_s / 4)
    while not background._stop.wait(poll):
        if not process.is_alive():
            process.join()
            if process.exitcode != 0:
                background.ended = why_ended(process.exitcode, kills_before, oom_kills())
                log.warning("reference process pid %d %s; this job computes the references of %s itself",
                            process.pid, background.ended, ", ".join(background.slices))
            return
        try:
            silent = time.time() - background.progress.stat().st_mtime
        except (OSError, AttributeError):
            continue
        if silent > stall_s:
            background.ended = f"made no progress for {silent:.0f} s (runtime.reference_stall_s={stall_s:g})"
            log.warning("reference process pid %d %s; stopping it, this job computes the references of %s itself",
                        process.pid, background.ended, ", ".join(background.slices))
            process.kill()
            process.join()
            return


def _weight_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def wanted(spec: ReferenceSpec, loaded: models.LoadedModel, threads: int, missing: int) -> tuple[bool, str]:
    """(split into two processes?, why) for this job; see the module docstring."""
    setting = spec.process.lower()
    if setting in ("false", "off", "0"):
        return False, "runtime.reference_process=false"
    if not missing:
        return False, "every reference is cached"
    if threads < 2:
        return False, "one thread"
    if setting in ("true", "on", "1"):
        return True, "runtime.reference_process=true"
    if spec.device != "cpu" or spec.backend != "hf":
        return False, "not a CPU job"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if _weight_bytes(loaded.model) > MAX_SHARE_OF_MEMORY * memory:
        return False, "the weights are too large to hold twice"
    return True, f"{threads} threads on a CPU"


def start(spec: ReferenceSpec, model: ModelConfig, loaded: models.LoadedModel, slices: list[Slice], cache: Cache,
          threads: int) -> Background | None:
    """Start the child for the slices whose reference is missing; None when the job should not split.

    The child loads ``model`` again (from ``cache``'s models) and computes those references with ``spec``.
    On return this process runs with its share of the threads (:func:`collect` gives them all back).
    """
    missing = [s for s in slices if not cache.complete("reference", reference_key(loaded, s, spec))]
    split, why = wanted(spec, loaded, threads, len(missing))
    if not split:
        log.debug("reference in this process: %s", why)
        return None
    import torch

    child_threads = threads // 2
    context = mp.get_context("spawn")  # a fresh interpreter: no forked torch thread pools or locks
    ready, done = context.Queue(), context.Queue()
    handle, heartbeat = tempfile.mkstemp(prefix="harness-reference-", suffix=".progress")
    os.close(handle)
    kills_before = oom_kills()
    events = context.Queue() if progress.current().active else None  # its progress and log, for the display
    process = context.Process(target=_child, args=(spec, model, str(cache.root), missing, child_threads, ready, done,
                                                   heartbeat, events),
                              daemon=True, name="harness-reference")
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
        os.unlink(heartbeat)
        return None
    torch.set_num_threads(threads - child_threads)
    log.info("reference of %s in a second process (pid %d, %d thread(s)); this one evaluates with %d (%s)",
             ", ".join(held), process.pid, child_threads, threads - child_threads, why)
    background = Background(process, held, (threads - child_threads, child_threads), done, Path(heartbeat))
    background.watchdog = threading.Thread(target=_watch, args=(background, spec.stall_s,
                                                                 kills_before), name="reference-watchdog", daemon=True)
    background.watchdog.start()
    return background


def collect(background: Background | None, meter: stage_meter.StageMeter) -> dict[str, Any]:
    """Wait for the child (its references have been read); its tokens and seconds become the job's
    ``reference`` stage in ``meter`` (throughput in summary.json), and its threads this process's again.
    Returns what summary.json's ``runtime`` records of it."""
    if background is None:
        return {"reference_process": []}
    report = background.join() or {}
    import torch

    torch.set_num_threads(sum(background.threads))  # the child has ended: the divergence stage gets every thread
    progress.current().drain()  # its last counts and log lines, before the job goes on
    if report.get("stage"):
        use = meter.stages.setdefault("reference", stage_meter.StageUse())
        child = stage_meter.StageUse(**report["stage"])
        use.seconds += child.seconds
        use.prefill_tokens += child.prefill_tokens
        use.generated_tokens += child.generated_tokens
    return {"reference_process": background.slices, "reference_process_threads": background.threads[1],
            "reference_process_rss_peak_gb": report.get("rss_peak_gb"), "reference_process_ended": background.ended}


def forward_threads(background: Background | None) -> int | None:
    """The torch threads of the candidate's forwards in the divergence stage: the child's, whose sums
    the reference's states carry (:func:`harness.divergence.scoring.compare_to_reference`); None: all."""
    return None if background is None else background.threads[1]


@contextlib.contextmanager
def scoring_threads(background: Background | None, threads: int) -> Iterator[None]:
    """The child's thread count while a reference is computed here after all (the child died or gave up).

    CPU matmuls sum in an order that depends on the thread count, so a reference computed here uses
    the threads the other references were computed with, and the divergence stage's forwards use them
    too (:func:`forward_threads`): a null scheme then gives a KL of exactly 0, as in a job that
    computed its reference itself. All threads again afterwards.
    """
    import torch

    if background is not None:
        torch.set_num_threads(background.threads[1])
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _touching(path: str, every_s: float = 1.0) -> Any:
    """A forward pre-hook that touches ``path`` (at most every ``every_s``): the child's progress heartbeat."""
    last = [0.0]

    def hook(module: Any, args: Any) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s:
            last[0] = now
            with contextlib.suppress(OSError):
                os.utime(path)

    return hook


def _child(spec: ReferenceSpec, model: ModelConfig, cache_dir: str, slices: list[Slice], threads: int, ready: Any,
           done: Any, heartbeat: str | None = None, events: Any = None) -> None:
    """The second process: take the references' locks, say which, compute them, report the cost.

    ``heartbeat``: a file it touches while it makes progress (the parent's watchdog reads it).
    With ``events`` (the parent shows a progress display) its item counts and log records go there.
    """
    import torch

    from harness.job.reference import compute_reference, reference_lock

    torch.set_num_threads(threads)
    if events is None:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][reference process][%(levelname)s] - %(message)s")
    else:
        from harness.infra.joblog import child_logging
        child_logging(events, "reference process")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    locks = []
    try:
        cache = Cache(cache_dir)
        loaded = models.load(model, cache_dir)
        mine = []
        for slice_ in slices:
            lock = reference_lock(cache, reference_key(loaded, slice_, spec), spec.stall_s, timeout=0)
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
    if heartbeat is not None:
        loaded.model.get_input_embeddings().register_forward_pre_hook(_touching(heartbeat))  # inner calls too
    meter = stage_meter.StageMeter()
    meter.watch(loaded.model)
    if events is not None:  # this process's item counts and tokens, for the parent's display
        progress.install(progress.QueueReporter(events), "reference",
                         lambda: sum(u.prefill_tokens + u.generated_tokens for u in meter.stages.values()))
    meter.begin("reference")
    start = time.perf_counter()
    for slice_, lock in zip(mine, locks):
        if heartbeat is not None:  # a slice starting is progress too (lm-eval builds its requests first)
            with contextlib.suppress(OSError):
                os.utime(heartbeat)
        try:
            compute_reference(loaded, slice_, spec, cache)
        except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the parent says what is kept
            return
        except BaseException:  # noqa: BLE001 - the parent finds the entry missing and computes it
            log.exception("reference for slice %s failed in the reference process; the job computes it", slice_.name)
        finally:
            lock.release()
    meter.end("reference", time.perf_counter() - start)
    done.put({"stage": dataclasses.asdict(meter.stages["reference"]), "rss_peak_gb": stage_meter.host_rss_peak_gb()})
    if events is not None:
        progress.end_of_events(events)
