"""The re-analysis of a comparison: every run's per-item table through :mod:`harness.stats`
in one family of tests, and the tables every renderer reads (:class:`ComparisonReport`).

The multiple-comparison correction spans *every* test of the comparison — all runs, slices
and sub-slices — not one run at a time. The bootstrap seeds depend only on (seed, group), so
a row's Δ and CI equal the run's own report when the settings agree. Token divergence is
recomputed from the per-token rows (one set of position buckets for all runs), generation
divergence is read from each run.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import pandas as pd

from harness import stats
from harness.compare import budget, speed, traces
from harness.compare.options import CompareOptions
from harness.compare.sources import RunData
from harness.config import CompareConfig
from harness.results import summary

__all__ = ["ComparisonReport", "analyse"]


@dataclass
class ComparisonReport:
    """Every number of a comparison as tables; rendered by :mod:`harness.compare.render`.

    ``item_stats``: one row per (label, level, slice, sub_slice) with ``delta_p_adj`` corrected
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
    survival: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)  # label, position, survival
    parity: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)  # harness.compare.parity_table.parity_table
    speed: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)  # speed.speed_table: speed-up, quality, front
    measured: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)  # speed.measured_table: ledger vs engine
    traces: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)  # traces.trace_rows: thinking trace lengths
    trace_stats: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)  # traces.trace_summary per run, side
    budget: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)  # budget.budget_table: accuracy vs budget

    @property
    def labels(self) -> list[str]:
        return list(self.runs["label"])

    def n_tests(self) -> int:
        return int(self.item_stats["delta_p"].notna().sum())

    def headline(self) -> pd.DataFrame:
        """One row per (label, slice) incl. ``overall``: accuracy, Δ, flips, tests, KL, generation."""
        keep = self.item_stats[self.item_stats["level"].isin(["overall", "slice"])].copy()
        keep["slice"] = keep["slice"].where(keep["level"] == "slice", "overall")
        token_cols = ["kl_mean", "kl_se", "kl_p99", "kl_reverse_mean", "top1_agree", "top1_agree_se",
                      "ppl_ratio", "ppl_ratio_se", "n_tokens", "kl_bound"]
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
    options.check()
    runs = list(runs)
    _assign_labels(runs)
    speed.attach_perf(runs, options.perf)
    settings = CompareConfig(n_resamples=options.n_resamples, ci_level=options.ci_level, seed=options.seed,
                             margin=options.margin, correction="none")
    item_parts, token_parts, kl_parts, gen_parts, survival_parts, run_rows = [], [], [], [], [], []
    for run in runs:
        identity = {"label": run.label, "model": run.model, "scheme": run.scheme}
        run_rows.append({**identity, "run_id": run.run_id, "method": run.summary.get("method", ""),
                         "bits_per_weight": run.bits_per_weight, "slices": ",".join(run.summary.get("slices", [])),
                         "n_items": len(run.items), "run_key": run.summary.get("run_key"), "source": run.source})
        item_parts.append(summary.paired_statistics(run.items, settings).assign(**identity))
        if not run.tokens.empty:
            token_parts.append(summary.summarize_tokens(run.tokens, options.position_buckets).assign(**identity))
            columns = [c for c in ("slice", "position", "kl", "kl_reverse") if c in run.tokens]
            kl_parts.append(summary.headline_tokens(run.tokens)[columns].assign(label=run.label))
        if not run.generation.empty:
            gen_parts.append(run.generation.assign(**identity))
        if not run.survival.empty:
            survival_parts.append(run.survival.assign(label=run.label))
    item_stats = pd.concat(item_parts, ignore_index=True)
    item_stats["delta_p_adj"] = stats.adjust_pvalues(item_stats["delta_p"].to_numpy(float), options.correction)
    item_stats["significant"] = item_stats["delta_p_adj"] < options.alpha
    front = ["label", "model", "scheme", "level", "slice", "sub_slice"]
    item_stats = item_stats[front + [c for c in item_stats.columns if c not in front]]
    report = ComparisonReport(
        name=options.report_name(), options=options, runs=pd.DataFrame(run_rows), item_stats=item_stats,
        token_stats=_concat(token_parts, ["label", "slice", "bucket"]),
        generation=_concat(gen_parts, ["label", "slice", "identical_rate", "first_diff_mean"]),
        tokens=_concat(kl_parts, ["label", "slice", "position", "kl"]),
        survival=_concat(survival_parts, ["label", "position", "survival"]),
        traces=traces.trace_rows(runs),
        budget=budget.budget_table(runs, item_stats, margin=options.margin, ci_level=options.ci_level),
    )
    if not report.traces.empty:
        report.trace_stats = traces.trace_summary(report.traces, options.ci_level)
    if any(run.perf.get("levels") for run in runs):
        report.speed = speed.speed_table(runs, report.headline())
        report.measured = speed.measured_table(runs, options.perf_device)
    return report


def _concat(parts: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)
