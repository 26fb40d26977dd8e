"""``python -m harness.sync <results dir or results root> ... [uri=URI] [experiment=NAME]``

Logs finished results to MLflow after the fact: a job whose tracking server was unreachable
finishes anyway, keeps everything in ``results/<run>/`` and prints this command. Each finished
results directory (one holding ``summary.json``) is logged by the very function the job uses
(:func:`harness.results.tracking.log_results`), so syncing is idempotent: a config already logged (for
the same sweep) is found by its ``harness.run_key`` tag and not logged twice. Directories of
jobs that never finished (no ``summary.json``) are listed and skipped.

By default each directory goes to the tracking URI and experiment saved in its own
``config.json`` (the ones the job meant to use); ``uri=``/``experiment=`` override them, e.g.
when the server moved. The command line follows :mod:`harness.cli`.
"""
from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from harness import cli
from harness.errors import UsageError
from harness.results import tracking

log = logging.getLogger("harness.sync")


@dataclass(frozen=True)
class SyncTarget:
    uri: str
    experiment: str


def find_result_dirs(paths: Sequence[str | Path]) -> tuple[list[Path], list[Path]]:
    """(finished, unfinished) results directories in ``paths``: each a results dir or a root of them."""
    finished: list[Path] = []
    unfinished: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is not a directory; pass results/<run> or a results root such as results/")
        candidates = [path] if _is_result_dir(path) else sorted(p for p in path.iterdir() if _is_result_dir(p))
        if not candidates:
            raise FileNotFoundError(f"no results directories in {path} (a results directory holds summary.json "
                                    "or config.json); pass results/<run> or the results root")
        for candidate in candidates:
            (finished if (candidate / "summary.json").exists() else unfinished).append(candidate)
    return finished, unfinished


def _is_result_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in ("summary.json", "config.json", "checkpoint"))


def target_for(result_dir: Path, uri: str | None, experiment: str | None) -> SyncTarget:
    """Where a results directory is logged: the overrides, else its saved tracking config."""
    saved: dict = {}
    config_path = result_dir / "config.json"
    if config_path.exists():
        saved = json.loads(config_path.read_text()).get("tracking", {}) or {}
    return SyncTarget(uri=tracking.resolve_uri(uri or saved.get("uri")),
                      experiment=experiment or saved.get("experiment") or "quant-harness")


def sync(paths: Sequence[str | Path], *, uri: str | None = None, experiment: str | None = None) -> dict[Path, str]:
    """Log every finished results directory under ``paths``; returns {directory: MLflow run id}.

    Raises :class:`harness.results.tracking.TrackingError` (naming the URI) when a tracking store is
    unusable; directories already logged are left as they are.
    """
    finished, unfinished = find_result_dirs(paths)
    for directory in unfinished:
        log.warning("skipping %s: the job did not finish (no summary.json); run it again to complete it", directory)
    logged: dict[Path, str] = {}
    checked: dict[str, str | None] = {}
    for directory in finished:
        target = target_for(directory, uri, experiment)
        if target.uri not in checked:
            checked[target.uri] = tracking.check_tracking(target.uri)
        if checked[target.uri]:
            raise tracking.TrackingError(f"cannot sync {directory}: {checked[target.uri]}")
        logged[directory] = tracking.log_results(directory, uri=target.uri, experiment=target.experiment)
        log.info("%s → MLflow run %s (%s, experiment %s)", directory, logged[directory], target.uri,
                 target.experiment)
    return logged


@dataclass
class SyncOptions:
    paths: list[str] = field(default_factory=list,
                             metadata={"help": "results directories (results/<run>) or results roots (results/)"})
    uri: Optional[str] = field(default=None, metadata={"help": "MLflow tracking URI (None: each run's saved "
                                                               "tracking.uri, else $MLFLOW_TRACKING_URI, else "
                                                               "sqlite:///mlflow.db)"})
    experiment: Optional[str] = field(default=None, metadata={"help": "MLflow experiment (None: each run's saved "
                                                                      "tracking.experiment)"})


TOOL = cli.Tool(prog="python -m harness.sync", options=SyncOptions, positional="paths",
                summary=__doc__.split("\n\n")[1])


def _sync(parsed: cli.Parsed[SyncOptions]) -> None:
    options = parsed.options
    if not options.paths:
        raise UsageError("no results directory given; e.g. python -m harness.sync results/")
    logged = sync(options.paths, uri=options.uri, experiment=options.experiment)
    print(f"{len(logged)} finished result(s) in MLflow")


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(TOOL, _sync, argv)


if __name__ == "__main__":
    sys.exit(main())
