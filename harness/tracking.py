"""MLflow logging, fed from a finished results directory (the source of truth).

A run is logged only once its results are complete on disk, so a job killed mid-way
never leaves a half-logged MLflow run, and a job whose tracking server was down is
logged later by ``python -m harness.sync`` with the very same function. Logging is
idempotent: a finished MLflow run tagged with the same run key is reused, never duplicated.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Mapping

log = logging.getLogger(__name__)

RUN_KEY_TAG = "harness.run_key"
SWEEP_TAG = "harness.sweep_id"


class TrackingError(RuntimeError):
    """The tracking server cannot be used; results stay on disk for a later sync."""


def resolve_uri(uri: str | None) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else an SQLite file in the working directory."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def check_tracking(uri: str, timeout: float = 5.0) -> str | None:
    """None when the store looks usable, else a message naming the problem and the fix."""
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as response:
                if response.status == 200:
                    return None
                return f"MLflow server {uri} answered HTTP {response.status} on /health"
        except (urllib.error.URLError, OSError) as exc:
            return (f"MLflow tracking server {uri} is unreachable ({exc}). Results stay in results/; "
                    f"log them later with `python -m harness.sync <results dir>` once the server is up")
    if uri.startswith("sqlite:///"):
        directory = Path(uri[len("sqlite:///"):]).expanduser().resolve().parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass
        if not os.access(directory, os.W_OK):
            return f"cannot write the MLflow database in {directory}; set tracking.uri or MLFLOW_TRACKING_URI"
    return None


def _flatten(prefix: str, obj: Any, out: dict[str, str]) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), value, out)
    else:
        out[prefix] = json.dumps(obj) if isinstance(obj, (list, tuple)) else str(obj)


def flatten_config(config: dict) -> dict[str, str]:
    out: dict[str, str] = {}
    _flatten("", config, out)
    return {k[:250]: v[:6000] for k, v in out.items()}


def find_finished_run(client: Any, experiment_id: str, run_key: str, sweep_id: str | None = None) -> str | None:
    """A finished run of this config; with ``sweep_id``, only one logged for that sweep."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'",
                              max_results=100)
    for run in runs:
        if run.info.status == "FINISHED" and (sweep_id is None or run.data.tags.get(SWEEP_TAG) == sweep_id):
            return run.info.run_id
    return None


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """One writer at a time on an SQLite store shared by a sweep's parallel jobs.

    MLflow creates an SQLite store's tables on first use, and two jobs doing it at once
    fail (an alembic migration race); a tracking server serialises this itself.
    """
    if not uri.startswith("sqlite:///"):
        yield
        return
    from filelock import FileLock

    path = Path(uri[len("sqlite:///"):]).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        yield


def log_results(result_dir: str | os.PathLike, *, uri: str, experiment: str,
                tags: Mapping[str, str] | None = None) -> str:
    """Log one results directory to MLflow (see :func:`_log_results`); returns the run id."""
    with store_lock(uri):
        return _log_results(result_dir, uri=uri, experiment=experiment, tags=tags)


def _log_results(result_dir: str | os.PathLike, *, uri: str, experiment: str,
                 tags: Mapping[str, str] | None = None) -> str:
    """Log one results directory to MLflow; returns the run id (existing or new).

    ``tags`` override the tags saved with the results: a later sweep that reuses a finished
    config passes its own ``harness.sweep_id`` and gets a run in its sweep (results logged
    from the same directory, not recomputed). Within one sweep, a config is logged once.
    """
    import mlflow
    from mlflow.tracking import MlflowClient

    result_dir = Path(result_dir)
    summary = json.loads((result_dir / "summary.json").read_text())
    config = json.loads((result_dir / "config.json").read_text())
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    experiment_id = exp.experiment_id if exp else client.create_experiment(experiment)
    tags = {RUN_KEY_TAG: summary["run_key"], "model": summary["model"], "scheme": summary["scheme"],
            "slices": ",".join(summary["slices"]), "method": summary.get("method", ""),
            **{k: str(v) for k, v in summary.get("tags", {}).items()},
            **{k: str(v) for k, v in (tags or {}).items()}}
    existing = find_finished_run(client, experiment_id, summary["run_key"], tags.get(SWEEP_TAG))
    if existing:
        log.info("MLflow already has finished run %s for this config; not logging twice", existing)
        return existing
    with mlflow.start_run(experiment_id=experiment_id, run_name=summary["run_name"], tags=tags) as run:
        params = flatten_config(config)
        items = list(params.items())
        for start in range(0, len(items), 100):
            mlflow.log_params(dict(items[start:start + 100]))
        metrics = {k: float(v) for k, v in summary["metrics"].items()}
        metrics.update({f"time/{k}": float(v) for k, v in summary.get("timings", {}).items()})
        metrics.update({f"quant/{k}": float(v) for k, v in summary.get("quant", {}).items()
                        if isinstance(v, (int, float)) and abs(float(v)) != float("inf")})
        mlflow.log_metrics(metrics)
        mlflow.log_artifacts(str(result_dir))
        return run.info.run_id
