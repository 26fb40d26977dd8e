"""How many CPU threads torch uses: the CPUs this job was given, not the machine's core count.

torch's default (one thread per core) collapses when anything else runs on the machine: every
intra-op parallel region waits for its slowest thread, and a thread sharing a core with another
process is slow. Measured on a 2-core machine with one core kept busy, a matmul loop took 93.7 s
with 2 threads and 23.1 s with 1. So a job uses the CPUs it was *given* — its CPU affinity
(``taskset``, cgroups, Slurm's binding), capped by ``$SLURM_CPUS_PER_TASK`` — unless
``runtime.threads`` or ``$OMP_NUM_THREADS`` says otherwise. The choice is made once, at the
start of a job, and recorded in its summary.json.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Collection, Mapping

from harness.errors import UsageError

if TYPE_CHECKING:  # a type only: infra sits below the config
    from harness.config import RuntimeConfig


def _positive_int(text: str | None) -> int | None:
    """The leading integer of an environment value (``OMP_NUM_THREADS=4,2`` → 4), if positive."""
    try:
        value = int(str(text).split(",")[0].strip())
    except ValueError:
        return None
    return value if value > 0 else None


def choose_threads(requested: int | None, *, env: Mapping[str, str] | None = None,
                   affinity: Collection[int] | None = None) -> tuple[int, str]:
    """(threads, where the number came from) for a job; see the module docstring for the order.

    ``env`` and ``affinity`` default to this process's environment and ``os.sched_getaffinity(0)``
    (parameters so the choice can be tested without changing the process).
    """
    if requested is not None:
        if requested < 1:
            raise UsageError(f"runtime.threads={requested}: give a positive number of threads, or null for the "
                             "CPUs this job was given")
        return requested, "runtime.threads"
    env = os.environ if env is None else env
    omp = _positive_int(env.get("OMP_NUM_THREADS"))
    if omp is not None:
        return omp, "OMP_NUM_THREADS"
    if affinity is None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cpus = max(len(affinity), 1)
    slurm = _positive_int(env.get("SLURM_CPUS_PER_TASK"))
    if slurm is not None and slurm < cpus:
        return slurm, "SLURM_CPUS_PER_TASK"
    return cpus, "CPU affinity"


def apply_threads(runtime: RuntimeConfig) -> dict[str, int | str]:
    """Set torch's intra-op threads for this job; returns what summary.json records."""
    import torch

    threads, source = choose_threads(runtime.threads)
    torch.set_num_threads(threads)
    return {"threads": threads, "threads_from": source}
