"""Operating characteristics of the sequential (anytime-valid) gate, beside the fixed-sample one, by simulation.

``python benchmarks/bench_sequential.py [--reps 1000] [--quick] [--method betting|spending|both]
[--out benchmarks/results/sequential.json] [--table JSON] [--plot PNG]``

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

``--method spending`` (or ``both``, the default) adds the group-sequential score test of
:mod:`harness.stats.group_sequential` on the same data sets and in the same cluster order: at every
look the score test on the clusters scored so far (vectorised over data sets: ``look_statistics``,
built from ``harness.stats.score.score_z`` and ``effective_clusters`` as ``decisions`` is), pass when
Z(-m) exceeds the t quantile at the look's nominal level of Lan–DeMets O'Brien–Fleming-type spending
at α, fail when it falls below the one at α/5; checked data set by data set against ``spending_test``
in ``tests/test_stats_group_sequential.py``. Its keys in the rows are prefixed ``spending_``.

Per design, at true Δ = 0, -m/2, -m, -2m, -5m (where the flip pattern can produce it): the pass
rate, the fail rate and the mean fraction of the slice's items scored, sequential and fixed (the
fixed test always scores all items). False pass = pass rate at Δ = -m (must be <= α); false fail =
fail rate at Δ = -m (the least favourable point of the fail claim, must be <= α/5) and at Δ = 0.
"""

from __future__ import annotations

import argparse
import functools
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
from bench_gate_oc import ALPHA, decisions, grid, grid_table, rates, simulate, structure  # noqa: E402

from scipy import stats as sps  # noqa: E402

from harness.stats.group_sequential import nominal_levels  # noqa: E402
from harness.stats.score import effective_clusters, score_z  # noqa: E402
from harness.stats.sequential import default_round_items, log_capital, look_mask  # noqa: E402

SLICES = 5  # Bonferroni family of the fail claim, as bench_gate_oc
DELTAS = [("at_0", 0.0), ("at_half_m", -0.5), ("at_m", -1.0), ("at_2m", -2.0), ("at_5m", -5.0)]  # key, Δ / m


def cluster_orders(rng: np.random.Generator, reps: int, clusters: int) -> np.ndarray:
    """A uniform random cluster order per data set (reps, clusters); both methods score in it."""
    return np.argsort(rng.random((reps, clusters)), axis=1)


def _cluster_sums(values: np.ndarray, codes: np.ndarray, clusters: int) -> np.ndarray:
    return values if clusters == values.shape[1] else values @ np.eye(clusters)[codes]


def sequential_decisions(order: np.ndarray, diffs: np.ndarray, codes: np.ndarray, clusters: int,
                         margin: float) -> dict[str, np.ndarray]:
    """Betting CS, per data set (rows of ``diffs``, scored in ``order``): passed, failed, and the
    fraction of items scored when it stopped."""
    reps, n = diffs.shape
    sizes = np.bincount(codes, minlength=clusters).astype(float)
    sums = _cluster_sums(diffs, codes, clusters)
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


def ordered_cluster_sums(order: np.ndarray, diffs: np.ndarray, codes: np.ndarray, clusters: int) -> dict:
    """Per data set, in its cluster ``order``: cluster sums of d, gains, losses, d² and the cluster sizes."""
    sizes = np.bincount(codes, minlength=clusters).astype(float)
    pick = lambda values: np.take_along_axis(_cluster_sums(values, codes, clusters), order, axis=1)  # noqa: E731
    return {"sums": pick(diffs), "gains": pick(np.clip(diffs, 0, None)), "losses": pick(np.clip(-diffs, 0, None)),
            "squares": pick(diffs**2), "sizes": sizes[order], "items_own": clusters == diffs.shape[1]}


