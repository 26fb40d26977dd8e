"""PNG plots of a comparison (:class:`harness.compare.analysis.ComparisonReport`).

Built with matplotlib's object API (``matplotlib.figure.Figure``), never pyplot, so no
backend or global state is touched and the functions work in scripts, tests and notebooks
alike. Each function returns a Figure, or None when there is nothing to draw (e.g. KL by
position needs token rows in more than one position bucket).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from harness.compare.analysis import ComparisonReport

__all__ = ["accuracy_vs_bits", "budget_curves", "flip_bars", "forest", "kl_by_position", "kl_cdf",
           "long_generation_survival", "quality_vs_speed", "render_all", "trace_lengths"]

KL_FLOOR = 1e-6  # KL of identical distributions is 0; a log axis needs a floor
MAX_CDF_POINTS = 2000  # per curve; ranks are subsampled evenly, the curve's shape is kept
_DPI = 110


def _colours(labels: list[str]) -> dict[str, tuple]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {label: cmap(i % 10) for i, label in enumerate(labels)}


def _row_name(row: pd.Series) -> str:
    if row["level"] == "overall":
        return "overall"
    if row["level"] == "slice":
        return str(row["slice"])
    return f"  {row['sub_slice']}"


def forest(stats: pd.DataFrame, labels: list[str], *, margin: float | None, title: str) -> Figure:
    """Δaccuracy with its CI, one line per (group, run); filled markers are significant after correction."""
    colours = _colours(labels)
    rows = stats.assign(_name=stats.apply(_row_name, axis=1), _run=stats["label"].map(labels.index))
    rows = rows.sort_values(["_run"]).reset_index(drop=True)
    groups = list(dict.fromkeys(rows.sort_values(["level", "slice", "sub_slice"], key=_level_key)["_name"]))
    height = max(2.5, 0.28 * len(rows) + 0.35 * len(groups) + 1.2)
    fig = Figure(figsize=(8, height))
    ax = fig.add_subplot()
    y, ticks, tick_labels = 0.0, [], []
    for group in groups:
        members = rows[rows["_name"] == group]
        for _, row in members.iterrows():
            colour = colours[row["label"]]
            delta, low, high = (100 * row[c] for c in ("delta", "delta_ci_low", "delta_ci_high"))  # points
            ax.errorbar(delta, -y, xerr=[[max(0.0, delta - low)], [max(0.0, high - delta)]],
                        fmt="o", color=colour, markerfacecolor=colour if row["significant"] else "white",
                        capsize=3, markersize=5)
            ticks.append(-y)
            tick_labels.append(f"{group.strip()} · {row['label']}")
            y += 1
        y += 0.6
    ax.axvline(0, color="black", linewidth=0.8)
    if margin:
        ax.axvspan(-100 * margin, 100 * margin, color="tab:green", alpha=0.12, label=f"±margin ({100 * margin:g} pt)")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(ticks, tick_labels, fontsize=8)
    ax.set_xlabel("Δ accuracy, points (quantized − reference), clustered score interval")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def _level_key(column: pd.Series) -> pd.Series:
    if column.name == "level":
        return column.map({"overall": 0, "slice": 1, "sub_slice": 2})
    return column.fillna("").astype(str)


def flip_bars(headline: pd.DataFrame) -> Figure:
    """Right→wrong (left, red) and wrong→right (right, green) rates per slice and run, counts annotated."""
    rows = headline.reset_index(drop=True)
    fig = Figure(figsize=(8, max(2.5, 0.32 * len(rows) + 1.2)))
    ax = fig.add_subplot()
    ypos = -np.arange(len(rows), dtype=float)
    r2w = rows["flips_right_to_wrong"].to_numpy(float) / rows["n"].to_numpy(float)
    w2r = rows["flips_wrong_to_right"].to_numpy(float) / rows["n"].to_numpy(float)
    ax.barh(ypos, -r2w, color="tab:red", label="right → wrong")
    ax.barh(ypos, w2r, color="tab:green", label="wrong → right")
    span = max(float(np.nanmax(np.concatenate([r2w, w2r, [0.01]]))), 0.01)
    for y, (_, row), left, right in zip(ypos, rows.iterrows(), r2w, w2r):
        ax.text(-left - 0.02 * span, y, str(int(row["flips_right_to_wrong"])), ha="right", va="center", fontsize=7)
        ax.text(right + 0.02 * span, y, str(int(row["flips_wrong_to_right"])), ha="left", va="center", fontsize=7)
    ax.set_xlim(-1.25 * span, 1.25 * span)
    ax.set_yticks(ypos, [f"{s} · {label}" for s, label in zip(rows["slice"], rows["label"])], fontsize=8)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("share of items that flipped (counts at the bar ends)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Flips against the reference", fontsize=10)
    fig.tight_layout()
    return fig


def _subplots(n: int, width: float = 4.2, height: float = 3.2) -> tuple[Figure, list]:
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(width * cols, height * rows))
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n)]
    return fig, axes


def kl_cdf(tokens: pd.DataFrame, labels: list[str]) -> Figure | None:
    """Empirical CDF of per-token KL(ref‖quant), one curve per run, one panel per slice and "all"."""
    if tokens.empty or "kl" not in tokens:
        return None
    colours = _colours(labels)
    panels = ["all", *sorted(tokens["slice"].unique())] if tokens["slice"].nunique() > 1 else ["all"]
    fig, axes = _subplots(len(panels))
    for ax, panel in zip(axes, panels):
        subset = tokens if panel == "all" else tokens[tokens["slice"] == panel]
        for label in labels:
            values = np.sort(np.maximum(subset.loc[subset["label"] == label, "kl"].to_numpy(float), KL_FLOOR))
            if values.size == 0:
                continue
            picks = np.unique(np.linspace(0, values.size - 1, min(values.size, MAX_CDF_POINTS)).astype(int))
            ax.step(values[picks], (picks + 1) / values.size, where="post", color=colours[label], label=label)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"KL CDF · {panel}", fontsize=10)
        ax.set_xlabel(f"KL(ref‖quant) per token, nats (floor {KL_FLOOR:g})", fontsize=8)
        ax.set_ylabel("share of tokens", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def kl_by_position(token_stats: pd.DataFrame, labels: list[str]) -> Figure | None:
    """Mean KL ± SE per position bucket for slices whose tokens span more than one bucket."""
    if token_stats.empty:
        return None
    buckets = token_stats[(token_stats["bucket"] != "all") & (token_stats["slice"] != "overall")]
    long_slices = [s for s, g in buckets.groupby("slice") if g["bucket"].nunique() > 1]
    if not long_slices:
        return None
    colours = _colours(labels)
    fig, axes = _subplots(len(long_slices), width=5.0)
    for ax, slice_name in zip(axes, long_slices):
        part = buckets[buckets["slice"] == slice_name]
        order = sorted(part["bucket"].unique(), key=_bucket_start)
        for label in labels:
            rows = part[part["label"] == label].set_index("bucket").reindex(order)
            ax.errorbar(range(len(order)), rows["kl_mean"], yerr=rows["kl_se"], marker="o", capsize=3,
                        color=colours[label], label=label)
        ax.set_xticks(range(len(order)), order, rotation=30, fontsize=7)
        ax.set_title(f"KL by token position · {slice_name}", fontsize=10)
        ax.set_ylabel("mean KL(ref‖quant) ± SE", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _bucket_start(label: str) -> float:
    match = re.match(r"\[([0-9.eE+-]+),", str(label))
    return float(match.group(1)) if match else math.inf


def accuracy_vs_bits(headline: pd.DataFrame, runs: pd.DataFrame) -> Figure | None:
    """Quantized accuracy (CI of Δ carried onto it) against bits per weight, one line per slice;
    the reference accuracy of each slice is the dashed line."""
    bits = runs.set_index("label")["bits_per_weight"]
    rows = headline.assign(bits=headline["label"].map(bits)).dropna(subset=["bits"])
    if rows.empty:
        return None
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    slices = list(dict.fromkeys(rows["slice"]))
    colours = _colours(slices)
    for slice_name in slices:
        part = rows[rows["slice"] == slice_name].sort_values("bits")
        colour = colours[slice_name]
        low = part["acc_ref"] + part["delta_ci_low"]
        high = part["acc_ref"] + part["delta_ci_high"]
        ax.errorbar(part["bits"], part["acc_quant"], yerr=[part["acc_quant"] - low, high - part["acc_quant"]],
                    marker="o", capsize=3, color=colour, label=slice_name)
        for _, row in part.iterrows():
            ax.annotate(row["label"], (row["bits"], row["acc_quant"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        ax.axhline(float(part["acc_ref"].mean()), color=colour, linestyle="--", linewidth=0.8)
    ax.set_xlabel("bits per weight (scales and zero points included)")
    ax.set_ylabel("accuracy of the quantized model")
    ax.set_title("Accuracy vs bits per weight (dashed: reference)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def long_generation_survival(survival: pd.DataFrame, labels: list[str]) -> Figure | None:
    """Fraction of long-generation replies still identical to the reference's at token t, per scheme."""
    if survival.empty:
        return None
    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot(1, 1, 1)
    colours = _colours(labels)
    for label in labels:
        curve = survival[survival["label"] == label]
        if not curve.empty:
            ax.plot(curve["position"], curve["survival"], marker="o", label=label, color=colours[label])
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("generated token t")
    ax.set_ylabel("replies identical to the reference up to t")
    ax.set_title("Long generation: survival of the reference's reply")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _errors(point: pd.Series, low: pd.Series, high: pd.Series) -> np.ndarray:
    """Asymmetric error bar lengths (a missing end draws none)."""
    return np.vstack([np.nan_to_num((point - low).to_numpy(float).clip(min=0)),
                      np.nan_to_num((high - point).to_numpy(float).clip(min=0))])


