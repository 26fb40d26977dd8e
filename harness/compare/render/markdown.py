"""The comparison as Markdown (``comparison.md``); figures are linked by file name."""
from __future__ import annotations

from pathlib import Path

from harness.compare.analysis import ComparisonReport
from harness.compare.render.tables import (
    MEASURED_NOTE,
    PARITY_LEGEND,
    budget_findings,
    budget_text_table,
    caption,
    detail_table,
    matrix_table,
    measured_text_table,
    method_note,
    parity_markdown,
    position_table,
    runs_table,
    speed_findings,
    speed_text_table,
    sub_slice_table,
    trace_text_table,
)

__all__ = ["DECISION_PLOTS", "decision_sections", "markdown"]

DECISION_PLOTS = ("quality_vs_speed", "trace_lengths", "budget_curves")


def markdown(report: ComparisonReport, figures: dict[str, Path]) -> str:
    """The comparison as Markdown; figures are linked by file name (they sit next to the .md)."""
    parts = [f"# Comparison: {report.name}", "", method_note(report), "",
             "## Schemes × slices", "", matrix_table(report).to_markdown(index=False), "",
             "## Details", "", detail_table(report).to_markdown(index=False), ""]
    sub = sub_slice_table(report)
    if not sub.empty:
        parts += ["## Sub-slices", "", sub.to_markdown(index=False), ""]
    positions = position_table(report)
    if not positions.empty:
        parts += ["## KL by token position", "", positions.to_markdown(index=False), ""]
    if not report.parity.empty:
        parts += ["## Simulation against served", "", parity_markdown(report.parity), "", PARITY_LEGEND, ""]
    parts += decision_sections(report, figures)
    parts += ["## Plots", ""]
    for name, path in figures.items():
        if name not in DECISION_PLOTS:  # shown in their own sections
            parts += [f"![{name}]({Path(path).name})", "", caption(name), ""]
    parts += ["## Runs", "", runs_table(report).to_markdown(index=False), ""]
    return "\n".join(parts)


def _figure(figures: dict[str, Path], name: str) -> list[str]:
    return [f"![{name}]({Path(figures[name]).name})", "", caption(name), ""] if name in figures else []


def decision_sections(report: ComparisonReport, figures: dict[str, Path]) -> list[str]:
    """Speed against quality, the ledger against the engine, thinking traces and the budget sweep, each with its
    plot, where the compared runs have them."""
    parts: list[str] = []
    if not report.speed.empty:
        parts += ["## Quality against measured speed", "", *[f"- {line}" for line in speed_findings(report)], "",
                  speed_text_table(report).to_markdown(index=False), "", *_figure(figures, "quality_vs_speed")]
    if not report.measured.empty:
        parts += ["## Predicted against measured (memory and decode speed)", "",
                  measured_text_table(report).to_markdown(index=False), "", MEASURED_NOTE, ""]
    if not report.trace_stats.empty:
        parts += ["## Thinking: trace lengths", "", trace_text_table(report).to_markdown(index=False), "",
                  *_figure(figures, "trace_lengths")]
    if not report.budget.empty:
        parts += ["## Thinking budget sweep", "", *[f"- {line}" for line in budget_findings(report)], "",
                  budget_text_table(report).to_markdown(index=False), "", *_figure(figures, "budget_curves")]
    return parts
