"""Text renderings of a comparison: terminal table, Markdown and a self-contained HTML page.

The HTML page has no external resources at all (inline CSS, no JavaScript, images embedded
as base64 PNG data URIs, an empty data-URI favicon so the browser requests nothing), so it
can be mailed, attached to an MLflow run or opened from a laptop without the results tree.
"""
from __future__ import annotations

import base64
import html as html_lib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pandas as pd

if TYPE_CHECKING:
    from harness.compare import ComparisonReport

__all__ = ["detail_table", "html", "markdown", "matrix_table", "terminal_table"]

_CAPTIONS = {
    "forest": "Δ accuracy with bootstrap CI per slice; filled markers are significant after correction.",
    "flips": "Items that flipped: right→wrong to the left, wrong→right to the right.",
    "kl_cdf": "Distribution of per-token KL(ref‖quant).",
    "kl_by_position": "Mean KL by token position (long context).",
    "accuracy_vs_bits": "Accuracy of the quantized model against bits per weight.",
}


def _num(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return "–"
    return format(value, spec)


def _pm(mean: Any, se: Any, spec: str = ".4f") -> str:
    return "–" if _num(mean) == "–" else f"{_num(mean, spec)} ± {_num(se, spec)}"


def _delta(row: dict) -> str:
    return (f"{_num(row['delta'], '+.3f')} [{_num(row['delta_ci_low'], '+.3f')}, "
            f"{_num(row['delta_ci_high'], '+.3f')}]")


def detail_table(report: ComparisonReport) -> pd.DataFrame:
    """Formatted headline: one row per (slice, run) with every number a reader needs."""
    rows = []
    for row in report.headline().to_dict("records"):
        rows.append({
            "slice": row["slice"], "scheme": row["label"], "n": int(row["n"]),
            "acc ref": _num(row["acc_ref"]), "acc quant": _num(row["acc_quant"]),
            "Δacc [CI]": _delta(row),
            "flips r→w / w→r": f"{int(row['flips_right_to_wrong'])} / {int(row['flips_wrong_to_right'])}",
            "flip rate [CI]": f"{_num(row['flip_rate'])} [{_num(row['flip_rate_ci_low'])}, "
                              f"{_num(row['flip_rate_ci_high'])}]",
            "McNemar p": _num(row["mcnemar_p"], ".3g"), "p adj": _num(row["mcnemar_p_adj"], ".3g"),
            "sig. (adj)": "yes" if row["significant"] else "no",
            "verdict": row["verdict"],
            "MDE": _num(row["mde"]), "n for margin": "–" if pd.isna(row.get("n_needed")) else str(int(row["n_needed"])),
            "KL mean ± SE": _pm(row.get("kl_mean"), row.get("kl_se")),
            "KL p99": _num(row.get("kl_p99"), ".4f"),
            "KL(q‖r) mean": _num(row.get("kl_reverse_mean"), ".4f"),
            "top-1 agree": _pm(row.get("top1_agree"), row.get("top1_agree_se"), ".3f"),
            "PPL ratio ± SE": _pm(row.get("ppl_ratio"), row.get("ppl_ratio_se")),
            "gen identical": _num(row.get("identical_rate")),
            "gen 1st diff": _num(row.get("first_diff_mean"), ".1f"),
        })
    return pd.DataFrame(rows)


def matrix_table(report: ComparisonReport) -> pd.DataFrame:
    """Schemes × slices: ``Δ [CI] · verdict`` per cell (``*`` marks significance after correction)."""
    headline = report.headline()
    bits = report.runs.set_index("label")["bits_per_weight"]
    slices = list(dict.fromkeys(headline["slice"]))
    rows = []
    for label in report.labels:
        part = headline[headline["label"] == label].set_index("slice")
        row: dict[str, str] = {"scheme": label, "bits/weight": _num(bits.get(label), ".3f")}
        for slice_name in slices:
            if slice_name not in part.index:
                row[slice_name] = "–"
                continue
            cell = part.loc[slice_name].to_dict()
            star = "*" if cell["significant"] else ""
            row[slice_name] = f"{_delta(cell)}{star} · {cell['verdict']}"
        rows.append(row)
    return pd.DataFrame(rows)


def _sub_slice_table(report: ComparisonReport) -> pd.DataFrame:
    sub = report.item_stats[report.item_stats["level"] == "sub_slice"]
    return pd.DataFrame([{
        "slice": r["slice"], "sub-slice": r["sub_slice"], "scheme": r["label"], "n": int(r["n"]),
        "acc ref": _num(r["acc_ref"]), "acc quant": _num(r["acc_quant"]), "Δacc [CI]": _delta(r),
        "r→w / w→r": f"{int(r['flips_right_to_wrong'])} / {int(r['flips_wrong_to_right'])}",
        "p adj": _num(r["mcnemar_p_adj"], ".3g"), "verdict": r["verdict"],
    } for r in sub.sort_values(["slice", "sub_slice"]).to_dict("records")])


def _position_table(report: ComparisonReport) -> pd.DataFrame:
    tok = report.token_stats
    if tok.empty:
        return pd.DataFrame()
    part = tok[(tok["bucket"] != "all") & (tok["slice"] != "overall")]
    multi = [s for s, g in part.groupby("slice") if g["bucket"].nunique() > 1]
    part = part[part["slice"].isin(multi)]
    return pd.DataFrame([{
        "slice": r["slice"], "positions": r["bucket"], "scheme": r["label"], "tokens": int(r["n_tokens"]),
        "KL mean ± SE": _pm(r["kl_mean"], r["kl_se"]), "KL p99": _num(r["kl_p99"], ".4f"),
        "top-1 agree": _num(r["top1_agree"]), "PPL ratio": _num(r["ppl_ratio"], ".4f"),
    } for r in part.to_dict("records")])


def _runs_table(report: ComparisonReport) -> pd.DataFrame:
    runs = report.runs
    return pd.DataFrame({"scheme": runs["label"], "model": runs["model"], "method": runs["method"],
                         "bits/weight": runs["bits_per_weight"].map(lambda v: _num(v, ".3f")),
                         "items": runs["n_items"], "slices": runs["slices"],
                         "run": runs["run_id"].fillna(runs["source"])})


def _method_note(report: ComparisonReport) -> str:
    o = report.options
    correction = {"holm": "Holm (family-wise)", "bh": "Benjamini–Hochberg (FDR)", "none": "no"}[o.correction]
    margin = "no margin" if o.margin is None else f"margin {100 * o.margin:g} pt"
    return (f"Paired per-item comparison of each scheme with its unquantized reference. Δ = accuracy(quant) − "
            f"accuracy(ref) with a {100 * o.ci_level:g}% paired (cluster) bootstrap CI ({o.n_resamples} resamples, "
            f"seed {o.seed}); McNemar exact test on discordant pairs; {correction} correction across all "
            f"{report.n_tests()} tests of this comparison (every scheme, slice and sub-slice), alpha {o.alpha:g}; "
            f"verdicts use TOST / non-inferiority at {margin} on unadjusted tests, '*' and 'sig. (adj)' mark "
            f"significance after correction. MDE: minimum detectable Δ at 80% power. KL in nats on gold texts.")


def terminal_table(report: ComparisonReport) -> str:
    table = detail_table(report)
    columns = ["slice", "scheme", "n", "acc ref", "acc quant", "Δacc [CI]", "flips r→w / w→r", "p adj", "verdict",
               "KL mean ± SE", "top-1 agree"]
    return f"\n{report.name}: {len(report.runs)} runs, {report.n_tests()} tests\n" + table[columns].to_string(index=False)


def markdown(report: ComparisonReport, figures: dict[str, Path]) -> str:
    """The comparison as Markdown; figures are linked by file name (they sit next to the .md)."""
    parts = [f"# Comparison: {report.name}", "", _method_note(report), "",
             "## Schemes × slices", "", matrix_table(report).to_markdown(index=False), "",
             "## Details", "", detail_table(report).to_markdown(index=False), ""]
    sub = _sub_slice_table(report)
    if not sub.empty:
        parts += ["## Sub-slices", "", sub.to_markdown(index=False), ""]
    positions = _position_table(report)
    if not positions.empty:
        parts += ["## KL by token position", "", positions.to_markdown(index=False), ""]
    parts += ["## Plots", ""]
    for name, path in figures.items():
        parts += [f"![{name}]({Path(path).name})", "", _caption(name), ""]
    parts += ["## Runs", "", _runs_table(report).to_markdown(index=False), ""]
    return "\n".join(parts)


def _caption(name: str) -> str:
    if name.startswith("forest_"):
        return f"Δ accuracy per sub-slice of {name[len('forest_'):]}."
    return _CAPTIONS.get(name, name)


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
    alt = html_lib.escape(_caption(name))
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


def html(report: ComparisonReport, figures: dict[str, Path]) -> str:
    """A single self-contained HTML page: tables, then every figure embedded as a data URI."""
    def verdict_cells(column: str, text: str) -> str:
        return _verdict_class(text) if column not in ("scheme", "bits/weight", "slice") else ""

    title = html_lib.escape(f"Comparison: {report.name}")
    sections = [f"<h1>{title}</h1>", f'<p class="note">{html_lib.escape(_method_note(report))}</p>',
                "<h2>Schemes × slices</h2>", _html_table(matrix_table(report), css="matrix", cell_class=verdict_cells),
                "<h2>Details</h2>",
                _html_table(detail_table(report), css="details",
                            cell_class=lambda c, t: _verdict_class(t) if c == "verdict" else "")]
    sub = _sub_slice_table(report)
    if not sub.empty:
        sections += ["<h2>Sub-slices</h2>",
                     _html_table(sub, css="subslices", cell_class=lambda c, t: _verdict_class(t) if c == "verdict" else "")]
    positions = _position_table(report)
    if not positions.empty:
        sections += ["<h2>KL by token position</h2>", _html_table(positions, css="positions")]
    sections += ["<h2>Plots</h2>", *[_image(path, name) for name, path in figures.items()],
                 "<h2>Runs</h2>", _html_table(_runs_table(report), css="runs")]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<link rel=\"icon\" href=\"data:,\"><title>{title}</title><style>{_STYLE}</style></head>"
            f"<body>{''.join(sections)}</body></html>\n")
