"""The comparison as a plain-text table for the terminal (what ``python -m harness.compare`` prints)."""
from __future__ import annotations

from harness.compare.analysis import ComparisonReport
from harness.compare.render.tables import detail_table

__all__ = ["TERMINAL_COLUMNS", "terminal_table"]

TERMINAL_COLUMNS = ["slice", "scheme", "n", "clusters", "acc ref %", "acc quant %", "Δacc pt [CI]", "flips r→w / w→r",
                    "p adj", "verdict", "KL mean ± SE", "top-1 agree %"]


def terminal_table(report: ComparisonReport) -> str:
    """A header line (name, runs, tests) and the headline columns of :func:`detail_table`."""
    table = detail_table(report)
    return (f"\n{report.name}: {len(report.runs)} runs, {report.n_tests()} tests\n"
            + table[TERMINAL_COLUMNS].to_string(index=False))
