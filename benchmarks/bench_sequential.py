"""Operating characteristics of the sequential (anytime-valid) gate, beside the fixed-sample one, by simulation.

``python benchmarks/bench_sequential.py [--reps 1000] [--quick] [--out benchmarks/results/sequential.json]
[--table JSON] [--plot PNG]``

The designs, data and true Δ are those of ``benchmarks/bench_gate_oc.py`` (its ``grid``, ``rates`` and
``simulate``: n 30-2,000, every item its own cluster or 5-50 clusters with intra-cluster correlation,
reference accuracy 0.05-0.98, flips one way or both ways, 0/1 or partial credit). For each data set
the slice is scored as :mod:`harness.stats.sequential` scores it: clusters in a uniform random order,
rounds of whole clusters of ~1/8 of the slice (at least 8 items), a look after every round, stop at
the first look that passes (running lower bound of the level-α CS > -m) or fails (running upper
bound at level α/5 < -m, Bonferroni over k = 5 slices as the gate does for a five-slice run), or
when the items run out ("open" = inconclusive). The decision at a look is read from the capital at
the margin (``log_capital``, bets tuned to the slice's G as ``sequential_test`` does; equivalent to the bounds, tested in ``tests/test_stats_sequential.py``),
so no bisection is needed per data set. Beside it, the fixed-sample gate on all n items
(``bench_gate_oc.decisions``: the clustered score test's pass and Bonferroni fail).

Per design, at true Δ = 0, -m/2, -m, -2m, -5m (where the flip pattern can produce it): the pass
rate, the fail rate and the mean fraction of the slice's items scored, sequential and fixed (the
fixed test always scores all items). False pass = pass rate at Δ = -m (must be <= α); false fail =
fail rate at Δ = -m (the least favourable point of the fail claim, must be <= α/5) and at Δ = 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gate_oc import ALPHA, decisions, grid, rates, simulate  # noqa: E402

from harness.stats.sequential import default_round_items, log_capital, look_mask  # noqa: E402

SLICES = 5  # Bonferroni family of the fail claim, as bench_gate_oc
DELTAS = [("at_0", 0.0), ("at_half_m", -0.5), ("at_m", -1.0), ("at_2m", -2.0), ("at_5m", -5.0)]  # key, Δ / m


def sequential_decisions(rng: np.random.Generator, diffs: np.ndarray, codes: np.ndarray, clusters: int,
                         margin: float) -> dict[str, np.ndarray]:
    """Per data set (rows of ``diffs``): passed, failed, and the fraction of items scored when it stopped."""
    reps, n = diffs.shape
    sizes = np.bincount(codes, minlength=clusters).astype(float)
    sums = diffs if clusters == n else diffs @ np.eye(clusters)[codes]
    order = np.argsort(rng.random((reps, clusters)), axis=1)  # a uniform random cluster order per data set
    sums, ordered = np.take_along_axis(sums, order, axis=1), sizes[order]
    mean_size, top = n / clusters, sizes.max()
    plus = np.maximum.accumulate(log_capital(sums, ordered, mean_size, -margin, ALPHA, "lower", max_size=top,
                                             horizon=clusters), axis=1)
    minus = np.maximum.accumulate(log_capital(sums, ordered, mean_size, -margin, ALPHA / SLICES, "upper",
                                              max_size=top, horizon=clusters), axis=1)
    passed, failed = plus >= math.log(1 / ALPHA), minus >= math.log(SLICES / ALPHA)
    settled = look_mask(ordered, default_round_items(n)) & (passed | failed)
    stop = np.where(settled.any(axis=1), settled.argmax(axis=1), clusters - 1)
    rows = np.arange(reps)
    passed_at = passed[rows, stop]
    return {"pass": passed_at, "fail": failed[rows, stop] & ~passed_at,
            "fraction": np.cumsum(ordered, axis=1)[rows, stop] / n}


def run_row(rng: np.random.Generator, design: dict, reps: int) -> dict:
    row = dict(design)
    margin = design["margin"]
    for name, factor in DELTAS:
        delta = factor * margin
        r = rates(design["p_ref"], delta, design["pattern"], design["flip_rate"])
        if r is None or (design["pattern"] == "both" and design["flip_rate"] < abs(delta)):
            row[name] = None
            continue
        diffs, codes = simulate(rng, reps, design["n"], design["clusters"], design["rho"], design["p_ref"], *r,
                                design["partial"])
        fixed = decisions(diffs, codes, design["clusters"], margin, slices=SLICES)
        out = sequential_decisions(rng, diffs, codes, design["clusters"], margin)
        row[name] = {"pass": float(out["pass"].mean()), "fail": float(out["fail"].mean()),
                     "fraction": float(out["fraction"].mean()),
                     "fixed_pass": float(fixed["new_pass"].mean()), "fixed_fail": float(fixed["new_fail"].mean())}
    return row


def _values(rows: list[dict], delta: str, key: str) -> list[float]:
    return [r[delta][key] for r in rows if r.get(delta) is not None]


def _design(r: dict) -> dict:
    return {k: r[k] for k in ("n", "clusters", "rho", "p_ref", "pattern", "flip_rate", "partial", "margin")}


def summarise(rows: list[dict], reps: int) -> dict:
    """Worst cases and medians over the grid."""
    se = math.sqrt(ALPHA * (1 - ALPHA) / reps)
    se_fail = math.sqrt(ALPHA / SLICES * (1 - ALPHA / SLICES) / reps)
    at_m = [r for r in rows if r["at_m"] is not None]
    worst = max(at_m, key=lambda r: r["at_m"]["pass"])
    worst_fail = max(at_m, key=lambda r: r["at_m"]["fail"])
    both = [r for r in rows if r["pattern"] == "both"]
    out = {
        "designs": len(rows), "mc_se_at_alpha": se, "mc_se_at_alpha_over_k": se_fail,
        "max_false_pass": worst["at_m"]["pass"], "max_false_pass_design": _design(worst),
        "max_false_pass_fixed": max(_values(rows, "at_m", "fixed_pass")),
        "rows_false_pass_above_alpha_plus_3se": sum(v > ALPHA + 3 * se for v in _values(rows, "at_m", "pass")),
        "rows_false_pass_above_alpha_plus_3se_fixed": sum(v > ALPHA + 3 * se for v in _values(rows, "at_m", "fixed_pass")),
        "max_false_fail_at_m": worst_fail["at_m"]["fail"], "max_false_fail_at_m_design": _design(worst_fail),
        "max_false_fail_at_m_fixed": max(_values(rows, "at_m", "fixed_fail")),
        "max_false_fail_at_0": max(_values(rows, "at_0", "fail")),
        "max_false_fail_at_0_fixed": max(_values(rows, "at_0", "fixed_fail")),
    }
    for key, _ in DELTAS:
        fractions = _values(rows, key, "fraction")
        out[f"median_fraction_{key}"] = float(np.median(fractions)) if fractions else None
        out[f"mean_fraction_{key}"] = float(np.mean(fractions)) if fractions else None
        for what in ("pass", "fixed_pass", "fail", "fixed_fail"):
            vals = _values(both, key, what)
            out[f"median_{what}_{key}_both_ways"] = float(np.median(vals)) if vals else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=20261215)
    parser.add_argument("--quick", action="store_true", help="the small grid of bench_gate_oc --quick")
    parser.add_argument("--out", default="benchmarks/results/sequential.json")
    parser.add_argument("--table", metavar="JSON", help="print the README tables of a results file and exit")
    parser.add_argument("--plot", metavar="PNG", help="with --table: also draw the figure; else draw it after the run")
    args = parser.parse_args(argv)
    if args.table:
        result = json.loads(Path(args.table).read_text())
        print(markdown(result), end="")
        if args.plot:
            plot(result, args.plot)
        return 0
    rng = np.random.default_rng(args.seed)
    load_before = os.getloadavg()
    start = time.perf_counter()
    rows = []
    for design in grid(args.quick):
        row = run_row(rng, design, args.reps)
        if row["at_m"] is not None or row["at_0"] is not None:
            rows.append(row)
    result = {
        "command": "python benchmarks/bench_sequential.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "alpha": ALPHA, "slices": SLICES, "reps": args.reps, "quick": args.quick,
        "deltas_over_margin": {k: v for k, v in DELTAS}, "summary": summarise(rows, args.reps), "rows": rows,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_before": load_before,
                    "load_after": os.getloadavg()},
        "seconds": round(time.perf_counter() - start, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    s = result["summary"]
    print(f"{s['designs']} designs x {args.reps} reps in {result['seconds']} s (load {load_before} -> "
          f"{result['machine']['load_after']})")
    print(f"false pass: sequential max {s['max_false_pass']:.4f} ({s['rows_false_pass_above_alpha_plus_3se']} rows > "
          f"alpha+3SE), fixed max {s['max_false_pass_fixed']:.4f}; false fail at -m: sequential max "
          f"{s['max_false_fail_at_m']:.4f}, fixed {s['max_false_fail_at_m_fixed']:.4f}; at 0: "
          f"{s['max_false_fail_at_0']:.4f} / {s['max_false_fail_at_0_fixed']:.4f}")
    print("median fraction of items used: " + ", ".join(f"{k} {s['median_fraction_' + k]}" for k, _ in DELTAS))
    if args.plot:
        plot(result, args.plot)
    return 0


def _structure(r: dict) -> str:
    return "each item its own" if r["clusters"] == r["n"] else f"{r['clusters']} clusters, ρ {r['rho']:g}"


def markdown(result: dict) -> str:
    """README tables: per cluster structure (rows) and (n, margin) (columns); "sequential (fixed)" cells."""
    rows = result["rows"]
    structures = list(dict.fromkeys(_structure(r) for r in rows))
    sizes = list(dict.fromkeys((r["n"], r["margin"]) for r in rows))
    header = "| clusters | " + " | ".join(f"n {n}, m {100 * m:g} pt" for n, m in sizes) + " |"
    rule = "|---|" + "---:|" * len(sizes)

    def table(cell) -> list[str]:
        out = [header, rule]
        for name in structures:
            cells = []
            for size in sizes:
                group = [r for r in rows if _structure(r) == name and (r["n"], r["margin"]) == size]
                text = cell(group) if group else None
                cells.append(text or "–")
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        return out

    def worst(delta: str, key: str, digits: int = 3):
        def cell(group):
            seq, fixed = _values(group, delta, key), _values(group, delta, "fixed_" + key)
            return f"{max(seq):.{digits}f} ({max(fixed):.{digits}f})" if seq else None
        return cell

    def median(delta: str, key: str, pattern: str | None = "both", with_fixed: bool = True):
        def cell(group):
            group = [r for r in group if pattern is None or r["pattern"] == pattern]
            seq = _values(group, delta, key)
            if not seq:
                return None
            text = f"{float(np.median(seq)):.2f}"
            return text + (f" ({float(np.median(_values(group, delta, 'fixed_' + key))):.2f})" if with_fixed else "")
        return cell

    s = result["summary"]
    lines = [f"Sequential gate vs the fixed-sample score test at the full n: sequential value, fixed in brackets; "
             f"{result['reps']} data sets per design and Δ, Monte-Carlo SE {s['mc_se_at_alpha']:.4f} at α "
             f"({s['mc_se_at_alpha_over_k']:.4f} at α/{result['slices']}).", "",
             "False-pass rate at Δ = -m, the largest over reference accuracies, flip patterns and 0/1 vs partial "
             "credit:", ""]
    lines += table(worst("at_m", "pass"))
    lines += ["", f"False-fail rate at Δ = -m (fail = upper bound at α/{result['slices']} below -m; nominal "
                  f"{ALPHA / result['slices']:g}), the largest over the same:", ""]
    lines += table(worst("at_m", "fail"))
    lines += ["", "Pass rate (power) at Δ = 0, flips both ways, median over accuracies and scoring:", ""]
    lines += table(median("at_0", "pass"))
    lines += ["", "Pass rate at Δ = -m/2, the same:", ""] + table(median("at_half_m", "pass"))
    lines += ["", "Fail rate at Δ = -2m, every flip pattern that reaches it, median:", ""]
    lines += table(median("at_2m", "fail", pattern=None))
    lines += ["", "Fail rate at Δ = -5m (one-way losses, or both ways where the flip rate reaches 5m), median:", ""]
    lines += table(median("at_5m", "fail", pattern=None))
    lines += ["", "Mean fraction of the slice's items scored before stopping, median over the designs of each "
                  "structure (the fixed test scores all):", ""]
    head = "| clusters | " + " | ".join(f"Δ = {v:g}m" if v else "Δ = 0" for _, v in DELTAS) + " |"
    lines += [head, "|---|" + "---:|" * len(DELTAS)]
    for name in structures + ["all designs"]:
        group = rows if name == "all designs" else [r for r in rows if _structure(r) == name]
        cells = []
        for key, _ in DELTAS:
            vals = _values(group, key, "fraction")
            cells.append(f"{float(np.median(vals)):.2f}" if vals else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "The same for every item its own cluster, by slice size and margin:", "", head.replace("clusters", "n, m", 1),
              "|---|" + "---:|" * len(DELTAS)]
    for n, m in sizes:
        group = [r for r in rows if r["clusters"] == r["n"] and (r["n"], r["margin"]) == (n, m)]
        cells = []
        for key, _ in DELTAS:
            vals = _values(group, key, "fraction")
            cells.append(f"{float(np.median(vals)):.2f}" if vals else "–")
        lines.append(f"| n {n}, m {100 * m:g} pt | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


PLOT_DESIGNS = [  # (label, n, clusters, p_ref, pattern, flip_rate, partial, margin)
    ("1000 items, m 2 pt", 1000, 1000, 0.5, "both", 0.2, False, 0.02),
    ("1000 items in 20 clusters, m 2 pt", 1000, 20, 0.5, "both", 0.2, False, 0.02),
    ("300 items, m 5 pt", 300, 300, 0.5, "both", 0.2, False, 0.05),
    ("100 items in 10 clusters, m 5 pt", 100, 10, 0.5, "both", 0.2, False, 0.05),
]


def plot(result: dict, path: str) -> None:
    """Fraction of items scored vs Δ/m, and pass rate vs Δ/m (sequential vs fixed), for a few designs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = 0
    for (label, n, clusters, p_ref, pattern, flip_rate, partial, margin), colour in zip(PLOT_DESIGNS, colours):
        found = [r for r in result["rows"] if (r["n"], r["clusters"], r["p_ref"], r["pattern"], r["flip_rate"],
                                               r["partial"], r["margin"]) == (n, clusters, p_ref, pattern, flip_rate,
                                                                              partial, margin)]
        if not found:
            continue
        row = found[0]
        label = f"{label}" + (f", ρ {row['rho']:g}" if clusters < n else "")
        points = [(v, row[k]) for k, v in DELTAS if row.get(k) is not None]
        x = [v for v, _ in points]
        left.plot(x, [c["fraction"] for _, c in points], "o-", color=colour, label=label)
        right.plot(x, [c["pass"] for _, c in points], "o-", color=colour, label=f"sequential: {label}")
        right.plot(x, [c["fixed_pass"] for _, c in points], "s--", color=colour, alpha=0.7, label="fixed, all items")
        drawn += 1
    left.set(xlabel="true Δ / m", ylabel="mean fraction of items scored", ylim=(0, 1.05),
             title="Items scored before the sequential gate stops")
    right.axhline(result["alpha"], color="grey", lw=0.8, ls=":")
    right.set(xlabel="true Δ / m", ylabel="pass rate", ylim=(-0.02, 1.02), title="Pass rate: sequential vs fixed")
    for ax in (left, right):
        ax.axvline(-1, color="grey", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    right.legend(fontsize=6, ncol=1)
    fig.suptitle(f"flips both ways on 20 % of items, reference accuracy 0.5, 0/1 scores (the red and orange sequential curves coincide); {result['reps']} data sets per point"
                 + ("" if drawn else " (no plotted design in this grid)"), fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
