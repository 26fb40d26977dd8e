"""Human-readable views of one run's comparison: the terminal table, report.md and its KL-by-position plot."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd

from harness.results.formatting import MISSING, count, flips, lower_bound_mark, num, pct, pct_pm, pm, points
from harness.results.summary import Comparison


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
            "acc ref %": pct(row["acc_ref"]), "acc quant %": pct(row["acc_quant"]),
            "Δacc pt [95% CI]": points(row["delta"], row["delta_ci_low"], row["delta_ci_high"]),
            "flips r→w / w→r": flips(row["flips_right_to_wrong"], row["flips_wrong_to_right"]),
            "p (adj)": f"{num(row['delta_p'])} ({num(row['delta_p_adj'])})",
            "verdict": row.get("verdict", ""),
            "KL mean ± SE": lower_bound_mark(tok_row) + pm(tok_row.get("kl_mean"), tok_row.get("kl_se")),
            "KL on": (tok_row["kl_on"] if isinstance(tok_row.get("kl_on"), str) else MISSING)
            + (", top-k lower bound" if lower_bound_mark(tok_row) else ""),
            "KL plain text": num(tok_row.get("kl_plain_mean"), ".4f"),
            "top-1 agree %": pct(tok_row.get("top1_agree")),
            "PPL ref → quant": f"{num(tok_row.get('ppl_ref'), '.2f')} → {num(tok_row.get('ppl_quant'), '.2f')}",
        })
    return pd.DataFrame(rows)


def divergence_lines(result: dict) -> list[str]:
    """A served candidate's line on what its token divergence is (a top-k lower bound, or none at all)."""
    line = (result.get("candidate") or {}).get("candidate.divergence")
    return [str(line)] if line else []


def simulation_lines(result: dict) -> list[str]:
    """For a scheme whose activations this run quantized in simulation: what a verdict on it leaves out."""
    acts = result.get("simulated_activations")
    if not acts:
        return []
    return [f"activations quantized in simulation ({acts}): a serving engine's kernels quantize them in their own "
            "way, and its replies can differ from these (docs/benchmarks/parity.md measures FP8 on vLLM); "
            f"`python -m harness.parity model={result['model']} quant={result['scheme']} serve=...` measures this "
            "scheme on the engine that ships it, beside the engine's own noise floor"]


def print_comparison(comparison: Comparison, result: dict) -> None:
    table = side_by_side(comparison)
    quant = result.get("quant", {})
    print()
    print(f"{result['model']}  ·  {result['scheme']} ({bits_phrase(quant)}{uncovered_note(quant)})  vs  {result.get('reference', 'the reference')}")
    print(table.to_string(index=False))
    for line in divergence_lines(result) + simulation_lines(result) + coverage_lines(result) + router_lines(result):
        print(line)
    if result.get("max_gen_toks") is not None:
        print(f"generation capped at {result['max_gen_toks']} tokens a reply (eval.max_gen_toks): a smoke run, "
              "not the tasks' own accuracies")
    for line in sequential_lines(result):
        print(line)
    print()


def bits_phrase(quant: dict) -> str:
    """``4.135 bits/weight``; a served candidate whose checkpoint the harness cannot read says so."""
    bits = quant.get("bits_per_weight")
    return "bits/weight not known: no local checkpoint" if bits is None else f"{num(bits, '.3f')} bits/weight"


def uncovered_note(quant: dict) -> str:
    """The headline's warning when ``quant.allow_uncovered=true`` let matrix weights stay unquantized."""
    share = quant.get("coverage_uncovered_share")
    return f", {share:.1%} of matrix weights NOT COVERED" if isinstance(share, (int, float)) and share > 0 else ""


