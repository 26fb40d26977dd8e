"""The Slurm launcher on a real one-node Slurm cluster (Debian's slurm-wlm + munge).

``scripts/slurm_local.sh start`` brings up munged, slurmctld and slurmd with all their state
in a temporary directory; a two-scheme sweep is submitted with ``hydra/launcher=slurm`` (the
same conf/hydra/launcher/slurm.yaml users submit with, its GPU request and sizes overridden
for this CPU node); both runs must reach MLflow; the daemons are stopped afterwards. Skipped
when Slurm is not installed, unless HARNESS_REQUIRE_SYSTEM_TESTS=1 (CI), which makes it fail.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from harness.results.tracking import SWEEP_TAG
from tests.test_sweeps import REPO, TINY, create_store, job_env, mlflow_runs, paths, run_harness, sqlite_uri, summaries

pytestmark = pytest.mark.slow
SCRIPT = REPO / "scripts" / "slurm_local.sh"


def _missing_requirement() -> str | None:
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sinfo", "sbatch") if shutil.which(b) is None]
    if missing:
        return f"Slurm/munge binaries missing ({', '.join(missing)}); scripts/system_deps.sh installs them"
    if os.geteuid() != 0:
        return "the one-node Slurm cluster needs root"
    return None


@pytest.fixture
def slurm_cluster(tmp_path_factory) -> Iterator[Path]:
    """A running one-node cluster; yields its slurm.conf. The daemons are stopped afterwards."""
    problem = _missing_requirement()
    if problem:
        if os.environ.get("HARNESS_REQUIRE_SYSTEM_TESTS") == "1":
            pytest.fail(f"HARNESS_REQUIRE_SYSTEM_TESTS=1 but {problem}")
        pytest.skip(problem)
    state = tmp_path_factory.mktemp("slurm")
    try:
        started = subprocess.run(["bash", str(SCRIPT), "start", str(state)], capture_output=True, text=True,
                                 timeout=180)
        if started.returncode != 0:
            pytest.fail(f"slurm_local.sh start failed:\n{started.stdout}\n{started.stderr}")
        yield state / "slurm.conf"
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(state)], capture_output=True, text=True, timeout=120)
    for daemon in ("slurmd", "slurmctld", "munged"):
        assert not (state / f"{daemon}.pid").exists(), f"{daemon} was not stopped"


def wait_for_empty_queue(env: dict[str, str], timeout: float = 120) -> None:
    """submitit returns once the jobs' results exist; Slurm records completion moments later."""
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, check=True).stdout.strip():
        if time.monotonic() > deadline:
            pytest.fail(f"Slurm jobs still queued after {timeout} s")
        time.sleep(0.5)


def test_two_scheme_sweep_through_slurm_lands_in_mlflow(tmp_path, cache_dir, slurm_cluster):
    env = job_env(SLURM_CONF=str(slurm_cluster))
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True, check=True)
    assert "idle" in nodes.stdout
    sweep_dir = tmp_path / "multirun"
    uri = sqlite_uri(tmp_path)
    create_store(uri)
    run_harness("-m", "hydra/launcher=slurm", "hydra.launcher.partition=debug", "hydra.launcher.gpus_per_node=null",
                "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=4", "hydra.launcher.timeout_min=30",
                *TINY, *paths(tmp_path, cache_dir, mlflow_uri=uri), "quant=int8,int4_g128",
                f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path, env=env)
    wait_for_empty_queue(env)
    # submitit names each job's folder after its Slurm job id: two array tasks of one array job.
    job_logs = sorted((sweep_dir / ".submitit").glob("*/*_log.out"))
    assert len(job_logs) == 2
    assert all(re.fullmatch(r"\d+_\d+", p.parent.name) for p in job_logs), job_logs
    completed = (slurm_cluster.parent / "log" / "slurmctld.log").read_text()
    assert len(re.findall(r"_job_complete: JobId=\d+_\d+\(\d+\) WEXITSTATUS 0", completed)) == 2
    found = summaries(tmp_path / "results")
    assert sorted(s["reference_cached"]["math"] for s in found.values()) == [False, True]
    runs = mlflow_runs(uri)
    assert sorted(r.data.tags["scheme"] for r in runs) == ["int4_g128", "int8"]
    assert all(r.info.status == "FINISHED" for r in runs)
    assert {r.data.tags[SWEEP_TAG] for r in runs} == {str(sweep_dir)}
