"""The comparison's tables as formatted text cells, shared by the terminal, Markdown and HTML
renderings so that all three show the same numbers in the same way (:mod:`harness.results.formatting`)."""
from __future__ import annotations

import math

import pandas as pd

from harness.compare.analysis import ComparisonReport
from harness.compare.render.parity import LEGEND, parity_markdown
from harness.results.formatting import count, flips, lower_bound_mark, num, pct, pct_pm, pm, points

__all__ = ["PARITY_LEGEND", "budget_findings", "budget_text_table", "caption", "detail_table", "matrix_table",
           "measured_text_table", "method_note", "parity_markdown", "position_table", "runs_table",
           "speed_findings", "speed_text_table", "sub_slice_table", "trace_text_table"]

CAPTIONS = {
    "forest": "Δ accuracy with its clustered score interval per slice; filled markers are significant after correction.",
    "flips": "Items that flipped: right→wrong to the left, wrong→right to the right.",
    "kl_cdf": "Distribution of per-token KL(ref‖quant).",
    "kl_by_position": "Mean KL by token position (long context).",
    "accuracy_vs_bits": "Accuracy of the quantized model against bits per weight.",
    "quality_vs_speed": "Quality against measured speed-up over the reference's own weights on the same engine; "
                        "filled and starred: on the Pareto front (point estimates); bars: the intervals.",
    "trace_lengths": "Thinking trace tokens per item, reference and candidate overlaid (ECDF); the legend gives each "
                     "side's cap-hit and unclosed rates.",
    "budget_curves": "Accuracy against the thinking budget for both sides (left) and Δ with its interval against the "
              "margin (right); the green line marks the smallest budget where the candidate matches.",
}


def _delta(row: dict) -> str:
    return points(row["delta"], row["delta_ci_low"], row["delta_ci_high"])


