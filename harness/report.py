"""Human-readable views of one run's comparison: the terminal table and report.md."""
from __future__ import annotations

import math
from typing import Any

import pandas as pd

from harness.summary import Comparison


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec)


def side_by_side(comparison: Comparison) -> pd.DataFrame:
    """One row per slice (and overall): accuracy of both, Δ with CI, flips, McNemar, KL, PPL."""
    stats = comparison.item_stats[comparison.item_stats["level"].isin(["overall", "slice"])]
    tokens = comparison.token_stats
    rows = []
    for row in stats.to_dict("records"):
        name = "overall" if row["level"] == "overall" else row["slice"]
        tok = tokens[(tokens["slice"] == name) & (tokens["bucket"] == "all")]
        tok_row = tok.iloc[0].to_dict() if len(tok) else {}
        rows.append({
            "slice": name, "n": int(row["n"]),
            "acc ref": _fmt(row["acc_ref"]), "acc quant": _fmt(row["acc_quant"]),
            "Δacc [95% CI]": f"{row['delta']:+.3f} [{row['delta_ci_low']:+.3f}, {row['delta_ci_high']:+.3f}]",
            "flips r→w / w→r": f"{int(row['flips_right_to_wrong'])} / {int(row['flips_wrong_to_right'])}",
            "McNemar p (adj)": f"{_fmt(row['mcnemar_p'])} ({_fmt(row['mcnemar_p_adj'])})",
            "verdict": row.get("verdict", ""),
            "KL mean ± SE": f"{_fmt(tok_row.get('kl_mean'), '.4f')} ± {_fmt(tok_row.get('kl_se'), '.4f')}",
            "top-1 agree": _fmt(tok_row.get("top1_agree")),
            "PPL ref → quant": f"{_fmt(tok_row.get('ppl_ref'), '.2f')} → {_fmt(tok_row.get('ppl_quant'), '.2f')}",
        })
    return pd.DataFrame(rows)


def print_comparison(comparison: Comparison, result: dict) -> None:
    table = side_by_side(comparison)
    quant = result.get("quant", {})
    print()
    print(f"{result['model']}  ·  {result['scheme']} ({_fmt(quant.get('bits_per_weight'), '.3f')} bits/weight)  "
          f"vs  unquantized reference")
    print(table.to_string(index=False))
    print()


def markdown(comparison: Comparison, result: dict) -> str:
    timings = ", ".join(f"{k} {v:.1f}s" for k, v in result.get("timings", {}).items())
    sub = comparison.item_stats[comparison.item_stats["level"] == "sub_slice"]
    sub_cols = [c for c in ["slice", "sub_slice", "n", "acc_ref", "acc_quant", "delta", "delta_ci_low",
                            "delta_ci_high", "flips_right_to_wrong", "flips_wrong_to_right", "mcnemar_p_adj"]
                if c in sub.columns]
    return "\n".join([
        f"# {result['run_name']}", "",
        f"Scheme `{result['scheme']}` ({result.get('method', '')}) on `{result['model']}`; run key `{result['run_key']}`.",
        "", side_by_side(comparison).to_markdown(index=False), "",
        "## Sub-slices", "", sub[sub_cols].to_markdown(index=False, floatfmt=".3f"), "",
        "## Generation divergence", "", comparison.generation.to_markdown(index=False, floatfmt=".3f"), "",
        f"Timings: {timings}", "",
    ])
