"""Operating characteristics of the gate's non-inferiority decision, by simulation.

``python benchmarks/bench_gate_oc.py [--reps 3000] [--out benchmarks/results/gate_oc.json]``

For each design — items n, cluster structure (every item its own cluster, or G clusters with
intra-cluster correlation ρ), reference accuracy, flip pattern (one way: losses only; both ways
at a total flip rate f), 0/1 or partial-credit scores, margin m — paired data sets are drawn
with the true Δ set exactly, and the gate's accuracy criterion is applied at α = 0.05:

* **false pass**: the share of data sets declared non-inferior when the true Δ = -m (must be
  <= α within Monte-Carlo error);
* **power**: the share declared non-inferior when the true Δ = 0 and Δ = -m/2;
* **false fail** at Δ = -m: the share whose inferiority beyond the margin is claimed (Bonferroni
  over 5 slices, as the gate does for a five-slice run; must be <= α / 5).

"new" is the harness's rule (``harness.stats.score``: pass ⇔ the lower bound of the 1 - 2α
interval > -m, i.e. Z(-m) > t_{1-α, ν}, ν = G - 1, or the effective number of clusters when the
design effect exceeds 1); "g1" the same test on t_{G-1} whatever the design effect (the rule
before the effective number of clusters); "old" the rule before it (a t statistic on the CR1 cluster-robust SE, floored at
1/n, against t_{G-1}: a Wald test). The least favourable configuration of the all-slices ship
decision is simulated too: one slice at Δ = -m, four at Δ = +5 pt with 1,000 items.

The data. Items are split into G clusters of (near-)equal size. Each data set draws per cluster
a reference accuracy, a loss rate (right -> wrong) and a gain rate (wrong -> right) from Beta
distributions with the design's means and intra-cluster correlation ρ (fixed when ρ = 0), then
per item the reference's correctness and the flip. The means are chosen so that the expected Δ
is exactly the target. A partial-credit item averages four such 0/1 sub-scores that share the
item's cluster (the item's own Beta draws: sub-scores of one item are correlated).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats as sps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.stats.score import effective_clusters, score_z  # noqa: E402

ALPHA = 0.05
SUB_SCORES = 4  # sub-scores averaged into one partial-credit item


def _beta(rng: np.random.Generator, mean: float, rho: float, shape: tuple[int, ...]) -> np.ndarray:
    """Draws with the given mean and intra-class correlation ρ (Beta with a + b = 1/ρ - 1)."""
    if rho <= 0 or mean <= 0 or mean >= 1:
        return np.full(shape, mean)
    total = 1 / rho - 1
    return rng.beta(mean * total, (1 - mean) * total, size=shape)


def rates(p_ref: float, delta: float, pattern: str, flip_rate: float) -> tuple[float, float] | None:
    """(loss rate given ref right, gain rate given ref wrong) giving the target Δ; None if infeasible."""
    if pattern == "one-way":
        if delta > 0:
            return None
        loss, gain = -delta / p_ref, 0.0
    else:
        if flip_rate < abs(delta):
            return None
        loss, gain = (flip_rate - delta) / 2 / p_ref, (flip_rate + delta) / 2 / (1 - p_ref)
    return (loss, gain) if loss <= 1 and gain <= 1 else None


def simulate(rng: np.random.Generator, reps: int, n: int, clusters: int, rho: float, p_ref: float, loss: float,
             gain: float, partial: bool) -> tuple[np.ndarray, np.ndarray]:
    """(reps, n) differences quant - ref and the items' cluster ids."""
    codes = np.arange(n) % clusters
    subs = SUB_SCORES if partial else 1

    def cluster_draw(mean: float) -> np.ndarray:
        draw = _beta(rng, mean, rho, (reps, clusters))[:, codes]  # (reps, n)
        if partial:  # the sub-scores of an item share an item-level draw around its cluster's
            draw = _beta_around(rng, draw, 0.3)
        return draw

    p = cluster_draw(p_ref)[..., None]
    lam_loss = cluster_draw(loss)[..., None]
    lam_gain = cluster_draw(gain)[..., None]
    ref = rng.random((reps, n, subs)) < p
    flip_u = rng.random((reps, n, subs))
    quant = np.where(ref, flip_u >= lam_loss, flip_u < lam_gain)
    diffs = (quant.astype(float) - ref.astype(float)).mean(axis=2)
    return diffs, codes