def coverage_lines(result: dict) -> list[str]:
    """One line of the coverage account (harness.quant.coverage): what the scheme quantized and what it kept."""
    cov = result.get("quant", {}).get("coverage")
    if not isinstance(cov, dict):
        return []
    total = max(cov.get("total_params", 0), 1)
    kept = ", ".join(f"{rule} {params / total:.1%}" for rule, params in cov.get("kept_by_rule", {}).items())
    line = (f"coverage: {cov['quantized_share']:.1%} of the matrix weights quantized; kept by rule (share of all "
            f"parameters): {kept or 'none'}")
    if cov.get("uncovered_params"):
        line += (f"; NOT COVERED: {cov['uncovered_share']:.1%} ({', '.join(cov['uncovered'][:4])}) — "
                 "quant.allow_uncovered=true")
    return [line]


def router_lines(result: dict) -> list[str]:
    """Mixture of experts: top-k agreement with the reference's routers on each slice's divergence texts."""
    lines = []
    for name, entry in (result.get("quant", {}).get("router") or {}).items():
        if "identical_mean" not in entry:
            lines.append(f"router agreement {name}: no reference routing ({entry.get('missing_reference', 0)} texts "
                         "from a reference cached before routing was recorded)")
            continue
        lines.append(f"router agreement {name}: identical expert set {entry['identical_mean']:.3f} of tokens "
                     f"(worst layer {entry['identical_min']:.3f}, {entry['worst_layer']}), overlap "
                     f"{entry['overlap_mean']:.3f}, expert-load shift up to {entry['load_shift_max']:.3f}; agreement "
                     f"falls first at {entry['first_disagreeing_layer'] or 'no layer'}")
    return lines


def moe_markdown(result: dict) -> list[str]:
    """report.md's coverage account and, for a mixture of experts, router agreement per slice and layer."""
    cov = result.get("quant", {}).get("coverage")
    out = []
    if isinstance(cov, dict):
        out += ["## Coverage", "", *coverage_lines(result), "",
                pd.DataFrame(cov.get("rows", [])).to_markdown(index=False, floatfmt=".4g"), ""]
    router = result.get("quant", {}).get("router") or {}
    rows = [{"slice": name, **layer} for name, entry in router.items() for layer in entry.get("per_layer", [])]
    if router:
        out += ["## Router agreement (mixture of experts)", "", *router_lines(result), "",
                pd.DataFrame(rows).to_markdown(index=False, floatfmt=".4f") if rows else "", ""]
    return out


def sequential_lines(result: dict) -> list[str]:
    """Where each slice of a sequential run (eval.sequential) stopped and why; [] for a full run."""
    records = result.get("sequential") or {}
    if not records:
        return []
    from harness.evaluation.sequential_run import fraction_saved, items_line
    lines = [f"sequential (eval.sequential=true): {100 * fraction_saved(records):.0f} % of the candidate's items not "
             "needed; the table's intervals are fixed-sample on the items answered, the gate reads the confidence "
             "sequence"]
    lines += [f"  {name}: {items_line(record)}" for name, record in records.items()]
    return lines


def markdown(comparison: Comparison, result: dict, kl_plot: str | None = None) -> str:
    """The run's report.md; ``kl_plot``: file name of the :func:`plot_kl_by_position` PNG beside it, shown
    under the KL-by-position table (None: no image line)."""
    timings = ", ".join(f"{k} {v:.1f}s" for k, v in result.get("timings", {}).items())
    sub = comparison.item_stats[comparison.item_stats["level"] == "sub_slice"]
    return "\n".join([
        f"# {result['run_name']}", "",
        f"Scheme `{result['scheme']}` ({result.get('method', '')}) on `{result['model']}`; run key `{result['run_key']}`.",
        "", side_by_side(comparison).to_markdown(index=False), "",
        *[f"{line}.\n" for line in divergence_lines(result) + simulation_lines(result)],
        *moe_markdown(result),
        *([*sequential_markdown(result), "", "![sequence](sequence.png)", ""] if result.get("sequential") else []),
        "## Sub-slices", "", sub_slice_rows(sub).to_markdown(index=False) if len(sub) else "(no sub-slices)", "",
        "## Generation divergence", "", comparison.generation.to_markdown(index=False, floatfmt=".3f"), "",
        "## KL by position", "", KL_BY_POSITION_NOTE, "", _markdown_or_none(kl_by_position(comparison)), "",
        *([f"![KL by position]({kl_plot})", ""] if kl_plot else []),
        f"Timings: {timings}", "",
    ])


