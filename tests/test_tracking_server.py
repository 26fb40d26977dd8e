"""A real MLflow tracking server (SQLite backend store, proxied artifact store on loopback):
a sweep logs to it and everything is read back through the client; an unreachable server
never costs a finished job, and ``python -m harness.sync`` logs its results later, once.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import mlflow
import pandas as pd
import pytest

from harness.results import mlflow_views
from harness.results.tracking import SWEEP_TAG
from tests.test_sweeps import TINY, harness_command, job_env, paths, run_harness, summaries

pytestmark = pytest.mark.slow


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(root: Path, port: int, timeout: float = 180, template: Path | None = None) -> Iterator[str]:
    """``mlflow server`` with a database backend store and a served artifact store; yields its URI.

    ``template``: an empty migrated store to start from (conftest's ``mlflow_template``), so the
    server does not run MLflow's migrations first (12 s to healthy from nothing, 7 s from it).
    """
    root.mkdir(parents=True, exist_ok=True)
    if template is not None:
        shutil.copyfile(template, root / "db.sqlite")
    command = [str(Path(sys.executable).with_name("mlflow")), "server",
               "--backend-store-uri", f"sqlite:///{root / 'db.sqlite'}",
               "--serve-artifacts", "--artifacts-destination", str(root / "artifacts"),
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    log = (root / "server.log").open("w")
    # MLflow 3's server also starts a job runner and seven huey consumers (~3 s of CPU each, ~24 s a server,
    # competing with the test) for server-side jobs the harness never submits
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=job_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"))
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited {proc.returncode}:\n{(root / 'server.log').read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                log_text = (root / "server.log").read_text()[-3000:]
                pytest.fail(f"mlflow server not healthy after {timeout} s:\n{log_text}")
            time.sleep(0.5)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the server and its workers: the group it leads
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_sweep_logs_runs_metrics_and_artifacts_to_a_tracking_server(tmp_path, cache_dir, mlflow_template):
    with mlflow_server(tmp_path / "server", free_port(), template=mlflow_template) as uri:
        sweep_dir = tmp_path / "multirun"
        run_harness("-m", *TINY, *paths(tmp_path, cache_dir, mlflow_uri=uri), "quant=int8,int4_g128",
                    f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
        client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name("quant-harness")
        runs = {r.data.tags["scheme"]: r for r in client.search_runs([experiment.experiment_id])}
        found = summaries(tmp_path / "results")
        assert set(runs) == set(found) == {"int8", "int4_g128"}
        for scheme, run in runs.items():
            summary = found[scheme]
            assert run.info.status == "FINISHED"
            assert run.data.tags[SWEEP_TAG] == str(sweep_dir)
            assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # uploaded through the server
            for name, value in summary["metrics"].items():  # the detail set, exact, under detail/
                if name.rpartition("/")[2] in mlflow_views.DETAIL_STATS:
                    assert run.data.metrics[f"detail/{name}"] == pytest.approx(value, rel=1e-12, abs=0), name
            for name in ("overall", *summary["slices"]):  # the headline, in points and rounded
                assert run.data.metrics[f"acc_delta_pt/{name}"] == round(100 * summary["metrics"][f"{name}/acc_delta"], 1)
                assert run.data.metrics[f"flips_right_to_wrong/{name}"] == \
                    summary["metrics"][f"{name}/flips_right_to_wrong"]
            assert run.info.run_name == f"{scheme} · tiny_random · {run.data.tags['verdict'].upper()} 1/1"
            assert run.data.params["quant.name"] == scheme
            listed = {a.path for a in client.list_artifacts(run.info.run_id)}
            assert {"items.parquet", "summary.json", "config.yaml", "report.md", "items.json", "flips.json"} <= listed
            assert "checkpoint" not in listed
            local = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="items.parquet",
                                                        dst_path=str(tmp_path / "download" / scheme), tracking_uri=uri)
            [results_dir] = [p for p in (tmp_path / "results").glob("*/") if f"__{scheme}__" in p.name]
            pd.testing.assert_frame_equal(pd.read_parquet(local), pd.read_parquet(results_dir / "items.parquet"))
            prompts = pd.read_parquet(local)["prompt"]  # the prompt as the model saw it, for per-item review
            assert prompts.str.len().gt(0).all()
        # The artifact store is the server's --artifacts-destination, not the job's disk.
        assert len(list((tmp_path / "server" / "artifacts").rglob("items.parquet"))) == 2


def test_unreachable_server_keeps_results_and_sync_logs_them_once(tmp_path, cache_dir, mlflow_template):
    port = free_port()  # nothing listens here until the server "comes back" below
    uri = f"http://127.0.0.1:{port}"
    proc = run_harness(*TINY, "quant=int8", *paths(tmp_path, cache_dir, mlflow_uri=uri), cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert "TRACKING UNAVAILABLE" in output and "python -m harness.sync" in output
    [results_dir] = (tmp_path / "results").glob("*/")
    summary = json.loads((results_dir / "summary.json").read_text())
    assert (results_dir / "items.parquet").exists()

    # Still down: sync says so and fails, logging nothing.
    down = subprocess.run(harness_command(str(tmp_path / "results"), module="harness.sync"), cwd=tmp_path,
                          env=job_env(), capture_output=True, text=True, timeout=300)
    assert down.returncode == 2 and "unreachable" in down.stderr

    # Back up on the same address: sync (with the URI saved in config.json) logs the run, once.
    with mlflow_server(tmp_path / "server", port, template=mlflow_template) as live:
        assert live == uri
        for _ in range(2):
            run_harness(str(tmp_path / "results"), module="harness.sync", cwd=tmp_path)
        client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        runs = client.search_runs([client.get_experiment_by_name("quant-harness").experiment_id])
        assert len(runs) == 1
        assert runs[0].info.status == "FINISHED"
        assert runs[0].data.metrics["detail/math/acc_delta"] == pytest.approx(summary["metrics"]["math/acc_delta"],
                                                                               rel=1e-12)
        assert runs[0].data.metrics["kl_mean/math"] == round(summary["metrics"]["math/kl_mean"], 4)
        assert runs[0].data.tags["harness.run_key"] == summary["run_key"]