def look_statistics(ordered: dict, margin: float, seen: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Z(-m), degrees of freedom, items) of the score test on the first ``seen`` clusters of each data
    set's order (``ordered``: :func:`ordered_cluster_sums`): ``harness.stats.score.score_test`` vectorised
    over data sets, with the design effect and effective number of clusters as ``bench_gate_oc.decisions``
    computes them (deff = 1 exactly when every item is its own cluster)."""
    sums, items = ordered["sums"][:, :seen], ordered["sizes"][:, :seen]
    n = items.sum(axis=1)
    total = sums.sum(axis=1)
    mean = total / n
    iid = (ordered["squares"][:, :seen].sum(axis=1) - total**2 / n) / np.maximum(n - 1, 1) * n  # var(d, ddof=1)·n
    if ordered["items_own"]:
        deff, dof = np.ones_like(mean), n - 1
    else:
        resid = sums - mean[:, None] * items
        cr1 = seen / max(seen - 1, 1) * (resid**2).sum(axis=1)
        deff = np.where(iid > 1e-12, np.maximum(cr1 / np.where(iid > 1e-12, iid, 1), 1), 1)
        dof = np.where(deff > 1, effective_clusters(resid), seen - 1)
    z = score_z(-margin, ordered["gains"][:, :seen].sum(axis=1), ordered["losses"][:, :seen].sum(axis=1), n, deff)
    return z, dof, n


@functools.lru_cache(maxsize=256)
def _levels(fractions: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Nominal one-sided levels of the pass (α) and fail (α/k) boundaries at these looks."""
    return nominal_levels(fractions, ALPHA), nominal_levels(fractions, ALPHA / SLICES)


MIN_CLUSTERS_PASS = 20  # harness.config.GateConfig.min_clusters_pass: the gate's few-cluster guard on passes


def spending_decisions(order: np.ndarray, diffs: np.ndarray, codes: np.ndarray, clusters: int,
                       margin: float, min_clusters_pass: int = 0) -> dict[str, np.ndarray]:
    """Group-sequential score test (``harness.stats.group_sequential.spending_test``), per data set scored
    in ``order``: passed, failed, and the fraction of items scored when it stopped. ``min_clusters_pass``:
    with multi-item clusters a look passes only once it has seen that many clusters (the job and the
    gate's ``gate.min_clusters_pass``; a slice that cannot reach it never passes)."""
    reps, n = diffs.shape
    ordered = ordered_cluster_sums(order, diffs, codes, clusters)
    masks = look_mask(ordered["sizes"], default_round_items(n))
    passed, failed = np.zeros(reps, bool), np.zeros(reps, bool)
    fraction = np.ones(reps)
    patterns, which = np.unique(masks, axis=0, return_inverse=True)  # one pattern when clusters are equal
    for p, pattern in enumerate(patterns):
        rows = np.flatnonzero(which.reshape(-1) == p)
        ends = np.flatnonzero(pattern) + 1  # clusters seen at each look
        items = np.cumsum(ordered["sizes"][rows[0]])[ends - 1]
        level_pass, level_fail = _levels(tuple(items / n))
        open_ = np.ones(rows.size, bool)
        for seen, scored, lp, lf in zip(ends, items, level_pass, level_fail):
            if seen < 2 or not open_.any():
                continue
            live = rows[open_]
            z, dof, _ = look_statistics({k: (v[live] if isinstance(v, np.ndarray) else v) for k, v in ordered.items()},
                                        margin, int(seen))
            up = z > (sps.t.isf(lp, dof) if lp > 0 else np.inf)
            if clusters < n and seen < min_clusters_pass:
                up = np.zeros_like(up)
            down = ~up & (z < (-sps.t.isf(lf, dof) if lf > 0 else -np.inf))
            passed[live], failed[live] = up, down
            fraction[live] = scored / n
            open_[open_] = ~(up | down)
    return {"pass": passed, "fail": failed, "fraction": fraction}


METHODS = ("betting", "spending")


