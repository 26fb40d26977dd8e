"""Human-readable views of one run's comparison: the terminal table and report.md."""
from __future__ import annotations

import pandas as pd

from harness.formatting import count, delta_ci, flips, num, pm
from harness.summary import Comparison


def side_by_side(comparison: Comparison) -> pd.DataFrame:
    """One row per slice (and overall): items and clusters, accuracy of both, Δ with CI, flips, McNemar, KL, PPL."""
    stats = comparison.item_stats[comparison.item_stats["level"].isin(["overall", "slice"])]
    tokens = comparison.token_stats
    rows = []
    for row in stats.to_dict("records"):
        name = "overall" if row["level"] == "overall" else row["slice"]
        tok = tokens[(tokens["slice"] == name) & (tokens["bucket"] == "all")]
        tok_row = tok.iloc[0].to_dict() if len(tok) else {}
        rows.append({
            "slice": name, "n": int(row["n"]), "clusters": count(row.get("n_clusters")),
            "acc ref": num(row["acc_ref"]), "acc quant": num(row["acc_quant"]),
            "Δacc [95% CI]": delta_ci(row["delta"], row["delta_ci_low"], row["delta_ci_high"]),
            "flips r→w / w→r": flips(row["flips_right_to_wrong"], row["flips_wrong_to_right"]),
            "McNemar p (adj)": f"{num(row['mcnemar_p'])} ({num(row['mcnemar_p_adj'])})",
            "verdict": row.get("verdict", ""),
            "KL mean ± SE": pm(tok_row.get("kl_mean"), tok_row.get("kl_se")),
            "top-1 agree": num(tok_row.get("top1_agree")),
            "PPL ref → quant": f"{num(tok_row.get('ppl_ref'), '.2f')} → {num(tok_row.get('ppl_quant'), '.2f')}",
        })
    return pd.DataFrame(rows)


def print_comparison(comparison: Comparison, result: dict) -> None:
    table = side_by_side(comparison)
    quant = result.get("quant", {})
    print()
    print(f"{result['model']}  ·  {result['scheme']} ({num(quant.get('bits_per_weight'), '.3f')} bits/weight)  "
          f"vs  unquantized reference")
    print(table.to_string(index=False))
    print()


def markdown(comparison: Comparison, result: dict) -> str:
    timings = ", ".join(f"{k} {v:.1f}s" for k, v in result.get("timings", {}).items())
    sub = comparison.item_stats[comparison.item_stats["level"] == "sub_slice"]
    sub_cols = [c for c in ["slice", "sub_slice", "n", "n_clusters", "acc_ref", "acc_quant", "delta", "delta_ci_low",
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