def _beta_around(rng: np.random.Generator, means: np.ndarray, rho: float) -> np.ndarray:
    """Per-item draws around per-item means (mean-preserving; degenerate means stay fixed)."""
    out = means.astype(float).copy()
    inner = (means > 0) & (means < 1)
    total = 1 / rho - 1
    out[inner] = rng.beta(means[inner] * total, (1 - means[inner]) * total)
    return out


def _indicator(codes: np.ndarray, clusters: int) -> np.ndarray:
    indicator = np.zeros((codes.size, clusters))
    indicator[np.arange(codes.size), codes] = 1
    return indicator


def decisions(diffs: np.ndarray, codes: np.ndarray, clusters: int, margin: float, slices: int = 5) -> dict[str, np.ndarray]:
    """Per data set: new pass, new fail (Bonferroni over ``slices``), old pass."""
    n = diffs.shape[1]
    gains = np.clip(diffs, 0, None).sum(axis=1)
    losses = np.clip(-diffs, 0, None).sum(axis=1)
    if clusters == n:
        sums, sizes = diffs, np.ones(n)
    else:
        sums, sizes = diffs @ _indicator(codes, clusters), np.bincount(codes, minlength=clusters).astype(float)
    mean = diffs.mean(axis=1)
    resid = sums - mean[:, None] * sizes
    cr1 = clusters / (clusters - 1) * (resid**2).sum(axis=1)  # of the sum
    iid = diffs.var(axis=1, ddof=1) * n
    deff = np.ones_like(mean) if clusters == n else np.where(iid > 0, np.maximum(cr1 / np.where(iid > 0, iid, 1), 1), 1)
    z = score_z(-margin, gains, losses, n, deff)
    dof = np.where(deff > 1, effective_clusters(resid), clusters - 1)  # harness.stats.score.score_dof
    new_pass = z > sps.t.ppf(1 - ALPHA, dof)
    new_fail = z < -sps.t.ppf(1 - ALPHA / slices, dof)
    # Before the effective number of clusters: t on G - 1 whatever the design effect.
    g1_pass = z > sps.t.ppf(1 - ALPHA, clusters - 1)
    # Old: Wald t on the CR1 SE (floored at 1/n), t_{G-1}.
    se = np.sqrt(cr1) / n
    se = np.where(se <= 1e-9 / n, 1.0 / n, se)
    old_pass = (mean + margin) / se > sps.t.ppf(1 - ALPHA, dof)
    return {"new_pass": new_pass, "new_fail": new_fail, "old_pass": old_pass, "g1_pass": g1_pass}


# (n, margin): 5-point margins for small slices, 2-point ones from 300 items up.
SIZES_MARGINS = [(30, 0.05), (100, 0.05), (300, 0.05), (300, 0.02), (1000, 0.02), (2000, 0.02)]
# (clusters, ρ): "items" = every item its own cluster; (10, 0.2) is the concentrated-damage stress case.
STRUCTURES = [("items", 0.0), (50, 0.02), (20, 0.05), (10, 0.05), (5, 0.05), (10, 0.2)]
ACCURACIES = [0.05, 0.5, 0.9, 0.98]
PATTERNS = [("one-way", 0.0), ("both", 0.1), ("both", 0.2)]


