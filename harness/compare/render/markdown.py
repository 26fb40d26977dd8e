"""The comparison as Markdown (``comparison.md``); figures are linked by file name."""
from __future__ import annotations

from pathlib import Path

from harness.compare.analysis import ComparisonReport
from harness.compare.render.tables import (
    PARITY_LEGEND,
    caption,
    detail_table,
    matrix_table,
    method_note,
    parity_markdown,
    position_table,
    runs_table,
    sub_slice_table,
)

__all__ = ["markdown"]


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
    parts += ["## Plots", ""]
    for name, path in figures.items():
        parts += [f"![{name}]({Path(path).name})", "", caption(name), ""]
    parts += ["## Runs", "", runs_table(report).to_markdown(index=False), ""]
    return "\n".join(parts)