def quality_vs_speed(speed: pd.DataFrame, *, margin: float | None) -> Figure | None:
    """Δaccuracy (or mean KL) against measured speed-up, one panel per concurrency level; Pareto-optimal points
    filled, named and joined, the others hollow; the reference's own weights at (1, 0)."""
    if speed.empty:
        return None
    levels = sorted(speed["concurrency"].unique())
    fig, axes = _subplots(len(levels), width=6.0, height=4.4)
    use_delta = speed["quality"].iloc[0] == "delta"
    for ax, level in zip(axes, levels):
        part = speed[speed["concurrency"] == level]
        schemes = part[~part["is_reference"]]
        if use_delta:
            y, low, high = (100 * schemes[c] for c in ("delta", "delta_ci_low", "delta_ci_high"))
        else:
            y = low = high = schemes["kl_mean"]
        for (_, row), yy, err_x, err_y in zip(schemes.iterrows(), y, _errors(schemes["speedup"],
                                              schemes["speedup_ci_low"], schemes["speedup_ci_high"]).T,
                                              _errors(y, low, high).T):
            colour = "tab:blue" if row["pareto"] else "tab:gray"
            ax.errorbar(row["speedup"], yy, xerr=[[err_x[0]], [err_x[1]]], yerr=[[err_y[0]], [err_y[1]]], fmt="o",
                        color=colour, markerfacecolor=colour if row["pareto"] else "white", capsize=3, markersize=6)
            name = row["label"] + (" ★" if row["pareto"] else "") + (" (slower)" if row["speed"].startswith("SLOWER")
                                                                      else "")
            ax.annotate(name, (row["speedup"], yy), fontsize=7, xytext=(5, 4), textcoords="offset points",
                        fontweight="bold" if row["pareto"] else "normal")
        reference = part[part["is_reference"]].iloc[0]
        ax.plot([1.0], [0.0], marker="*", color="black", markersize=11, linestyle="none",
                label="reference (own weights)" + (" ★" if reference["pareto"] else ""))
        front = part[part["pareto"]].sort_values("speedup")
        front_y = [0.0 if r["is_reference"] else (100 * r["delta"] if use_delta else r["kl_mean"])
                   for _, r in front.iterrows()]
        ax.plot(front["speedup"], front_y, color="tab:blue", linewidth=1, alpha=0.6, label="Pareto front (★)")
        ax.axvline(1.0, color="black", linewidth=0.6, linestyle=":")
        if use_delta:
            ax.axhline(0.0, color="black", linewidth=0.6)
            if margin:
                ax.axhspan(-100 * margin, 0, color="tab:green", alpha=0.10, label=f"within −margin ({100 * margin:g} pt)")
            ax.set_ylabel("Δ accuracy, points (candidate − reference)", fontsize=8)
        else:
            ax.set_ylabel("mean KL(ref‖quant), nats (lower is better)", fontsize=8)
            ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("measured speed-up, output tokens/s ÷ reference's (log; < 1: slower)", fontsize=8)
        ax.set_title(f"Quality vs measured speed · {level} in flight", fontsize=10)
        ax.margins(x=0.12)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def trace_lengths(traces: pd.DataFrame, trace_stats: pd.DataFrame) -> Figure | None:
    """Per thinking run: the ECDF of trace tokens per item, reference and candidate overlaid; the legend carries
    each side's cap-hit and unclosed rates."""
    if traces.empty:
        return None
    labels = list(dict.fromkeys(traces["label"]))
    stats_ = trace_stats.set_index(["label", "side"])
    fig, axes = _subplots(len(labels), width=5.5, height=3.8)
    styles = {"reference": ("black", "-"), "candidate": ("tab:red", "--")}
    for ax, label in zip(axes, labels):
        for side, (colour, line) in styles.items():
            values = np.sort(traces.loc[(traces["label"] == label) & (traces["side"] == side),
                                        "trace_tokens"].to_numpy(float))
            if values.size == 0:
                continue
            row = stats_.loc[(label, side)]
            legend = (f"{side}: median {row['tokens_median']:.0f}, cap hit {100 * row['cap_hit']:.0f}%, "
                      f"unclosed {100 * row['unclosed']:.0f}% (n={values.size})")
            ax.step(np.concatenate([[0.0], values]), np.arange(values.size + 1) / values.size, where="post",
                    color=colour, linestyle=line, label=legend)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("trace tokens per item", fontsize=8)
        ax.set_ylabel("share of items with at most x", fontsize=8)
        ax.set_title(f"Thinking trace length · {label}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def budget_curves(budget: pd.DataFrame, *, margin: float | None) -> Figure | None:
    """Per budget sweep: both sides' accuracy against the budget (left) and Δ with its interval against the margin
    (right); the smallest budget where the candidate matches (fixed-sequence) marked on both."""
    if budget.empty:
        return None
    groups = list(dict.fromkeys(budget["group"]))
    fig = Figure(figsize=(11, 3.8 * len(groups)))
    for index, group in enumerate(groups):
        part = budget[budget["group"] == group].sort_values("budget")
        left, right = fig.add_subplot(len(groups), 2, 2 * index + 1), fig.add_subplot(len(groups), 2, 2 * index + 2)
        x = part["budget"].to_numpy(float)
        for side, colour, shift in (("ref", "black", 0.97), ("quant", "tab:red", 1.03)):
            name = "reference" if side == "ref" else "candidate"
            acc = 100 * part[f"acc_{side}"]
            left.errorbar(x * shift, acc, yerr=_errors(acc, 100 * part[f"acc_{side}_ci_low"],
                                                       100 * part[f"acc_{side}_ci_high"]),
                          marker="o", capsize=3, color=colour, label=name)
        delta = 100 * part["delta"]
        passed = part["non_inferior"].to_numpy(bool)
        right.errorbar(x, delta, yerr=_errors(delta, 100 * part["delta_ci_low"], 100 * part["delta_ci_high"]),
                       fmt="none", ecolor="tab:blue", capsize=3)
        right.plot(x[passed], delta[passed], "o", color="tab:blue", label="non-inferior (CI above −margin)")
        right.plot(x[~passed], delta[~passed], "o", color="tab:blue", markerfacecolor="white", label="not shown non-inferior")
        right.axhline(0, color="black", linewidth=0.6)
        if margin:
            right.axhline(-100 * margin, color="tab:green", linestyle="--", label=f"−margin ({100 * margin:g} pt)")
        matched = part["matched_from"].iloc[0]
        for ax in (left, right):
            if np.isfinite(matched):
                ax.axvline(matched, color="tab:green", linewidth=1, alpha=0.7,
                           label=f"matches from {matched:g}" if ax is left else None)
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [f"{v:g}" for v in x], fontsize=7)
            ax.minorticks_off()
            ax.set_xlabel(part["budget_key"].iloc[0] + " (tokens)", fontsize=8)
            ax.grid(alpha=0.3)
        left.set_ylabel("accuracy %", fontsize=8)
        right.set_ylabel("Δ accuracy, points", fontsize=8)
        title = "no budget tried" if not np.isfinite(matched) else f"from {matched:g}"
        left.set_title(f"{group}: accuracy vs budget", fontsize=10)
        right.set_title(f"{group}: Δ vs budget · candidate matches {title}", fontsize=10)
        left.legend(fontsize=7)
        right.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def render_all(report: ComparisonReport, out_dir: Path) -> dict[str, Path]:
    """Draw every applicable plot into ``out_dir``; returns plot name -> PNG path (in display order)."""
    labels = report.labels
    headline = report.headline()
    stats = report.item_stats
    figures: dict[str, Figure | None] = {
        "forest": forest(stats[stats["level"].isin(["overall", "slice"])], labels, margin=report.options.margin,
                         title="Δ accuracy per slice (filled: significant after correction)"),
    }
    sub = stats[stats["level"] == "sub_slice"]
    for slice_name in sorted(sub["slice"].dropna().unique()):
        figures[f"forest_{_safe(slice_name)}"] = forest(
            sub[sub["slice"] == slice_name], labels, margin=report.options.margin,
            title=f"Δ accuracy per sub-slice of {slice_name}")
    figures["flips"] = flip_bars(headline)
    figures["kl_cdf"] = kl_cdf(report.tokens, labels)
    figures["kl_by_position"] = kl_by_position(report.token_stats, labels)
    figures["accuracy_vs_bits"] = accuracy_vs_bits(headline, report.runs)
    figures["long_generation_survival"] = long_generation_survival(report.survival, labels)
    figures["quality_vs_speed"] = quality_vs_speed(report.speed, margin=report.options.margin)
    figures["trace_lengths"] = trace_lengths(report.traces, report.trace_stats)
    figures["budget_curves"] = budget_curves(report.budget, margin=report.options.margin)
    out: dict[str, Path] = {}
    for name, fig in figures.items():
        if fig is None:
            continue
        path = Path(out_dir) / f"{name}.png"
        fig.savefig(path, dpi=_DPI)
        out[name] = path
    return out


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name))