def detail_table(report: ComparisonReport) -> pd.DataFrame:
    """Formatted headline: one row per (slice, run) with every number a reader needs.

    ``clusters`` beside ``n``: the bootstrap and the SE resample whole clusters, so with few of
    them an interval rests on less than ``n`` suggests."""
    rows = []
    for row in report.headline().to_dict("records"):
        rows.append({
            "slice": row["slice"], "scheme": row["label"], "n": int(row["n"]), "clusters": count(row.get("n_clusters")),
            "acc ref %": pct(row["acc_ref"]), "acc quant %": pct(row["acc_quant"]),
            "Δacc pt [CI]": _delta(row),
            "flips r→w / w→r": flips(row["flips_right_to_wrong"], row["flips_wrong_to_right"]),
            "flip rate % [CI]": f"{pct(row['flip_rate'])} [{pct(row['flip_rate_ci_low'])}, "
                                f"{pct(row['flip_rate_ci_high'])}]",
            "p": num(row["delta_p"], ".3g"), "p adj": num(row["delta_p_adj"], ".3g"),
            "sig. (adj)": "yes" if row["significant"] else "no",
            "verdict": row["verdict"],
            "MDE pt": pct(row["mde"]), "n for margin": count(row.get("n_needed")),
            "KL mean ± SE": lower_bound_mark(row) + pm(row.get("kl_mean"), row.get("kl_se")),
            "KL p99": lower_bound_mark(row) + num(row.get("kl_p99"), ".4f"),
            "KL(q‖r) mean": lower_bound_mark(row) + num(row.get("kl_reverse_mean"), ".4f"),
            "top-1 agree %": pct_pm(row.get("top1_agree"), row.get("top1_agree_se")),
            "PPL ratio ± SE": pm(row.get("ppl_ratio"), row.get("ppl_ratio_se")),
            "gen identical %": pct(row.get("identical_rate")),
            "gen 1st diff": num(row.get("first_diff_mean"), ".1f"),
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
        row: dict[str, str] = {"scheme": label, "bits/weight": num(bits.get(label), ".3f")}
        for slice_name in slices:
            if slice_name not in part.index:
                row[slice_name] = "–"
                continue
            cell = part.loc[slice_name].to_dict()
            star = "*" if cell["significant"] else ""
            row[slice_name] = f"{_delta(cell)}{star} · {cell['verdict']}"
        rows.append(row)
    return pd.DataFrame(rows)


def sub_slice_table(report: ComparisonReport) -> pd.DataFrame:
    """One row per (slice, sub-slice, run): items and clusters, accuracy, Δ, flips, adjusted p, verdict."""
    sub = report.item_stats[report.item_stats["level"] == "sub_slice"]
    return pd.DataFrame([{
        "slice": r["slice"], "sub-slice": r["sub_slice"], "scheme": r["label"], "n": int(r["n"]),
        "clusters": count(r.get("n_clusters")), "acc ref %": pct(r["acc_ref"]), "acc quant %": pct(r["acc_quant"]),
        "Δacc pt [CI]": _delta(r),
        "r→w / w→r": flips(r["flips_right_to_wrong"], r["flips_wrong_to_right"]),
        "p adj": num(r["delta_p_adj"], ".3g"), "verdict": r["verdict"],
    } for r in sub.sort_values(["slice", "sub_slice"]).to_dict("records")])


def position_table(report: ComparisonReport) -> pd.DataFrame:
    """KL by token position bucket, for slices whose tokens span more than one bucket."""
    tok = report.token_stats
    if tok.empty:
        return pd.DataFrame()
    part = tok[(tok["bucket"] != "all") & (tok["slice"] != "overall")]
    multi = [s for s, g in part.groupby("slice") if g["bucket"].nunique() > 1]
    part = part[part["slice"].isin(multi)]
    return pd.DataFrame([{
        "slice": r["slice"], "positions": r["bucket"], "scheme": r["label"], "tokens": int(r["n_tokens"]),
        "KL mean ± SE": lower_bound_mark(r) + pm(r["kl_mean"], r["kl_se"]),
        "KL p99": lower_bound_mark(r) + num(r["kl_p99"], ".4f"),
        "top-1 agree %": pct(r["top1_agree"]), "PPL ratio": num(r["ppl_ratio"], ".4f"),
    } for r in part.to_dict("records")])


def runs_table(report: ComparisonReport) -> pd.DataFrame:
    """The compared runs: label, model, method, bits per weight, items, slices, where they came from."""
    runs = report.runs
    return pd.DataFrame({"scheme": runs["label"], "model": runs["model"], "method": runs["method"],
                         "bits/weight": runs["bits_per_weight"].map(lambda v: num(v, ".3f")),
                         "items": runs["n_items"], "slices": runs["slices"],
                         "run": runs["run_id"].fillna(runs["source"])})


def method_note(report: ComparisonReport) -> str:
    """One paragraph saying how every number was computed (interval, test, correction, margin)."""
    o = report.options
    correction = {"holm": "Holm (family-wise)", "bh": "Benjamini–Hochberg (FDR)", "none": "no"}[o.correction]
    margin = "no margin" if o.margin is None else f"margin {100 * o.margin:g} pt"
    return (f"Paired per-item comparison of each scheme with its reference (the model as the run loaded it). "
            f"Accuracies and rates in percent, Δ = accuracy(quant) − accuracy(ref) in percentage points; its {100 * o.ci_level:g}% interval, its p-value (H0 Δ = 0) and the verdict all come from "
            f"one clustered paired score test (Tango's score statistic with a cluster-robust null variance, t on "
            f"G − 1 df); verdicts are read off the interval shown, at {margin}. {correction} correction of the p-values "
            f"across all {report.n_tests()} tests of this comparison (every scheme, slice and sub-slice), alpha "
            f"{o.alpha:g}; '*' and 'sig. (adj)' mark significance after correction. Flip-rate intervals: paired "
            f"cluster bootstrap ({o.n_resamples} resamples, seed {o.seed}) or Wilson. MDE: minimum detectable Δ at "
            f"80% power. KL in nats on gold texts.")


def speed_text_table(report: ComparisonReport) -> pd.DataFrame:
    """Speed against quality per concurrency level: speed-up [CI], Δacc [CI] or KL, on the Pareto front, in words."""
    rows = []
    for r in report.speed.to_dict("records"):
        quality = (points(r["delta"], r["delta_ci_low"], r["delta_ci_high"]) if r["quality"] == "delta"
                   else num(r["kl_mean"], ".4f"))
        rows.append({"in flight": r["concurrency"], "scheme": r["label"],
                     "speed-up [CI]": f"{num(r['speedup'], '.2f')} [{num(r['speedup_ci_low'], '.2f')}, "
                                      f"{num(r['speedup_ci_high'], '.2f')}]",
                     "Δacc pt [CI]" if r["quality"] == "delta" else "KL mean": quality,
                     "Pareto": "★ yes" if r["pareto"] else "no", "speed": r["speed"]})
    return pd.DataFrame(rows)


def speed_findings(report: ComparisonReport) -> list[str]:
    """The front per level by name, then every scheme slower than its reference, in words."""
    speed = report.speed
    if speed.empty:
        return []
    lines = []
    for level, part in speed.groupby("concurrency"):
        names = ", ".join(part.loc[part["pareto"], "label"])
        lines.append(f"Pareto front at {level} in flight (no other point as fast and as good and better in one; "
                     f"point estimates): {names}.")
    for r in speed[speed["speed"].str.startswith("SLOWER")].to_dict("records"):
        lines.append(f"{r['label']} is SLOWER than its reference at {r['concurrency']} in flight: speed-up "
                     f"{r['speedup']:.2f}× [{r['speedup_ci_low']:.2f}, {r['speedup_ci_high']:.2f}], the whole interval "
                     "below 1.")
    return lines


def measured_text_table(report: ComparisonReport) -> pd.DataFrame:
    """The ledger's predicted weight memory and decode floor beside the engine's measured ones, with the ratios."""
    rows = []
    for r in report.measured.to_dict("records"):
        rows.append({"scheme": r["label"], "side": r["side"], "ledger weights GB": num(r["predicted_weight_gb"], ".3f"),
                     "engine weights GB": num(r["measured_weight_gb"], ".3f")
                     + (f" ({r['measured_weight_from']})" if r["measured_weight_from"] else ""),
                     "measured ÷ predicted": num(r["weight_ratio"], ".2f"), "device": r["device"],
                     "ledger decode floor ms": num(r["predicted_floor_ms"], ".4f"),
                     "TPOT p50 ms": f"{num(r['measured_tpot_ms'], '.2f')} ({r['tpot_concurrency']} in flight)",
                     "measured ÷ floor": num(r["decode_ratio"], ".1f")})
    return pd.DataFrame(rows)


MEASURED_NOTE = ("Ledger: the scheme's weights and the BF16 reference's as predicted from shapes (GB = 1e9 bytes), "
                 "and the batch-1 decode floor, bytes read per token ÷ the device's peak bandwidth (a device the "
                 "ledger has no bandwidth for, such as a CPU, gets none: give perf_device=NAME:memory_GB:bandwidth_TBps). "
                 "Engine: vLLM's log (GPU: weights loaded; CPU build: checkpoint size, GiB converted) and the time "
                 "per output token at the lowest concurrency measured.")


def trace_text_table(report: ComparisonReport) -> pd.DataFrame:
    """Per thinking run and side: trace tokens (mean, median, p90, max), cap-hit and unclosed rates [CI]."""
    def rate(r: dict, what: str) -> str:
        return f"{pct(r[what])} [{pct(r[f'{what}_ci_low'])}, {pct(r[f'{what}_ci_high'])}]"

    return pd.DataFrame([{
        "scheme": r["label"], "side": r["side"], "items": r["n"], "trace tokens mean": num(r["tokens_mean"], ".0f"),
        "median": num(r["tokens_median"], ".0f"), "p90": num(r["tokens_p90"], ".0f"), "max": num(r["tokens_max"], ".0f"),
        "cap hit % [CI]": rate(r, "cap_hit"), "unclosed % [CI]": rate(r, "unclosed"),
    } for r in report.trace_stats.to_dict("records")])


def budget_text_table(report: ComparisonReport) -> pd.DataFrame:
    """Per sweep and budget: both sides' accuracy [CI], Δ [CI], verdict, non-inferior at the margin."""
    def acc(r: dict, side: str) -> str:
        return f"{pct(r[f'acc_{side}'])} [{pct(r[f'acc_{side}_ci_low'])}, {pct(r[f'acc_{side}_ci_high'])}]"

    return pd.DataFrame([{
        "sweep": r["group"], "budget": f"{r['budget_key']}={r['budget']}", "n": r["n"], "acc ref % [CI]": acc(r, "ref"),
        "acc cand % [CI]": acc(r, "quant"), "Δacc pt [CI]": points(r["delta"], r["delta_ci_low"], r["delta_ci_high"]),
        "verdict": r["verdict"], "non-inferior at margin": "yes" if r["non_inferior"] else "no",
    } for r in report.budget.to_dict("records")])


def budget_findings(report: ComparisonReport) -> list[str]:
    """Per sweep, one sentence: the smallest budget at which the candidate matches the reference, or none."""
    budget, margin = report.budget, report.options.margin
    if budget.empty:
        return []
    if margin is None:
        return ["No margin (margin=null): no budget is called a match; give margin=0.02 to read one off the intervals."]
    lines = []
    for group, part in budget.groupby("group", sort=False):
        key, matched = part["budget_key"].iloc[0], part["matched_from"].iloc[0]
        tried = ", ".join(str(b) for b in sorted(part["budget"]))
        if math.isnan(matched):
            lines.append(f"{group}: the candidate matches the reference at no budget tried ({key} = {tried}): at the "
                         f"largest, Δ's interval reaches below −{100 * margin:g} pt.")
            continue
        row = part[part["budget"] == matched].iloc[0]
        lines.append(f"{group}: the candidate matches the reference from {key}={int(matched)} on (non-inferior at "
                     f"margin {100 * margin:g} pt at that budget and every larger one tried: Δ "
                     f"{points(row['delta'], row['delta_ci_low'], row['delta_ci_high'])} pt there; budgets tried {tried}; "
                     "fixed-sequence from the largest down).")
    return lines


def caption(name: str) -> str:
    """The caption of plot ``name`` (``forest_<slice>`` for the per-sub-slice forest plots)."""
    if name.startswith("forest_"):
        return f"Δ accuracy per sub-slice of {name[len('forest_'):]}."
    return CAPTIONS.get(name, name)


# parity (simulation against served, beside both floors) is rendered where it is computed
PARITY_LEGEND = LEGEND
