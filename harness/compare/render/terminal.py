"""The comparison as a plain-text table for the terminal (what ``python -m harness.compare`` prints)."""
from __future__ import annotations

from harness.compare.analysis import ComparisonReport
from harness.compare.render.tables import budget_findings, detail_table, speed_findings

__all__ = ["TERMINAL_COLUMNS", "terminal_table"]

TERMINAL_COLUMNS = ["slice", "scheme", "n", "clusters", "acc ref %", "acc quant %", "Δacc pt [CI]", "flips r→w / w→r",
                    "p adj", "verdict", "KL mean ± SE", "top-1 agree %"]


def terminal_table(report: ComparisonReport) -> str:
    """A header line (name, runs, tests), the headline columns of :func:`detail_table`, then the Pareto front,
    any scheme slower than its reference and the budget sweeps' findings in one line each."""
    table = detail_table(report)
    findings = [*speed_findings(report), *budget_findings(report)]
    return (f"\n{report.name}: {len(report.runs)} runs, {report.n_tests()} tests\n"
            + table[TERMINAL_COLUMNS].to_string(index=False) + "".join(f"\n{line}" for line in findings))
