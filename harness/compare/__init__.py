"""Side-by-side comparison of finished runs: schemes × slices with honest uncertainty.

``python -m harness.compare experiment=quant-harness [sweep=ID] [tags.KEY=VALUE ...]
[runs=[ID,...]] [dirs=[results/...,...]] [tracking.uri=URI] [margin=0.02] [correction=holm|bh|none]
[name=NAME] [out=results/compare/NAME] [log=true]``

Runs are selected in MLflow (experiment, sweep id, tags, or explicit run ids; comparison runs
themselves and unfinished runs are never selected) or taken from results directories, and
re-analysed together so the multiple-comparison correction spans every test of the comparison.
Outputs (``results/compare/<name>/``): ``comparison.md``, a self-contained ``comparison.html``,
PNG plots, the tables as parquet, all logged as artifacts of an MLflow run tagged
``harness.kind=comparison``. Where the runs have them, decision sections too: quality against
measured speed-up with its Pareto front and the ledger beside the engine (:mod:`.speed`, runs with a
``perf.json``), a thinking model's trace lengths (:mod:`.traces`) and budget sweeps (:mod:`.budget`).

The package imports one way (each module only imports those below it)::

    __main__ (CLI)  →  pipeline  →  output  →  render.{markdown, html_page, terminal, plots}
                                                      →  render.tables  →  harness.results.formatting
                       pipeline  →  sources, analysis  →  options, speed, traces, budget, harness.stats / summary
                       pipeline  →  parity  →  sources, harness.stats / summary

This file imports nothing at import time: the names below load their module on first use,
so ``import harness.compare.sources`` does not pull in matplotlib.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CompareOptions": "harness.compare.options",
    "ComparisonReport": "harness.compare.analysis",
    "analyse": "harness.compare.analysis",
    "RunData": "harness.compare.sources",
    "load_mlflow_run": "harness.compare.sources",
    "load_results_dir": "harness.compare.sources",
    "select_runs": "harness.compare.sources",
    "log_comparison": "harness.compare.output",
    "write_report": "harness.compare.output",
    "compare_runs": "harness.compare.comparison",
    "ParityInputs": "harness.compare.parity_table",
    "parity_table": "harness.compare.parity_table",
    "main": "harness.compare.__main__",
    "parse_options": "harness.compare.__main__",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'harness.compare' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
