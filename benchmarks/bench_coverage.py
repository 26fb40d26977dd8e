"""Coverage of the intervals harness.stats reports, by simulation, for G = 5..50 (and 100) clusters.

Each replicate draws G clusters of 1 + Poisson(2.5) items (mean 3.5, like the math slice:
96 items in 27 clusters). Every cluster has its own difficulty (reference accuracy
a_g ~ Beta with mean 0.5, concentration 4) and its own flip propensities (r_g: right->wrong,
w_g: wrong->right, Beta with the scenario's means, concentration 2), so flips are
correlated inside clusters as they are in real slices; the "clustered flips" scenario has
clusters of 1 + Poisson(6) and concentration 0.5 (most clusters never flip, a few flip a lot). With a_g, r_g, w_g independent the
population values are exact: Δ = 0.5 w - 0.5 r, flip rate = 0.5 (r + w). The partial-credit
scenario draws item differences d = u_g + e_i (u_g ~ N(-0.02, 0.05²), e_i ~ N(0, 0.05²),
clipped to ±0.2, ref scores in [0.2, 0.8]); its Δ is the mean of the clipped normal.

For each cell it counts how often the 95% interval covers the population value, for
  reported   ``paired_compare``'s ``delta_ci`` / ``flip_rate_ci`` (bootstrap, Newcombe, Wilson or t),
  bootstrap  the plain percentile cluster bootstrap (what was reported before issue 12),
  cr1_t      Δ ± t_{G-1} · SE_CR1 without the zero-variance floor (for comparison).
The Monte Carlo SE of a coverage near 0.95 is sqrt(0.95 · 0.05 / replicates) (0.0069 at
1000). Results: benchmarks/results/coverage.json, coverage.md (the README tables), and a
Markdown table on stdout.

    python benchmarks/bench_coverage.py [replicates=1000] [n_resamples=1000] [out=...]
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats as sps

from harness import cli
from harness import stats as hstats

CLUSTER_COUNTS = (5, 10, 20, 30, 50, 100)  # 100: above BOOTSTRAP_MIN_CLUSTERS, the bootstrap regime
LEVEL = 0.95


@dataclass(frozen=True)
class Scenario:
    name: str
    right_to_wrong: float  # mean flip propensity of a right reference answer
    wrong_to_right: float
    partial: bool = False
    extra_items: float = 2.5  # cluster size is 1 + Poisson(extra_items)
    flip_concentration: float = 2.0  # Beta concentration of the flip propensities (low: strongly clustered)


SCENARIOS = (
    Scenario("many flips, Δ < 0", 0.20, 0.10),
    Scenario("many flips, Δ = 0", 0.15, 0.15),
    Scenario("clustered flips, Δ < 0", 0.20, 0.10, extra_items=6.0, flip_concentration=0.5),
    Scenario("few flips", 0.04, 0.01),
    Scenario("no flips", 0.0, 0.0),
    Scenario("partial credit", 0.0, 0.0, partial=True),
)


@dataclass
class Options:
    replicates: int = field(default=1000, metadata={"help": "simulated data sets per cell (MC SE 0.0069 at 1000)"})
    n_resamples: int = field(default=1000, metadata={"help": "bootstrap resamples per data set"})
    seed: int = field(default=0, metadata={"help": "seed of the simulation"})
    out: str = field(default="benchmarks/results/coverage.json", metadata={"help": "where the JSON goes"})


def _beta(rng: np.random.Generator, mean: float, concentration: float, size: int) -> np.ndarray:
    if mean == 0:
        return np.zeros(size)
    return rng.beta(mean * concentration, (1 - mean) * concentration, size)


def _partial_delta() -> float:
    """Mean of N(-0.02, 0.05² + 0.05²) clipped to [-0.2, 0.2], in closed form."""
    mu, sigma, bound = -0.02, math.sqrt(0.05**2 + 0.05**2), 0.2
    a, b = (-bound - mu) / sigma, (bound - mu) / sigma
    inside = mu * (sps.norm.cdf(b) - sps.norm.cdf(a)) + sigma * (sps.norm.pdf(a) - sps.norm.pdf(b))
    return float(inside - bound * sps.norm.cdf(a) + bound * sps.norm.sf(b))


def simulate(rng: np.random.Generator, scenario: Scenario, n_clusters: int) -> tuple[np.ndarray, ...]:
    """(ref, quant, cluster codes) for one replicate."""
    sizes = 1 + rng.poisson(scenario.extra_items, n_clusters)
    codes = np.repeat(np.arange(n_clusters), sizes)
    n = codes.size
    if scenario.partial:
        ref = rng.uniform(0.2, 0.8, n)
        diffs = np.clip(rng.normal(-0.02, 0.05, n_clusters)[codes] + rng.normal(0, 0.05, n), -0.2, 0.2)
        return ref, ref + diffs, codes
    ref = rng.random(n) < _beta(rng, 0.5, 4.0, n_clusters)[codes]
    concentration = scenario.flip_concentration
    flip = np.where(ref, _beta(rng, scenario.right_to_wrong, concentration, n_clusters)[codes],
                    _beta(rng, scenario.wrong_to_right, concentration, n_clusters)[codes])
    quant = np.where(rng.random(n) < flip, ~ref, ref)
    return ref.astype(float), quant.astype(float), codes


def _plain_bootstrap(codes: np.ndarray, values: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """Percentile intervals (rows: columns of ``values``) of the plain cluster bootstrap."""
    boot = hstats.paired._bootstrap_means(codes, values, n_resamples, np.random.default_rng(seed))
    tail = (1 - LEVEL) / 2
    return np.quantile(boot, [tail, 1 - tail], axis=0).T


def run_cell(scenario: Scenario, n_clusters: int, options: Options, rng: np.random.Generator) -> dict:
    if scenario.partial:
        true_delta, true_flips = _partial_delta(), math.nan
    else:
        true_delta = 0.5 * scenario.wrong_to_right - 0.5 * scenario.right_to_wrong
        true_flips = 0.5 * (scenario.right_to_wrong + scenario.wrong_to_right)
    hits = {"reported": 0, "bootstrap": 0, "cr1_t": 0}
    widths = {"reported": 0.0, "bootstrap": 0.0, "cr1_t": 0.0}
    flip_hits = {"reported": 0, "bootstrap": 0}
    methods: dict[str, int] = {}
    items = zero_discordant = 0
    t_quantile = float(sps.t.ppf(1 - (1 - LEVEL) / 2, n_clusters - 1))
    for rep in range(options.replicates):
        ref, quant, codes = simulate(rng, scenario, n_clusters)
        result = hstats.paired_compare(ref, quant, clusters=codes, n_resamples=options.n_resamples, seed=rep,
                                       ci_level=LEVEL)
        diffs = quant - ref
        flips = (ref >= 0.5) != (quant >= 0.5)
        plain = _plain_bootstrap(codes, np.column_stack([diffs, flips]).astype(float), options.n_resamples, rep)
        half = t_quantile * math.sqrt(hstats.intervals.clustered_variance(codes, diffs))
        intervals = {"reported": result.delta_ci, "bootstrap": tuple(plain[0]),
                     "cr1_t": (result.delta - half, result.delta + half)}
        for name, (low, high) in intervals.items():
            hits[name] += low <= true_delta <= high
            widths[name] += high - low
        if not scenario.partial:
            flip_hits["reported"] += result.flip_rate_ci[0] <= true_flips <= result.flip_rate_ci[1]
            flip_hits["bootstrap"] += plain[1][0] <= true_flips <= plain[1][1]
        methods[result.ci_method] = methods.get(result.ci_method, 0) + 1
        items += ref.size
        zero_discordant += int(flips.sum() == 0)
    r = options.replicates
    return {
        "scenario": scenario.name, "clusters": n_clusters, "mean_items": items / r,
        "true_delta": true_delta, "true_flip_rate": None if scenario.partial else true_flips,
        "share_without_flips": zero_discordant / r,
        "coverage": {k: v / r for k, v in hits.items()},
        "mean_width": {k: v / r for k, v in widths.items()},
        "flip_rate_coverage": None if scenario.partial else {k: v / r for k, v in flip_hits.items()},
        "ci_methods": {k: v / r for k, v in sorted(methods.items())},
    }


def markdown(cells: list[dict], replicates: int) -> str:
    lines = [f"| scenario | G | items | no flips | Δ cover (reported) | Δ cover (plain bootstrap) | Δ cover (CR1 t) "
             f"| width reported / bootstrap | flip-rate cover reported / bootstrap | Δ interval used |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in cells:
        cov, width, flip = c["coverage"], c["mean_width"], c["flip_rate_coverage"]
        flip_text = "–" if flip is None else f"{flip['reported']:.3f} / {flip['bootstrap']:.3f}"
        used = ", ".join(f"{k} {v:.0%}" for k, v in c["ci_methods"].items())
        lines.append(f"| {c['scenario']} | {c['clusters']} | {c['mean_items']:.0f} | {c['share_without_flips']:.0%} "
                     f"| {cov['reported']:.3f} | {cov['bootstrap']:.3f} | {cov['cr1_t']:.3f} "
                     f"| {width['reported']:.3f} / {width['bootstrap']:.3f} | {flip_text} | {used} |")
    se = math.sqrt(LEVEL * (1 - LEVEL) / replicates)
    lines.append(f"\n{replicates} replicates per row; Monte Carlo SE of a coverage near 0.95: {se:.4f} "
                 f"(±{1.96 * se:.3f} at 95%).")
    return "\n".join(lines)


def summary_markdown(result: dict) -> str:
    """Compact tables for the README: coverage of Δ and of the flip rate, reported (plain bootstrap)."""
    clusters = sorted({c["clusters"] for c in result["cells"]})
    by_scenario: dict[str, dict[int, dict]] = {}
    for cell in result["cells"]:
        by_scenario.setdefault(cell["scenario"], {})[cell["clusters"]] = cell
    head = "| scenario | " + " | ".join(f"G = {g}" for g in clusters) + " |\n|---|" + "---:|" * len(clusters)
    parts = []
    for title, key in (("Δ", "coverage"), ("flip rate", "flip_rate_coverage")):
        lines = [f"Coverage of the reported 95% interval of {title} (plain percentile cluster bootstrap in brackets):",
                 "", head]
        for name, cells in by_scenario.items():
            if cells[clusters[0]][key] is None:
                continue
            values = [f"{cells[g][key]['reported']:.3f} ({cells[g][key]['bootstrap']:.3f})" for g in clusters]
            lines.append(f"| {name} | " + " | ".join(values) + " |")
        parts.append("\n".join(lines))
    widths = ["| scenario | " + " | ".join(f"G = {g}" for g in clusters) + " |", "|---|" + "---:|" * len(clusters)]
    for name, cells in by_scenario.items():
        values = [f"{cells[g]['mean_width']['reported']:.3f} ({cells[g]['mean_width']['bootstrap']:.3f})"
                  for g in clusters]
        widths.append(f"| {name} | " + " | ".join(values) + " |")
    parts.append("Mean width of the Δ interval, reported (plain bootstrap):\n\n" + "\n".join(widths))
    se = result["monte_carlo_se"]
    parts.append(f"{result['replicates']} replicates per cell, {result['n_resamples']} bootstrap resamples; Monte "
                 f"Carlo SE of a coverage near 0.95: {se:.4f} (±{1.96 * se:.3f}). Bootstrap used from "
                 f"{result['bootstrap_min_clusters']} clusters; `python benchmarks/bench_coverage.py` "
                 f"({result['seconds']:.0f} s).")
    return "\n\n".join(parts) + "\n"


def body(parsed: cli.Parsed[Options]) -> int:
    options = parsed.options
    if options.replicates < 10 or options.n_resamples < 100:
        raise cli.UsageError(f"replicates={options.replicates}, n_resamples={options.n_resamples}: "
                             "use replicates >= 10 and n_resamples >= 100")
    rng = np.random.default_rng(options.seed)
    start = time.perf_counter()
    cells = [run_cell(s, g, options, rng) for s in SCENARIOS for g in CLUSTER_COUNTS]
    seconds = time.perf_counter() - start
    result = {
        "level": LEVEL, "replicates": options.replicates, "n_resamples": options.n_resamples, "seed": options.seed,
        "monte_carlo_se": math.sqrt(LEVEL * (1 - LEVEL) / options.replicates), "seconds": round(seconds, 1),
        "bootstrap_min_clusters": hstats.BOOTSTRAP_MIN_CLUSTERS,
        "bootstrap_min_event_clusters": hstats.BOOTSTRAP_MIN_EVENT_CLUSTERS, "cells": cells,
    }
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(summary_markdown(result))
    print(markdown(cells, options.replicates))
    print(f"\n{seconds:.0f} s; wrote {out}")
    return 0


TOOL = cli.Tool(prog="python benchmarks/bench_coverage.py", summary=__doc__.split("\n\n")[0], options=Options)

if __name__ == "__main__":
    sys.exit(cli.main(TOOL, body))
