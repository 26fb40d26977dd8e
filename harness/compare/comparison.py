"""A whole comparison in one call: select the runs (MLflow or results directories), analyse
them together, write the report and optionally log it to MLflow (:func:`compare_runs`, the
public API; the command line calls :func:`execute`)."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Sequence

from harness.compare.analysis import ComparisonReport, analyse
from harness.compare.options import CompareOptions
from harness.compare.output import default_out_dir, log_comparison, write_report
from harness.compare.parity_table import ParityInputs, parity_table
from harness.compare.sources import load_mlflow_run, load_results_dir, select_runs
from harness.results.tracking import resolve_uri

log = logging.getLogger(__name__)

__all__ = ["compare_runs", "execute"]


def compare_runs(experiment: str = "quant-harness", *, tracking_uri: str | None = None,
                 tags: dict[str, str] | None = None, sweep: str | None = None, runs: Sequence[str] = (),
                 dirs: Sequence[str | Path] = (), write: bool = True, log_to_mlflow: bool = False,
                 **settings: Any) -> ComparisonReport:
    """Select runs (MLflow or results dirs), analyse them together and optionally write/log the report.

    ``settings`` are further ``CompareOptions`` fields (margin, correction, n_resamples, seed,
    ci_level, alpha, position_buckets, name, out). With ``write`` the outputs go to
    ``options.out`` (default ``results/compare/<name>``); ``log_to_mlflow`` also logs them as a
    comparison run in ``experiment``. The comparison is returned either way.
    """
    unknown = set(settings) - {f.name for f in dataclasses.fields(CompareOptions)}
    if unknown:
        raise TypeError(f"unknown compare settings {sorted(unknown)}; valid: "
                        f"{[f.name for f in dataclasses.fields(CompareOptions)]}")
    options = CompareOptions(experiment=experiment, tags=dict(tags or {}), sweep=sweep, runs=list(runs),
                             dirs=[str(d) for d in dirs], tracking_uri=tracking_uri, log=log_to_mlflow, **settings)
    return execute(options, write=write)


def execute(options: CompareOptions, *, write: bool) -> ComparisonReport:
    """Load the runs ``options`` select, analyse them and (with ``write``) write and log the report."""
    options.check()
    uri = resolve_uri(options.tracking_uri)
    options.tracking_uri = uri
    if options.dirs:
        loaded = [load_results_dir(d) for d in options.dirs]
    else:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        selected = select_runs(client, options.experiment, tags=options.tags, sweep=options.sweep,
                               run_ids=options.runs)
        loaded = [load_mlflow_run(client, r.info.run_id) for r in selected]
    report = analyse(loaded, options)
    if options.parity:
        if not 2 <= len(loaded) <= 4:
            raise ValueError(f"parity=true compares 2 to 4 runs (simulation, served, engine floor, the scheme's own "
                             f"floor), not {len(loaded)}: give them in that order with dirs=[...] or runs=[...]")
        report.parity = parity_table(ParityInputs(*loaded), ci_level=options.ci_level)
    if write:
        out = default_out_dir(report)
        write_report(report, out)
        log.info("comparison of %d runs written to %s", len(loaded), out)
        if options.log and not options.dirs:
            run_id = log_comparison(report, out, uri=uri, experiment=options.experiment)
            log.info("logged as MLflow comparison run %s (experiment %s)", run_id, options.experiment)
    return report
