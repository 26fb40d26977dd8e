"""Does the KL order schemes as their accuracy does? Served-format vs plain-text KL (issue 24).

Reads finished runs of ``python -m harness`` (their ``summary.json``, ``config.json``,
``items.parquet``, ``tokens.parquet``; the runs are made by the harness's own CLI, e.g.
``python -m harness -m quant=gptq_w4g128,awq_w4g128 quant.calibration.format=plain,chat``) and prints,
per run and slice: accuracy of both sides, flips, the served-format KL (the headline ``kl_mean``:
reply positions of prompt-as-evaluated + the reference's own reply), the plain-text KL
(``kl_plain_mean``: gold texts, no chat template) and the KL on the served prompts' positions.

Then, across every (run, slice) point, Spearman's rank correlation of each KL with the accuracy
drop (reference − quantized), with a 95% percentile interval from a paired bootstrap: each
resample draws a slice's items with replacement (an item's accuracy on both sides and its served
text's reply tokens together, so the drop and the served KL move jointly) and its plain texts
independently, and recomputes every point's drop and token-weighted mean KL.

    python benchmarks/bench_served_kl.py /tmp/served/smolresults [out=benchmarks/results/served_kl.json]
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.stats import spearmanr

from harness import cli

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Options:
    runs: list[str] = field(default_factory=list, metadata={"help": "results dirs (or folders of them)"})
    n_resamples: int = field(default=2000, metadata={"help": "bootstrap resamples"})
    seed: int = field(default=0, metadata={"help": "bootstrap seed"})
    out: str = field(default=str(RESULTS / "served_kl.json"), metadata={"help": "JSON written here"})


# What is ranked against the accuracy drop: (token kind, per-token value); a mean over the kind's tokens.
MEASURES = {
    "served KL": ("reply", lambda t: t["kl"]),
    "plain KL": ("plain", lambda t: t["kl"]),
    "served prompt KL": ("prompt", lambda t: t["kl"]),
    "served top-1 disagreement": ("reply", lambda t: (t["top1_ref"] != t["top1_quant"]).astype(float)),
    "served NLL increase": ("reply", lambda t: t["nll_quant"] - t["nll_ref"]),
}


@dataclass
class Point:
    """One run on one slice: per-item correctness and per-text sums of each measure, aligned for resampling."""

    label: str
    slice: str
    correct_ref: np.ndarray  # [items]
    correct_quant: np.ndarray  # [items]
    sums: dict  # measure -> (per-unit sums, per-unit token counts); units: items (served kinds) or plain texts
    row: dict


def _run_dirs(paths: list[str]) -> list[Path]:
    found = []
    for path in map(Path, paths):
        found += [path] if (path / "summary.json").exists() else sorted(p.parent for p in path.glob("*/summary.json"))
    if not found:
        raise cli.UsageError(f"no finished runs (summary.json) under {paths}; give results dirs of python -m harness")
    return found


def _label(config: dict) -> str:
    quant = config["quant"]
    if quant["method"] == "rtn":  # no calibration (the presets measured here have no static scales)
        return quant["name"]
    fmt = quant["calibration"].get("format", "auto")
    if fmt == "auto":
        fmt = "chat" if config["model"]["chat_template"] else "plain"
    return f"{quant['name']} · {fmt} calib."


def load_points(directory: Path) -> list[Point]:
    summary = json.loads((directory / "summary.json").read_text())
    config = json.loads((directory / "config.json").read_text())
    items = pd.read_parquet(directory / "items.parquet")
    tokens = pd.read_parquet(directory / "tokens.parquet")
    label, metrics, points = _label(config), summary["metrics"], []
    for name, group in items.groupby("slice", sort=False):
        slice_tokens = tokens[tokens["slice"] == name]
        served_texts = slice_tokens.loc[slice_tokens["kind"] != "plain", "text"].drop_duplicates().sort_values()
        plain_texts = slice_tokens.loc[slice_tokens["kind"] == "plain", "text"].drop_duplicates().sort_values()
        if len(served_texts) != len(group):
            raise cli.UsageError(f"{directory}: {len(served_texts)} served texts for {len(group)} items of {name}; "
                                 "the bootstrap pairs them item by item (run with served_texts unset)")
        sums = {}
        for measure, (kind, value) in MEASURES.items():
            rows = slice_tokens[slice_tokens["kind"] == kind]
            per_text = rows.assign(v=value(rows)).groupby("text")["v"].agg(["sum", "count"])
            units = plain_texts if kind == "plain" else served_texts
            per_text = per_text.reindex(units.to_numpy(), fill_value=0)
            sums[measure] = (per_text["sum"].to_numpy(float), per_text["count"].to_numpy(float))
        m = {key.split("/", 1)[1]: value for key, value in metrics.items() if key.startswith(f"{name}/")}
        row = {"run": label, "slice": name, "n": len(group), "acc_ref": m.get("acc_ref"), "acc_quant": m.get("acc_quant"),
               "flips_r_w": m.get("flips_right_to_wrong"), "flips_w_r": m.get("flips_wrong_to_right"),
               "kl_served": m.get("kl_mean"), "kl_plain": m.get("kl_plain_mean"), "kl_prompt": m.get("kl_prompt_mean"),
               "top1_served": m.get("top1_agree"), "top1_plain": m.get("top1_agree_plain"),
               "ppl_ratio_served": m.get("ppl_ratio"), "reply_tokens": m.get("n_tokens"), "dir": directory.name}
        points.append(Point(label, name, group["correct_ref"].to_numpy(float), group["correct_quant"].to_numpy(float),
                            sums, row))
    return points


def _spearman(x: list[float], y: list[float]) -> float:
    value = spearmanr(x, y).statistic
    return float(value) if value is not None and math.isfinite(value) else float("nan")


def _within_slices(values: list[float], drop: list[float], slices: list[str]) -> tuple[float, dict[str, float]]:
    """Spearman across the runs of each slice (slices with 3 runs or more), and their mean.

    Pooled over slices, a measure can rank the points by slice (multilingual has the largest KL
    and a small drop for every scheme) rather than by scheme; within a slice only the schemes differ.
    """
    per = {}
    for name in dict.fromkeys(slices):
        at = [k for k, s in enumerate(slices) if s == name]
        if len(at) >= 3:
            per[name] = _spearman([values[k] for k in at], [drop[k] for k in at])
    finite = [v for v in per.values() if math.isfinite(v)]
    return (float(np.mean(finite)) if finite else float("nan")), per


def rank_correlations(points: list[Point], n_resamples: int, seed: int) -> dict[str, dict[str, float]]:
    """Spearman of each measure with the accuracy drop across points (pooled, and the mean of the
    within-slice correlations), with bootstrap intervals."""
    def drop_and_measures(item_idx: dict[str, np.ndarray], text_idx: dict[str, np.ndarray]) -> tuple[list, dict]:
        drop, values = [], {measure: [] for measure in MEASURES}
        for p in points:
            i = item_idx[p.slice]
            drop.append(p.correct_ref[i].mean() - p.correct_quant[i].mean())
            for measure, (kind, _) in MEASURES.items():
                index = text_idx[p.slice] if kind == "plain" else i
                total, count = p.sums[measure]
                values[measure].append(total[index].sum() / max(count[index].sum(), 1))
        return drop, values

    sizes = {p.slice: (len(p.correct_ref), len(p.sums["plain KL"][0])) for p in points}
    drop, values = drop_and_measures({s: np.arange(n) for s, (n, _) in sizes.items()},
                                     {s: np.arange(k) for s, (_, k) in sizes.items()})
    rng = np.random.default_rng(seed)
    slices = [p.slice for p in points]
    draws: dict[str, list[float]] = {measure: [] for measure in MEASURES}
    within_draws: dict[str, list[float]] = {measure: [] for measure in MEASURES}
    for _ in range(n_resamples):
        b_drop, b_values = drop_and_measures({s: rng.integers(0, n, n) for s, (n, _) in sizes.items()},
                                             {s: rng.integers(0, k, k) for s, (_, k) in sizes.items()})
        for measure in MEASURES:
            draws[measure].append(_spearman(b_values[measure], b_drop))
            within_draws[measure].append(_within_slices(b_values[measure], b_drop, slices)[0])

    def interval(sample: list[float]) -> tuple[float, float, float]:
        finite = np.asarray(sample)[np.isfinite(sample)]
        return float(np.percentile(finite, 2.5)), float(np.percentile(finite, 97.5)), float(np.mean(finite > 0))

    out = {}
    for measure in MEASURES:
        low, high, positive = interval(draws[measure])
        within, per_slice = _within_slices(values[measure], drop, slices)
        w_low, w_high, w_positive = interval(within_draws[measure])
        out[measure] = {"spearman": _spearman(values[measure], drop), "ci_low": low, "ci_high": high,
                        "n_points": len(points), "share_positive": positive,
                        "within_slice": within, "within_ci_low": w_low, "within_ci_high": w_high,
                        "within_share_positive": w_positive, "per_slice": per_slice,
                        "values": {f"{p.label} | {p.slice}": v for p, v in zip(points, values[measure])}}
    return out


def _body(parsed: cli.Parsed[Options]) -> int:
    options = parsed.options
    points = [p for directory in _run_dirs(options.runs) for p in load_points(directory)]
    table = pd.DataFrame([p.row for p in points]).sort_values(["slice", "run"])
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(table.drop(columns="dir").to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    correlations = rank_correlations(points, options.n_resamples, options.seed)
    for name, c in correlations.items():
        print(f"Spearman({name}, accuracy drop) over {c['n_points']} points: {c['spearman']:+.3f} "
              f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}] (share of resamples > 0: {c['share_positive']:.2f}); "
              f"within slices (mean of {len(c['per_slice'])}): {c['within_slice']:+.3f} "
              f"[{c['within_ci_low']:+.3f}, {c['within_ci_high']:+.3f}]; "
              + ", ".join(f"{k} {v:+.2f}" for k, v in c["per_slice"].items()))
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(json.dumps({"runs": table.to_dict("records"), "rank_correlation": correlations,
                                             "n_resamples": options.n_resamples, "seed": options.seed},
                                            indent=1, default=str))
    print(f"wrote {options.out}")
    return 0


TOOL = cli.Tool(prog="python benchmarks/bench_served_kl.py", options=Options, positional="runs",
                summary="Served-format vs plain-text KL of finished runs, and how each ranks the runs' accuracy drop "
                        "(Spearman with a paired bootstrap interval).")


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
