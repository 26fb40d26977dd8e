"""A comparison's files and its MLflow run: :func:`write_report` writes Markdown, the HTML
page, PNG plots, the tables as parquet and the options; :func:`log_comparison` logs them as
artifacts of an MLflow run tagged ``harness.kind=comparison`` (never itself selected again)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from harness.compare.analysis import ComparisonReport
from harness.compare.render import html_page, markdown, plots
from harness.compare.sources import COMPARISON_KIND, KIND_TAG
from harness.results.tracking import SWEEP_TAG

__all__ = ["default_out_dir", "log_comparison", "write_report"]


def default_out_dir(report: ComparisonReport) -> Path:
    """``options.out``, else ``results/compare/<name>``."""
    return Path(report.options.out or Path("results") / "compare" / report.name)


def write_report(report: ComparisonReport, out_dir: str | Path | None = None) -> dict[str, Path]:
    """Markdown, self-contained HTML, PNG plots and parquet tables; returns name -> path."""
    out = Path(out_dir) if out_dir else default_out_dir(report)
    out.mkdir(parents=True, exist_ok=True)
    figures = plots.render_all(report, out)
    written: dict[str, Path] = dict(figures)
    for name, frame in (("runs", report.runs), ("item_stats", report.item_stats),
                        ("token_stats", report.token_stats), ("generation", report.generation)):
        path = out / f"{name}.parquet"
        frame.to_parquet(path, index=False)
        written[name] = path
    for name, frame in (("speed", report.speed), ("measured", report.measured), ("trace_stats", report.trace_stats),
                        ("budget", report.budget)):
        if not frame.empty:  # written only where the compared runs have them
            written[name] = out / f"{name}.parquet"
            frame.to_parquet(written[name], index=False)
    if not report.parity.empty:
        written["parity"] = out / "parity.parquet"
        report.parity.to_parquet(written["parity"], index=False)
    written["markdown"] = out / "comparison.md"
    written["markdown"].write_text(markdown.markdown(report, figures), encoding="utf-8")
    written["html"] = out / "comparison.html"
    written["html"].write_text(html_page.html(report, figures), encoding="utf-8")
    written["options"] = out / "options.json"
    written["options"].write_text(json.dumps(dataclasses.asdict(report.options), indent=2, default=str),
                                  encoding="utf-8")
    return written


def log_comparison(report: ComparisonReport, out_dir: str | Path, *, uri: str, experiment: str) -> str:
    """Log the written comparison as artifacts of a new MLflow run tagged harness.kind=comparison."""
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    compared = [r for r in report.runs["run_id"] if isinstance(r, str)]
    tags = {KIND_TAG: COMPARISON_KIND, "harness.compared_runs": ",".join(compared)[:5000],
            "harness.compared_labels": ",".join(report.labels)[:5000]}
    if report.options.sweep:
        tags[SWEEP_TAG] = report.options.sweep
    stats_ = report.item_stats
    metrics = {"n_runs": float(len(report.runs)), "n_tests": float(report.n_tests()),
               "n_significant": float(stats_["significant"].sum()),
               "n_worse": float(stats_["verdict"].str.startswith("worse").sum())}
    if not report.speed.empty:
        schemes = report.speed[~report.speed["is_reference"]]
        metrics["n_pareto"] = float(schemes["pareto"].sum())
        metrics["n_slower"] = float(schemes["speed"].str.startswith("SLOWER").sum())
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=experiment_id, run_name=f"compare/{report.name}", tags=tags) as run:
        mlflow.log_params({"margin": report.options.margin, "correction": report.options.correction,
                           "alpha": report.options.alpha, "n_resamples": report.options.n_resamples,
                           "seed": report.options.seed, "ci_level": report.options.ci_level})
        mlflow.log_metrics(metrics)
        mlflow.log_artifacts(str(out_dir))
        return run.info.run_id