def sub_slice_rows(sub: pd.DataFrame) -> pd.DataFrame:
    """report.md's sub-slice table: accuracies in percent, Δ in points with its interval (one unit with the
    headline table)."""
    return pd.DataFrame([{
        "slice": r["slice"], "sub-slice": r["sub_slice"], "n": int(r["n"]), "clusters": count(r.get("n_clusters")),
        "acc ref %": pct(r["acc_ref"]), "acc quant %": pct(r["acc_quant"]),
        "Δacc pt [CI]": points(r["delta"], r["delta_ci_low"], r["delta_ci_high"]),
        "flips r→w / w→r": flips(r["flips_right_to_wrong"], r["flips_wrong_to_right"]),
        "p adj": num(r.get("delta_p_adj"), ".3g"),
    } for r in sub.to_dict("records")])


def sequential_markdown(result: dict) -> list[str]:
    """report.md's section of a sequential run: per slice the items used, the stop and the sequence."""
    rows = [{"slice": name, "items used": f"{r['items_used']}/{r['items_total']}",
             "clusters used": f"{r['clusters_used']}/{r['clusters_total']}",
             "round": f"{r['rounds_used']}/{r['rounds_total']}", "state": r["state"], "why": r["reason"],
             "Δ̂": f"{100 * r['delta']:+.1f} pt", "lower (α)": f"{100 * r['lower']:+.1f} pt",
             "upper (α/k)": f"{100 * r['upper']:+.1f} pt"} for name, r in result["sequential"].items()]
    return ["## Sequential evaluation", "",
            "The candidate answered each slice in rounds of whole clusters and stopped once the slice's "
            "confidence sequence settled the gate's decision (harness.evaluation.sequential_run); items not needed are listed "
            "in not_evaluated.parquet, not scored. The intervals above are fixed-sample, on the items answered.",
            "", pd.DataFrame(rows).to_markdown(index=False)]


KL_BY_POSITION_NOTE = ("Token divergence per slice by the scored token's position in its text (eval.position_buckets): "
                       "error that accumulates over the context, as low-bit KV caches are expected to, shows as KL "
                       "rising and top-1 agreement falling in later buckets. SEs treat tokens as independent "
                       "(optimistic). Plot: `plot_kl_by_position`.")
_BUCKET = re.compile(r"^\[\s*([-+0-9.eE]+|inf)\s*,")


def bucket_start(label: str) -> float:
    """Lower edge of a position-bucket label ``"[128, 512)"`` (as token_stats.position_buckets writes them)."""
    match = _BUCKET.match(str(label))
    if not match:
        raise ValueError(f"position bucket {label!r} is not of the form '[low, high)' written by "
                         "harness.divergence.token_stats.position_buckets")
    return float(match.group(1))


def position_rows(comparison: Comparison) -> pd.DataFrame:
    """The per-position-bucket rows of ``comparison.token_stats`` (not "all", not "overall"), in slice and
    position order; an empty frame when the run scored no tokens."""
    tokens = comparison.token_stats
    if tokens.empty or "bucket" not in tokens:
        return pd.DataFrame(columns=["slice", "bucket"])
    rows = tokens[(tokens["bucket"].astype(str) != "all") & (tokens["slice"] != "overall")].copy()
    rows["bucket"] = rows["bucket"].astype(str)
    rows["_start"] = rows["bucket"].map(bucket_start)
    order = {name: index for index, name in enumerate(dict.fromkeys(rows["slice"]))}
    rows["_slice"] = rows["slice"].map(order)
    return rows.sort_values(["_slice", "_start"]).drop(columns=["_slice", "_start"]).reset_index(drop=True)