def run_row(rng: np.random.Generator, design: dict, reps: int, methods: tuple[str, ...] = METHODS) -> dict:
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
        order = cluster_orders(rng, reps, design["clusters"])
        cell = {"fixed_pass": float(fixed["new_pass"].mean()), "fixed_fail": float(fixed["new_fail"].mean())}
        guard = design["clusters"] < design["n"] and design["clusters"] < MIN_CLUSTERS_PASS
        cell["fixed_pass_guarded"] = 0.0 if guard else cell["fixed_pass"]  # the gate with gate.min_clusters_pass
        for method in methods:
            out = (sequential_decisions if method == "betting" else spending_decisions)(
                order, diffs, codes, design["clusters"], margin)
            prefix = "" if method == "betting" else "spending_"
            cell.update({prefix + "pass": float(out["pass"].mean()), prefix + "fail": float(out["fail"].mean()),
                         prefix + "fraction": float(out["fraction"].mean())})
            if method == "spending":  # as the job and the gate run it: passes need min_clusters_pass clusters
                guarded = spending_decisions(order, diffs, codes, design["clusters"], margin, MIN_CLUSTERS_PASS)
                cell.update({"spending_guarded_pass": float(guarded["pass"].mean()),
                             "spending_guarded_fail": float(guarded["fail"].mean()),
                             "spending_guarded_fraction": float(guarded["fraction"].mean())})
        row[name] = cell
    return row


def _values(rows: list[dict], delta: str, key: str) -> list[float]:
    return [r[delta][key] for r in rows if r.get(delta) is not None]


def _design(r: dict) -> dict:
    return {k: r[k] for k in ("n", "clusters", "rho", "p_ref", "pattern", "flip_rate", "partial", "margin")}


