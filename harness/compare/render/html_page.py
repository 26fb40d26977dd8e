"""The comparison as one self-contained HTML page (``comparison.html``).

The page has no external resources at all (inline CSS, no JavaScript, images embedded as
base64 PNG data URIs, an empty data-URI favicon so the browser requests nothing), so it can be
mailed, attached to an MLflow run or opened from a laptop without the results tree.
"""
from __future__ import annotations

import base64
import html as html_lib
from pathlib import Path
from typing import Callable

import pandas as pd

from harness.compare.analysis import ComparisonReport
from harness.compare.render.markdown import DECISION_PLOTS
from harness.compare.render.tables import (
    MEASURED_NOTE,
    budget_findings,
    budget_text_table,
    caption,
    detail_table,
    matrix_table,
    measured_text_table,
    method_note,
    position_table,
    runs_table,
    speed_findings,
    speed_text_table,
    sub_slice_table,
    trace_text_table,
)

__all__ = ["html"]

_VERDICT_CLASSES = (("worse", "worse"), ("better", "better"), ("equivalent", "ok"), ("non-inferior", "ok"))


def _verdict_class(text: str) -> str:
    words = text.split(" · ")[-1] if " · " in text else text
    for prefix, css in _VERDICT_CLASSES:
        if words.startswith(prefix):
            return css
    return "neutral" if words not in ("", "–") else ""


def _html_table(frame: pd.DataFrame, *, css: str, cell_class: Callable[[str, str], str] | None = None) -> str:
    head = "".join(f"<th>{html_lib.escape(str(c))}</th>" for c in frame.columns)
    body = []
    for row in frame.itertuples(index=False):
        cells = []
        for column, value in zip(frame.columns, row):
            text = "–" if value is None else str(value)
            klass = cell_class(str(column), text) if cell_class else ""
            attr = f' class="{klass}"' if klass else ""
            cells.append(f"<td{attr}>{html_lib.escape(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<div class="scroll"><table class="{css}"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


def _image(path: Path, name: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    alt = html_lib.escape(caption(name))
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{alt}" data-plot="{html_lib.escape(name)}">'
            f"<figcaption>{alt}</figcaption></figure>")


_STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em;color:#222;max-width:1600px}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px;margin:0.5em 0}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:right;white-space:nowrap}
th{background:#f3f3f3}td:first-child,td:nth-child(2){text-align:left}
td.worse{background:#f8d0d0}td.better{background:#d2f0d2}td.ok{background:#dbe8f8}td.neutral{background:#f4f4f4}
figure{display:inline-block;margin:0.5em 1em 1em 0;vertical-align:top}
img{max-width:100%;border:1px solid #eee}figcaption{font-size:12px;color:#555}
p.note{font-size:13px;max-width:70em}div.scroll{overflow-x:auto;max-width:100%}
"""


def _findings(lines: list[str]) -> str:
    items = "".join(f"<li>{html_lib.escape(line)}</li>" for line in lines)
    return f'<ul class="findings">{items}</ul>' if items else ""


def _decision_sections(report: ComparisonReport, figures: dict[str, Path]) -> list[str]:
    """The same sections as :func:`harness.compare.render.markdown.decision_sections`, figures embedded."""
    def image(name: str) -> list[str]:
        return [_image(figures[name], name)] if name in figures else []

    speed_cells = lambda c, t: ("worse" if t.startswith("SLOWER") else "better" if t.startswith("faster") else "") \
        if c == "speed" else ("ok" if c == "Pareto" and t.startswith("★") else "")  # noqa: E731
    parts: list[str] = []
    if not report.speed.empty:
        parts += ["<h2>Quality against measured speed</h2>", _findings(speed_findings(report)),
                  _html_table(speed_text_table(report), css="speed", cell_class=speed_cells), *image("quality_vs_speed")]
    if not report.measured.empty:
        parts += ["<h2>Predicted against measured (memory and decode speed)</h2>",
                  _html_table(measured_text_table(report), css="measured"),
                  f'<p class="note">{html_lib.escape(MEASURED_NOTE)}</p>']
    if not report.trace_stats.empty:
        parts += ["<h2>Thinking: trace lengths</h2>", _html_table(trace_text_table(report), css="traces"),
                  *image("trace_lengths")]
    if not report.budget.empty:
        parts += ["<h2>Thinking budget sweep</h2>", _findings(budget_findings(report)),
                  _html_table(budget_text_table(report), css="budget",
                              cell_class=lambda c, t: _verdict_class(t) if c == "verdict" else ""), *image("budget_curves")]
    return parts


def html(report: ComparisonReport, figures: dict[str, Path]) -> str:
    """A single self-contained HTML page: tables, then every figure embedded as a data URI."""
    def verdict_cells(column: str, text: str) -> str:
        return _verdict_class(text) if column not in ("scheme", "bits/weight", "slice") else ""

    title = html_lib.escape(f"Comparison: {report.name}")
    sections = [f"<h1>{title}</h1>", f'<p class="note">{html_lib.escape(method_note(report))}</p>',
                "<h2>Schemes × slices</h2>", _html_table(matrix_table(report), css="matrix", cell_class=verdict_cells),
                "<h2>Details</h2>",
                _html_table(detail_table(report), css="details",
                            cell_class=lambda c, t: _verdict_class(t) if c == "verdict" else "")]
    sub = sub_slice_table(report)
    if not sub.empty:
        sections += ["<h2>Sub-slices</h2>",
                     _html_table(sub, css="subslices", cell_class=lambda c, t: _verdict_class(t) if c == "verdict" else "")]
    positions = position_table(report)
    if not positions.empty:
        sections += ["<h2>KL by token position</h2>", _html_table(positions, css="positions")]
    sections += _decision_sections(report, figures)
    sections += ["<h2>Plots</h2>", *[_image(path, name) for name, path in figures.items() if name not in DECISION_PLOTS],
                 "<h2>Runs</h2>", _html_table(runs_table(report), css="runs")]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<link rel=\"icon\" href=\"data:,\"><title>{title}</title><style>{_STYLE}</style></head>"
            f"<body>{''.join(sections)}</body></html>\n")