def kl_by_position(comparison: Comparison) -> pd.DataFrame:
    """One row per (slice, position bucket): tokens, KL mean ± SE, top-1 agreement, PPL ratio."""
    rows = position_rows(comparison)
    out = []
    for row in rows.to_dict("records"):
        out.append({"slice": row["slice"], "positions": row["bucket"], "tokens": count(row.get("n_tokens")),
                    "KL mean ± SE": lower_bound_mark(row) + pm(row.get("kl_mean"), row.get("kl_se")),
                    "KL p99": lower_bound_mark(row) + num(row.get("kl_p99"), ".4f"),
                    "top-1 agree %": pct_pm(row.get("top1_agree"), row.get("top1_agree_se")),
                    "PPL ratio": num(row.get("ppl_ratio"), ".4f")})
    return pd.DataFrame(out, columns=["slice", "positions", "tokens", "KL mean ± SE", "KL p99", "top-1 agree %",
                                      "PPL ratio"])


def _markdown_or_none(table: pd.DataFrame) -> str:
    return table.to_markdown(index=False) if len(table) else "(no per-position token statistics in this run)"


def plot_sequence(records: dict, path: Path | str, *, title: str | None = None) -> Path | None:
    """PNG of a sequential run: per slice, Δ̂ and the confidence sequence's bounds (lower at α, upper at
    α/k) against the items answered, with the margin -m; None (nothing written) without records."""
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(records), figsize=(3.2 * len(records) + 0.8, 3.4), squeeze=False, sharey=True)
    for ax, (name, record) in zip(axes[0], records.items()):
        points = record["trajectory"]
        x = [pt["items"] for pt in points]
        ax.fill_between(x, [100 * pt["lower"] for pt in points], [100 * pt["upper"] for pt in points], alpha=0.25,
                        step="post", label="sequence")
        ax.plot(x, [100 * pt["delta"] for pt in points], marker="o", label="Δ̂")
        ax.axhline(-100 * record["margin"], color="crimson", linestyle="--", label="-margin")
        ax.axhline(0, color="grey", linewidth=0.6)
        ax.set_xlim(0, record["items_total"])
        ax.set_ylim(-30, 15)
        ax.set_title(f"{name}: {record['state']} at {record['items_used']}/{record['items_total']}", fontsize=9)
        ax.set_xlabel("items answered")
    axes[0][0].set_ylabel("Δ accuracy (pt)")
    axes[0][0].legend(fontsize=7, loc="lower left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_kl_by_position(comparison: Comparison, path: Path | str, *, title: str | None = None) -> Path | None:
    """PNG of mean KL(ref‖quant) by position bucket, one line per slice, ± SE bars where the SE is known.

    The y axis is logarithmic when every plotted mean is positive (slices differ by orders of
    magnitude), else linear. Returns the path, or None (and writes nothing) when there are no
    per-position rows to plot.
    """
    rows = position_rows(comparison)
    if rows.empty or "kl_mean" not in rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(sorted(rows["bucket"], key=bucket_start)))
    where = {label: index for index, label in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(7, 4))
    means = []
    for name, group in rows.groupby("slice", sort=False):
        x = [where[b] for b in group["bucket"]]
        y = group["kl_mean"].astype(float).tolist()
        se = group["kl_se"].astype(float).tolist() if "kl_se" in group else [math.nan] * len(y)
        err = [0.0 if not math.isfinite(e) else e for e in se]
        lower = [min(e, m * 0.999) if m > 0 else e for e, m in zip(err, y)]  # keep bars above zero on a log axis
        ax.errorbar(x, y, yerr=[lower, err], marker="o", capsize=3, label=str(name))
        means.extend(y)
    if means and all(m > 0 for m in means):
        ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_xlabel("token position in the text")
    ax.set_ylabel("mean KL(ref ‖ quant), nats")
    ax.set_title(title or "KL by position (± SE)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
