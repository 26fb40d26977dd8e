"""Side-by-side comparison of finished runs: schemes × slices with honest uncertainty.

``python -m harness.compare experiment=quant-harness [sweep=ID] [tags.KEY=VALUE ...]
[runs=[ID,...]] [dirs=[results/...,...]] [tracking.uri=URI] [margin=0.02] [correction=holm|bh|none]
[name=NAME] [out=results/compare/NAME] [log=true]``

Runs are selected in MLflow (experiment, sweep id, tags, or explicit run ids; comparison
runs themselves and unfinished runs are never selected) or taken from results directories.
Each run's per-item table is re-analysed with :mod:`harness.stats` so that the
multiple-comparison correction spans *every* test of the comparison — all runs, slices and
sub-slices — not one run at a time. The bootstrap seeds depend only on (seed, group), so a
row's Δ and CI equal the run's own report when the settings agree. Token divergence is
recomputed from the per-token rows (one set of position buckets for all runs), generation
divergence is read from each run.

Outputs (``results/compare/<name>/``): ``comparison.md``, a self-contained ``comparison.html``,
PNG plots, the tables as parquet, and all of it logged as artifacts of an MLflow run tagged
``harness.kind=comparison``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import pandas as pd

from harness import stats, summary
from harness.compare_sources import (COMPARISON_KIND, KIND_TAG, RunData, load_mlflow_run, load_results_dir,
                                     select_runs)
from harness.config import CompareConfig, EvalConfig
from harness.tracking import SWEEP_TAG, resolve_uri

log = logging.getLogger(__name__)

__all__ = ["CompareOptions", "ComparisonReport", "RunData", "analyse", "compare_runs", "load_mlflow_run",
           "load_results_dir", "log_comparison", "main", "parse_cli", "select_runs", "write_report"]

_DEFAULTS = CompareConfig()


@dataclass
class CompareOptions:
    """What to compare and how; every field is a ``key=value`` argument of the command."""

    experiment: str = "quant-harness"  # MLflow experiment holding the runs
    tags: dict[str, str] = field(default_factory=dict)  # tags.KEY=VALUE: all must match
    sweep: str | None = None  # harness.sweep_id tag of a sweep
    runs: list[str] = field(default_factory=list)  # explicit MLflow run ids (overrides the search)
    dirs: list[str] = field(default_factory=list)  # results directories instead of MLflow
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else ./mlflow.db
    margin: float | None = _DEFAULTS.margin  # non-inferiority / equivalence margin (0.01 = 1 point)
    correction: Literal["holm", "bh", "none"] = "holm"  # across ALL tests of the comparison
    n_resamples: int = _DEFAULTS.n_resamples
    seed: int = _DEFAULTS.seed
    ci_level: float = _DEFAULTS.ci_level
    alpha: float = 0.05
    position_buckets: list[int] = field(default_factory=lambda: list(EvalConfig().position_buckets))
    name: str | None = None  # None: the sweep id, else the experiment name
    out: str | None = None  # None: results/compare/<name>
    log: bool = True  # log the comparison to MLflow (only when runs came from MLflow)

    def report_name(self) -> str:
        raw = self.name or self.sweep or self.experiment
        return re.sub(r"[^A-Za-z0-9_.+-]+", "_", raw).strip("_") or "comparison"


@dataclass
class ComparisonReport:
    """Every number of a comparison as tables; rendered by ``write_report``.

    ``item_stats``: one row per (label, level, slice, sub_slice) with ``mcnemar_p_adj`` corrected
    across all rows and ``significant`` (= p_adj < alpha). ``token_stats``: per (label, slice,
    bucket), ``bucket == "all"`` for whole slices. ``generation``: per (label, slice).
    ``tokens``: per-token KL (label, slice, position, kl, kl_reverse) for distribution plots.
    """

    name: str
    options: CompareOptions
    runs: pd.DataFrame
    item_stats: pd.DataFrame
    token_stats: pd.DataFrame
    generation: pd.DataFrame
    tokens: pd.DataFrame

    @property
    def labels(self) -> list[str]:
        return list(self.runs["label"])

    def n_tests(self) -> int:
        return int(self.item_stats["mcnemar_p"].notna().sum())

    def headline(self) -> pd.DataFrame:
        """One row per (label, slice) incl. ``overall``: accuracy, Δ, flips, tests, KL, generation."""
        keep = self.item_stats[self.item_stats["level"].isin(["overall", "slice"])].copy()
        keep["slice"] = keep["slice"].where(keep["level"] == "slice", "overall")
        token_cols = ["kl_mean", "kl_se", "kl_p99", "kl_reverse_mean", "top1_agree", "top1_agree_se",
                      "ppl_ratio", "ppl_ratio_se", "n_tokens"]
        tok = self.token_stats
        if not tok.empty:
            tok = tok[tok["bucket"] == "all"][["label", "slice", *[c for c in token_cols if c in tok]]]
            keep = keep.merge(tok, on=["label", "slice"], how="left")
        gen = self.generation
        if not gen.empty:
            keep = keep.merge(gen[["label", "slice", "identical_rate", "first_diff_mean"]], on=["label", "slice"],
                              how="left")
        order = {label: i for i, label in enumerate(self.labels)}
        keep["_run"] = keep["label"].map(order)
        keep["_slice"] = keep["slice"].map(lambda s: (s != "overall", s))
        return keep.sort_values(["_slice", "_run"]).drop(columns=["_run", "_slice"]).reset_index(drop=True)


# ---------------------------------------------------------------- analysis ---------------------


def _assign_labels(runs: list[RunData]) -> None:
    """Scheme names, prefixed by the model when several models are compared, then made unique."""
    several_models = len({run.model for run in runs}) > 1
    labels = [f"{run.model}/{run.scheme}" if several_models else run.scheme for run in runs]
    labels = [f"{label}#{(run.run_id or str(run.summary.get('run_key', index)))[:8]}" if labels.count(label) > 1
              else label for index, (label, run) in enumerate(zip(labels, runs))]
    labels = [f"{label}#{labels[:index].count(label) + 1}" if labels.count(label) > 1 else label
              for index, label in enumerate(labels)]
    for run, label in zip(runs, labels):
        run.label = label


def analyse(runs: Sequence[RunData], options: CompareOptions) -> ComparisonReport:
    """Paired statistics, token and generation divergence of every run, corrected across all tests."""
    if not runs:
        raise ValueError("no runs to compare: select at least one finished run")
    if options.correction not in ("holm", "bh", "none"):
        raise ValueError(f"correction={options.correction!r} is unknown; use holm, bh or none")
    runs = list(runs)
    _assign_labels(runs)
    settings = CompareConfig(n_resamples=options.n_resamples, ci_level=options.ci_level, seed=options.seed,
                             margin=options.margin, correction="none")
    item_parts, token_parts, kl_parts, gen_parts, run_rows = [], [], [], [], []
    for run in runs:
        identity = {"label": run.label, "model": run.model, "scheme": run.scheme}
        run_rows.append({**identity, "run_id": run.run_id, "method": run.summary.get("method", ""),
                         "bits_per_weight": run.bits_per_weight, "slices": ",".join(run.summary.get("slices", [])),
                         "n_items": len(run.items), "run_key": run.summary.get("run_key"), "source": run.source})
        item_parts.append(summary.compare_items(run.items, settings).assign(**identity))
        if not run.tokens.empty:
            token_parts.append(summary.summarize_tokens(run.tokens, options.position_buckets).assign(**identity))
            columns = [c for c in ("slice", "position", "kl", "kl_reverse") if c in run.tokens]
            kl_parts.append(run.tokens[columns].assign(label=run.label))
        if not run.generation.empty:
            gen_parts.append(run.generation.assign(**identity))
    item_stats = pd.concat(item_parts, ignore_index=True)
    item_stats["mcnemar_p_adj"] = stats.adjust_pvalues(item_stats["mcnemar_p"].to_numpy(float), options.correction)
    item_stats["significant"] = item_stats["mcnemar_p_adj"] < options.alpha
    front = ["label", "model", "scheme", "level", "slice", "sub_slice"]
    item_stats = item_stats[front + [c for c in item_stats.columns if c not in front]]
    return ComparisonReport(
        name=options.report_name(), options=options, runs=pd.DataFrame(run_rows), item_stats=item_stats,
        token_stats=_concat(token_parts, ["label", "slice", "bucket"]),
        generation=_concat(gen_parts, ["label", "slice", "identical_rate", "first_diff_mean"]),
        tokens=_concat(kl_parts, ["label", "slice", "position", "kl"]),
    )


def _concat(parts: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)


# ---------------------------------------------------------------- outputs ----------------------


def write_report(report: ComparisonReport, out_dir: str | Path | None = None) -> dict[str, Path]:
    """Markdown, self-contained HTML, PNG plots and parquet tables; returns name -> path."""
    from harness import html_report, plots

    out = Path(out_dir or report.options.out or Path("results") / "compare" / report.name)
    out.mkdir(parents=True, exist_ok=True)
    figures = plots.render_all(report, out)
    written: dict[str, Path] = dict(figures)
    for name, frame in (("runs", report.runs), ("item_stats", report.item_stats),
                        ("token_stats", report.token_stats), ("generation", report.generation)):
        path = out / f"{name}.parquet"
        frame.to_parquet(path, index=False)
        written[name] = path
    written["markdown"] = out / "comparison.md"
    written["markdown"].write_text(html_report.markdown(report, figures), encoding="utf-8")
    written["html"] = out / "comparison.html"
    written["html"].write_text(html_report.html(report, figures), encoding="utf-8")
    options = {k: v for k, v in dataclasses.asdict(report.options).items()}
    written["options"] = out / "options.json"
    written["options"].write_text(json.dumps(options, indent=2, default=str), encoding="utf-8")
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
               "n_worse": float((stats_["verdict"] == "worse").sum())}
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=experiment_id, run_name=f"compare/{report.name}", tags=tags) as run:
        mlflow.log_params({"margin": report.options.margin, "correction": report.options.correction,
                           "alpha": report.options.alpha, "n_resamples": report.options.n_resamples,
                           "seed": report.options.seed, "ci_level": report.options.ci_level})
        mlflow.log_metrics(metrics)
        mlflow.log_artifacts(str(out_dir))
        return run.info.run_id


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
    return _execute(options, write=write)


def _execute(options: CompareOptions, *, write: bool) -> ComparisonReport:
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
    if write:
        out = Path(options.out or Path("results") / "compare" / report.name)
        write_report(report, out)
        log.info("comparison of %d runs written to %s", len(loaded), out)
        if options.log and not options.dirs:
            run_id = log_comparison(report, out, uri=uri, experiment=options.experiment)
            log.info("logged as MLflow comparison run %s (experiment %s)", run_id, options.experiment)
    return report


# ---------------------------------------------------------------- command line -----------------

_ALIASES = {"tracking.uri": "tracking_uri", "compare.margin": "margin", "compare.correction": "correction"}


def _split_list(value: str) -> list[str]:
    return [part.strip().strip("'\"") for part in value.strip().strip("[]").split(",") if part.strip()]


def _convert(name: str, raw: str) -> Any:
    kind = {f.name: str(f.type) for f in dataclasses.fields(CompareOptions)}[name]
    if raw.lower() in ("null", "none") and "None" in kind:
        return None
    try:
        if kind.startswith("list[int]"):
            return [int(v) for v in _split_list(raw)]
        if kind.startswith("list"):
            return _split_list(raw)
        if kind == "bool":
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        if kind.startswith("float"):
            return float(raw)
        if kind == "int":
            return int(raw)
    except ValueError:
        raise SystemExit(f"error: {name}={raw!r} is not a valid {kind}") from None
    return raw


def parse_cli(argv: Sequence[str]) -> CompareOptions:
    """``key=value`` arguments (``tags.KEY=VALUE`` for MLflow tags) into ``CompareOptions``."""
    names = [f.name for f in dataclasses.fields(CompareOptions)]
    values: dict[str, Any] = {"tags": {}}
    for arg in argv:
        key, sep, raw = arg.partition("=")
        if not sep:
            raise SystemExit(f"error: argument {arg!r} is not key=value, e.g. experiment=quant-harness sweep=ID")
        if key.startswith("tags."):
            values["tags"][key[len("tags."):]] = raw
            continue
        key = _ALIASES.get(key, key)
        if key not in names or key == "tags":
            raise SystemExit(f"error: unknown option {key!r}; valid: {', '.join(_ALIASES)}, tags.KEY, "
                             f"{', '.join(n for n in names if n != 'tags')}")
        values[key] = _convert(key, raw)
    options = CompareOptions(**values)
    if options.correction not in ("holm", "bh", "none"):
        raise SystemExit(f"error: correction={options.correction!r}; use holm, bh or none")
    if options.margin is not None and not 0 < options.margin < 1:
        raise SystemExit(f"error: margin={options.margin!r} must lie in (0, 1) (0.01 = 1 point) or be null")
    return options


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per downloaded table
    options = parse_cli(argv)
    try:
        report = _execute(options, write=True)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from harness import html_report

    print(html_report.terminal_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