def grid(quick: bool):
    sizes = SIZES_MARGINS if not quick else [(100, 0.05), (1000, 0.02)]
    for (n, margin), (clusters, rho), p_ref, (pattern, flip_rate), partial in itertools.product(
            sizes, STRUCTURES, ACCURACIES, PATTERNS, (False, True)):
        g = n if clusters == "items" else clusters
        if g > n or (g < n and n // g < 2):
            continue
        yield {"n": n, "clusters": g, "rho": rho, "p_ref": p_ref, "pattern": pattern, "flip_rate": flip_rate,
               "partial": partial, "margin": margin}


def run_row(rng: np.random.Generator, design: dict, reps: int) -> dict | None:
    """False pass / false fail at Δ = -m with ``reps`` data sets, power at -m/2 and 0 with half as many."""
    row = dict(design)
    for name, delta in (("at_margin", -design["margin"]), ("half", -design["margin"] / 2), ("zero", 0.0)):
        flip_rate = design["flip_rate"]
        if design["pattern"] == "both" and flip_rate < abs(delta):
            return None
        r = rates(design["p_ref"], delta, design["pattern"], flip_rate)
        if r is None:
            return None
        count = reps if name == "at_margin" else max(1, reps // 2)
        diffs, codes = simulate(rng, count, design["n"], design["clusters"], design["rho"], design["p_ref"], *r,
                                design["partial"])
        out = decisions(diffs, codes, design["clusters"], design["margin"])
        if name == "at_margin":
            row["false_pass"] = float(out["new_pass"].mean())
            row["false_pass_old"] = float(out["old_pass"].mean())
            row["false_pass_g1"] = float(out["g1_pass"].mean())
            row["false_fail"] = float(out["new_fail"].mean())
        elif name == "half":
            row["power_half"] = float(out["new_pass"].mean())
            row["power_half_g1"] = float(out["g1_pass"].mean())
        else:
            row["power_zero"] = float(out["new_pass"].mean())
            row["power_zero_old"] = float(out["old_pass"].mean())
            row["power_zero_g1"] = float(out["g1_pass"].mean())
    return row


def ship_least_favourable(rng: np.random.Generator, reps: int) -> dict:
    """All-slices rule: one slice at Δ = -m (n = 200, 20 clusters), four at +5 pt (1,000 items each)."""
    margin = 0.02
    weak, codes = simulate(rng, reps, 200, 20, 0.1, 0.6, *rates(0.6, -margin, "both", 0.1), False)
    passes = decisions(weak, codes, 20, margin)["new_pass"]
    for _ in range(4):
        good, gcodes = simulate(rng, reps, 1000, 1000, 0.0, 0.6, *rates(0.6, 0.05, "both", 0.1), False)
        passes &= decisions(good, gcodes, 1000, margin)["new_pass"]
    return {"design": "1 slice at -m (n=200, 20 clusters, rho 0.1, acc 0.6, flips 10%) + 4 slices at +5 pt (n=1000)",
            "margin": margin, "ship_rate": float(passes.mean()), "reps": reps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--out", default="benchmarks/results/gate_oc.json")
    parser.add_argument("--table", metavar="JSON", help="print the README tables of a results file and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())), end="")
        return 0
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    rows = [row for design in grid(args.quick) if (row := run_row(rng, design, args.reps)) is not None]
    mc_error = math.sqrt(ALPHA * (1 - ALPHA) / args.reps)
    worst = max(rows, key=lambda r: r["false_pass"])
    worst_old = max(rows, key=lambda r: r["false_pass_old"])
    result = {
        "command": "python benchmarks/bench_gate_oc.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "alpha": ALPHA, "reps": args.reps, "mc_se_at_alpha": mc_error, "rows": rows,
        "summary": {
            "designs": len(rows),
            "max_false_pass": worst["false_pass"], "max_false_pass_design": worst,
            "rows_above_alpha_plus_2se": sum(r["false_pass"] > ALPHA + 2 * mc_error for r in rows),
            "rows_above_alpha_plus_3se": sum(r["false_pass"] > ALPHA + 3 * mc_error for r in rows),
            "max_false_pass_old": worst_old["false_pass_old"], "max_false_pass_old_design": worst_old,
            "rows_above_alpha_plus_2se_old": sum(r["false_pass_old"] > ALPHA + 2 * mc_error for r in rows),
            "max_false_fail": max(r["false_fail"] for r in rows),
            "ship_least_favourable": ship_least_favourable(rng, args.reps),
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load": os.getloadavg()},
        "seconds": round(time.perf_counter() - start, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    s = result["summary"]
    print(f"{s['designs']} designs x {args.reps} reps in {result['seconds']} s; MC SE at alpha {mc_error:.4f}")
    print(f"false pass: new max {s['max_false_pass']:.4f} ({s['rows_above_alpha_plus_2se']} rows > alpha+2SE, "
          f"{s['rows_above_alpha_plus_3se']} > alpha+3SE); old max {s['max_false_pass_old']:.4f} "
          f"({s['rows_above_alpha_plus_2se_old']} rows > alpha+2SE)")
    print("worst new design:", {k: worst[k] for k in ("n", "clusters", "rho", "p_ref", "pattern", "flip_rate",
                                                      "partial", "margin", "false_pass")})
    print(f"max false fail {s['max_false_fail']:.4f}; ship rule least favourable: {s['ship_least_favourable']}")
    return 0



def structure(r: dict) -> str:
    """A design's cluster structure as a table row label."""
    return "each item its own" if r["clusters"] == r["n"] else f"{r['clusters']} clusters, ρ {r['rho']:g}"


def grid_table(rows: list[dict], cell) -> list[str]:
    """Markdown lines of a table with one row per cluster structure and one column per (n, margin);
    ``cell(group)`` formats the designs of a cell (None or "" shows "–")."""
    structures = list(dict.fromkeys(structure(r) for r in rows))
    sizes = list(dict.fromkeys((r["n"], r["margin"]) for r in rows))
    out = ["| clusters | " + " | ".join(f"n {n}, m {100 * m:g} pt" for n, m in sizes) + " |",
           "|---|" + "---:|" * len(sizes)]
    for name in structures:
        cells = []
        for size in sizes:
            group = [r for r in rows if structure(r) == name and (r["n"], r["margin"]) == size]
            cells.append((cell(group) if group else None) or "–")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def markdown(result: dict) -> str:
    """README tables from a results file: per cluster structure (rows) and (n, margin) (columns)."""
    rows = result["rows"]

    def table(cell) -> list[str]:
        return grid_table(rows, cell)

    def false_pass(group):
        return f"{max(r['false_pass'] for r in group):.3f} ({max(r.get('false_pass_g1', math.nan) for r in group):.3f})"

    def power(key):  # flips both ways: with flips one way Δ = 0 means no flips at all (power 1 from n ~ 100)
        def cell(group):
            both = [r[key] for r in group if r["pattern"] == "both"]
            before = [r.get(key + "_g1", math.nan) for r in group if r["pattern"] == "both"]
            return f"{float(np.median(both)):.2f} ({float(np.median(before)):.2f})" if both else "–"
        return cell

    lines = [f"False-pass rate at Δ = -m, the largest over reference accuracies {sorted({r['p_ref'] for r in rows})}, "
             "flip patterns and 0/1 vs partial credit (in brackets: the same score test on t with G - 1 degrees "
             "of freedom whatever the design effect, the rule before the effective number of clusters); "
             f"{result['reps']} data sets per design, Monte-Carlo SE {result['mc_se_at_alpha']:.4f} at α:", ""]
    lines += table(false_pass)
    lines += ["", "Power at Δ = 0, flips both ways (10 % / 20 % of items), median over accuracies and scoring:", ""]
    lines += table(power("power_zero"))
    lines += ["", "Power at Δ = -m/2, the same designs:", ""] + table(power("power_half"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