def summarise(rows: list[dict], reps: int) -> dict:
    """Worst cases and medians over the grid, per method present ("" = betting, "spending_")."""
    se = math.sqrt(ALPHA * (1 - ALPHA) / reps)
    se_fail = math.sqrt(ALPHA / SLICES * (1 - ALPHA / SLICES) / reps)
    at_m = [r for r in rows if r["at_m"] is not None]
    both = [r for r in rows if r["pattern"] == "both"]
    out = {
        "designs": len(rows), "mc_se_at_alpha": se, "mc_se_at_alpha_over_k": se_fail,
        "max_false_pass_fixed": max(_values(rows, "at_m", "fixed_pass")),
        "rows_false_pass_above_alpha_plus_3se_fixed": sum(v > ALPHA + 3 * se for v in _values(rows, "at_m", "fixed_pass")),
        "max_false_fail_at_m_fixed": max(_values(rows, "at_m", "fixed_fail")),
        "max_false_fail_at_0_fixed": max(_values(rows, "at_0", "fixed_fail")),
    }
    for key, _ in DELTAS:
        for what in ("fixed_pass", "fixed_fail"):
            vals = _values(both, key, what)
            out[f"median_{what}_{key}_both_ways"] = float(np.median(vals)) if vals else None
    out["max_false_pass_fixed_guarded"] = max(_values(rows, "at_m", "fixed_pass_guarded"))
    for prefix in ("", "spending_", "spending_guarded_"):
        if not at_m or prefix + "pass" not in at_m[0]["at_m"]:
            continue
        worst = max(at_m, key=lambda r: r["at_m"][prefix + "pass"])
        worst_fail = max(at_m, key=lambda r: r["at_m"][prefix + "fail"])
        out.update({
            f"{prefix}max_false_pass": worst["at_m"][prefix + "pass"], f"{prefix}max_false_pass_design": _design(worst),
            f"{prefix}rows_false_pass_above_alpha_plus_3se":
                sum(v > ALPHA + 3 * se for v in _values(rows, "at_m", prefix + "pass")),
            f"{prefix}max_false_fail_at_m": worst_fail["at_m"][prefix + "fail"],
            f"{prefix}max_false_fail_at_m_design": _design(worst_fail),
            f"{prefix}max_false_fail_at_0": max(_values(rows, "at_0", prefix + "fail")),
        })
        for key, _ in DELTAS:
            fractions = _values(rows, key, prefix + "fraction")
            out[f"{prefix}median_fraction_{key}"] = float(np.median(fractions)) if fractions else None
            out[f"{prefix}mean_fraction_{key}"] = float(np.mean(fractions)) if fractions else None
            for what in ("pass", "fail"):
                vals = _values(both, key, prefix + what)
                out[f"{prefix}median_{what}_{key}_both_ways"] = float(np.median(vals)) if vals else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=20261215)
    parser.add_argument("--quick", action="store_true", help="the small grid of bench_gate_oc --quick")
    parser.add_argument("--method", choices=("betting", "spending", "both"), default="both",
                        help="sequential method(s) to simulate beside the fixed test (default both)")
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
    methods = METHODS if args.method == "both" else (args.method,)
    rows = []
    for design in grid(args.quick):
        row = run_row(rng, design, args.reps, methods)
        if row["at_m"] is not None or row["at_0"] is not None:
            rows.append(row)
    result = {
        "command": "python benchmarks/bench_sequential.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "alpha": ALPHA, "slices": SLICES, "reps": args.reps, "quick": args.quick, "methods": list(methods),
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
    for method in methods:
        p = "" if method == "betting" else "spending_"
        print(f"{method}: false pass max {s[p + 'max_false_pass']:.4f} ({s[p + 'rows_false_pass_above_alpha_plus_3se']} "
              f"rows > alpha+3SE); false fail max at -m {s[p + 'max_false_fail_at_m']:.4f}, at 0 "
              f"{s[p + 'max_false_fail_at_0']:.4f}; median fraction of items: "
              + ", ".join(f"{k} {s[p + 'median_fraction_' + k]:.2f}" for k, _ in DELTAS))
    print(f"fixed: false pass max {s['max_false_pass_fixed']:.4f} ({s['rows_false_pass_above_alpha_plus_3se_fixed']} "
          f"rows > alpha+3SE); false fail max at -m {s['max_false_fail_at_m_fixed']:.4f}, at 0 "
          f"{s['max_false_fail_at_0_fixed']:.4f}")
    if args.plot:
        plot(result, args.plot)
    return 0


def _prefixes(result: dict) -> list[tuple[str, str]]:
    """(method, key prefix) of the sequential methods in a results file (older files: betting only)."""
    return [(m, "" if m == "betting" else "spending_") for m in result.get("methods", ["betting"])]


def markdown(result: dict) -> str:
    """README tables: per cluster structure (rows) and (n, margin) (columns); "betting / spending (fixed)" cells."""
    rows = result["rows"]
    prefixes = _prefixes(result)
    names = " / ".join(m for m, _ in prefixes)
    structures = list(dict.fromkeys(structure(r) for r in rows))
    sizes = list(dict.fromkeys((r["n"], r["margin"]) for r in rows))

    def table(cell) -> list[str]:
        return grid_table(rows, cell)

    def reduced(delta: str, key: str, reduce, digits: int, pattern: str | None):
        """A cell: each method's and the fixed test's ``reduce`` over the designs (of ``pattern``, None: all)."""
        def cell(group):
            group = [r for r in group if pattern is None or r["pattern"] == pattern]
            fixed = _values(group, delta, "fixed_" + key)
            if not fixed:
                return None
            seq = " / ".join(f"{float(reduce(_values(group, delta, p + key))):.{digits}f}" for _, p in prefixes)
            return f"{seq} ({float(reduce(fixed)):.{digits}f})"
        return cell

    def worst(delta: str, key: str):
        return reduced(delta, key, max, 3, None)

    def median(delta: str, key: str, pattern: str | None = "both"):
        return reduced(delta, key, np.median, 2, pattern)

    def fractions(group: list[dict], key: str) -> str:
        parts = []
        for _, p in prefixes:
            vals = _values(group, key, p + "fraction")
            parts.append(f"{float(np.median(vals)):.2f}" if vals else "–")
        return " / ".join(parts)

    s = result["summary"]
    lines = [f"Sequential gates vs the fixed-sample score test at the full n: cells read {names} (fixed); "
             "betting = the betting confidence sequence (`sequential_test`), spending = the score test at the "
             "rounds' looks with Lan–DeMets O'Brien–Fleming-type α spending (`spending_test`); "
             f"{result['reps']} data sets per design and Δ, Monte-Carlo SE {s['mc_se_at_alpha']:.4f} at α "
             f"({s['mc_se_at_alpha_over_k']:.4f} at α/{result['slices']}).", "",
             "False-pass rate at Δ = -m, the largest over reference accuracies, flip patterns and 0/1 vs partial "
             "credit:", ""]
    lines += table(worst("at_m", "pass"))
    lines += ["", f"False-fail rate at Δ = -m (fail = upper bound at α/{result['slices']} below -m; nominal "
                  f"{ALPHA / result['slices']:g}), the largest over the same:", ""]
    lines += table(worst("at_m", "fail"))
    lines += ["", "False-fail rate at Δ = 0, the largest over the same:", ""]
    lines += table(worst("at_0", "fail"))
    lines += ["", "Pass rate (power) at Δ = 0, flips both ways, median over accuracies and scoring:", ""]
    lines += table(median("at_0", "pass"))
    lines += ["", "Pass rate at Δ = -m/2, the same:", ""] + table(median("at_half_m", "pass"))
    lines += ["", "Fail rate at Δ = -2m, every flip pattern that reaches it, median:", ""]
    lines += table(median("at_2m", "fail", pattern=None))
    lines += ["", "Fail rate at Δ = -5m (one-way losses, or both ways where the flip rate reaches 5m), median:", ""]
    lines += table(median("at_5m", "fail", pattern=None))
    lines += ["", f"Mean fraction of the slice's items scored before stopping ({names}), median over the designs of "
                  "each structure (the fixed test scores all):", ""]
    head = "| clusters | " + " | ".join(f"Δ = {v:g}m" if v else "Δ = 0" for _, v in DELTAS) + " |"
    lines += [head, "|---|" + "---:|" * len(DELTAS)]
    for name in structures + ["all designs"]:
        group = rows if name == "all designs" else [r for r in rows if structure(r) == name]
        lines.append(f"| {name} | " + " | ".join(fractions(group, key) for key, _ in DELTAS) + " |")
    lines += ["", f"The same ({names}) by slice size and margin, every item its own cluster:", "",
              head.replace("clusters", "n, m", 1), "|---|" + "---:|" * len(DELTAS)]
    for n, m in sizes:
        group = [r for r in rows if r["clusters"] == r["n"] and (r["n"], r["margin"]) == (n, m)]
        lines.append(f"| n {n}, m {100 * m:g} pt | " + " | ".join(fractions(group, key) for key, _ in DELTAS) + " |")
    if len(prefixes) > 1 or prefixes[0][0] == "spending":
        lines += ["", "The same by slice size and margin, clustered designs (5-50 clusters), spending only:", "",
                  head.replace("clusters", "n, m", 1), "|---|" + "---:|" * len(DELTAS)]
        for n, m in sizes:
            group = [r for r in rows if r["clusters"] < r["n"] and (r["n"], r["margin"]) == (n, m)]
            cells = []
            for key, _ in DELTAS:
                vals = _values(group, key, "spending_fraction")
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
    """Fraction of items scored vs Δ/m, and pass rate vs Δ/m (betting, spending, fixed), for a few designs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"betting": "o-", "spending": "^--"}
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
        for method, prefix in _prefixes(result):
            left.plot(x, [c[prefix + "fraction"] for _, c in points], styles[method], color=colour,
                      label=f"{method}: {label}")
            right.plot(x, [c[prefix + "pass"] for _, c in points], styles[method], color=colour,
                       label=f"{method}: {label}")
        right.plot(x, [c["fixed_pass"] for _, c in points], "s:", color=colour, alpha=0.6, label="fixed, all items")
        drawn += 1
    left.set(xlabel="true Δ / m", ylabel="mean fraction of items scored", ylim=(0, 1.05),
             title="Items scored before the sequential gate stops")
    right.axhline(result["alpha"], color="grey", lw=0.8, ls=":")
    right.set(xlabel="true Δ / m", ylabel="pass rate", ylim=(-0.02, 1.02), title="Pass rate: sequential vs fixed")
    for ax in (left, right):
        ax.axvline(-1, color="grey", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    left.legend(fontsize=6)
    right.legend(fontsize=5, ncol=1)
    methods = " / ".join(f"{m} {styles[m]}" for m, _ in _prefixes(result))
    fig.suptitle(f"flips both ways on 20 % of items, reference accuracy 0.5, 0/1 scores; {methods}, fixed s:; "
                 f"{result['reps']} data sets per point" + ("" if drawn else " (no plotted design in this grid)"),
                 fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
