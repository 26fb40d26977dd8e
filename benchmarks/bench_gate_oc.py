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

``--strata`` (issue 37; ``docs/explanation/strata.md``): slices whose fixed strata differ in reference
accuracy (0.1 .. 0.9) with flips spread or concentrated in a few strata, with independent items or
random clusters inside the strata, and random cells misdeclared as strata; four candidate stratified
statistics against today's rule (the cells taken as clusters), each with and without the guard on
random clusters; ``--sequential-reps`` adds the stratified spending test's false-pass rate.
``python benchmarks/bench_gate_oc.py --strata --reps 2000 --sequential-reps 300`` (~3 min for the grid
on an idle 2-core VM, 11 min at load 6-9; the sequential part ~0.3 s per data set).

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
from harness.stats.score import effective_clusters, restricted_loss, score_z, stratified_z  # noqa: E402
from harness.stats import spending_test  # noqa: E402
from harness.stats.strata import design  # noqa: E402

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


# --- Stratified designs (issue 37): strata the slice enumerates, clusters drawn at random inside them ---------------
# (n, margin) of the stratified grid: the default job's math slice (96 items), a full-size slice, a large one.
STRATA_SIZES = [(96, 0.05), (300, 0.05), (1000, 0.02)]
STRATA_COUNTS = [4, 12]  # H: strata; reference accuracy spread evenly over 0.1 .. 0.9 across them
# Inside the strata: every item its own cluster, or 4 clusters per stratum with intra-cluster correlation ρ.
STRATA_INSIDE = [("items", 0.0), (4, 0.05), (4, 0.2), (5, 0.05), (5, 0.2)]
STRATA_FLIPS = ["spread", "concentrated"]  # concentrated: every flip in the top quarter of strata by accuracy
STRATA_PATTERNS = [("one-way", 0.0), ("both", 0.1)]
MISDECLARED = [(12, 0.05), (12, 0.2), (30, 0.05)]  # (cells, ρ): random clusters declared as strata


def stratum_rates(p_refs: np.ndarray, flipping: np.ndarray, delta: float, pattern: str,
                  flip_rate: float) -> tuple[np.ndarray, np.ndarray] | None:
    """Per stratum (loss rate given ref right, gain rate given ref wrong): nonzero only in ``flipping``
    strata, equal across them, with expected Δ = ``delta`` and overall flip rate ``flip_rate`` (equal
    stratum sizes); None if infeasible."""
    weights = np.full(p_refs.size, 1 / p_refs.size) * flipping
    right, wrong = float(np.sum(weights * p_refs)), float(np.sum(weights * (1 - p_refs)))
    if pattern == "one-way":
        if delta > 0:
            return None
        loss, gain = -delta / right, 0.0
    else:
        if flip_rate < abs(delta):
            return None
        loss, gain = (flip_rate - delta) / 2 / right, (flip_rate + delta) / 2 / wrong
    if loss > 1 or gain > 1:
        return None
    return np.where(flipping, loss, 0.0), np.where(flipping, gain, 0.0)


def simulate_strata(rng: np.random.Generator, reps: int, n: int, strata: int, inside: int | str, rho: float,
                    p_refs: np.ndarray, loss: np.ndarray, gain: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(reps, n) differences of 0/1 scores, the items' cluster ids and stratum ids. Strata are fixed
    (equal sizes, item i in stratum i mod H); inside a stratum ``inside`` clusters draw their
    accuracy and flip rates around the stratum's (Beta, intra-cluster correlation ρ), or every item
    is its own cluster ("items")."""
    stratum = np.arange(n) % strata
    if inside == "items":
        codes = np.arange(n)
        p, lam_loss, lam_gain = p_refs[stratum], loss[stratum], gain[stratum]
    else:
        codes = stratum * inside + (np.arange(n) // strata) % inside
        cells = codes.max() + 1
        cell_stratum = np.arange(cells) // inside

        def draw(means: np.ndarray) -> np.ndarray:
            out = np.empty((reps, cells))
            for h in range(strata):
                out[:, cell_stratum == h] = _beta(rng, float(means[h]), rho, (reps, inside))
            return out[:, codes]

        p, lam_loss, lam_gain = draw(p_refs), draw(loss), draw(gain)
    ref = rng.random((reps, n)) < p
    flip_u = rng.random((reps, n))
    quant = np.where(ref, flip_u >= lam_loss, flip_u < lam_gain)
    return quant.astype(float) - ref.astype(float), codes, stratum


def stratified_decisions(diffs: np.ndarray, codes: np.ndarray, strata: np.ndarray, margin: float,
                         slices: int = 5) -> dict[str, np.ndarray]:
    """Per data set, pass (and the new rule's fail) of the candidate statistics with the declared strata and
    clusters: "new" (``harness.stats.score.stratified_z``: null variance at δ_h = Δ̂_h + δ - Δ̂, scaled by
    (n - 1)/(n - H)); "nocorr" (the same without the scaling); "common" (the null variance at δ_h = δ in
    every stratum, the Miettinen–Nurminen way); "wald" (the observed within-stratum variance). All use the
    clusters' design effect and degrees of freedom of ``harness.stats.strata``."""
    n = diffs.shape[1]
    count = int(strata.max()) + 1
    n_clusters = int(codes.max()) + 1
    s_ind, c_ind = _indicator(strata, count), _indicator(codes, n_clusters)
    sizes = s_ind.sum(axis=0)
    gains, losses = np.clip(diffs, 0, None) @ s_ind, np.clip(-diffs, 0, None) @ s_ind
    resid = diffs - ((diffs @ s_ind) / sizes) @ s_ind.T
    resid_sums = resid @ c_ind
    components = design(diffs[0], codes, strata).components
    free = n_clusters - components
    cr = n_clusters / free * (resid_sums**2).sum(axis=1)  # of the sum
    iid = (resid**2).sum(axis=1) * n / (n - count)
    deff = np.where(iid > 0, np.maximum(cr / np.where(iid > 0, iid, 1), 1), 1)
    dof = np.where(deff > 1 + 1e-9, np.minimum(effective_clusters(resid_sums), free), free)
    z = stratified_z(-margin, gains, losses, sizes, deff)
    correction = (n - 1) / (n - count)
    delta = -margin
    common = sizes * (2 * restricted_loss(delta, gains, losses, sizes) + delta * (1 - delta))
    numerator = gains.sum(axis=1) - losses.sum(axis=1) - n * delta
    z_common = numerator / np.sqrt(np.maximum(common.sum(axis=1) * correction * deff, 1e-300))
    z_wald = numerator / np.sqrt(np.maximum(iid * deff, 1.0))  # iid floored at one item's worth, as the old SE
    critical = sps.t.ppf(1 - ALPHA, dof)
    return {"new_pass": z > critical, "new_fail": z < -sps.t.ppf(1 - ALPHA / slices, dof),
            "nocorr_pass": z * math.sqrt(correction) > critical, "common_pass": z_common > critical,
            "wald_pass": z_wald > critical}


def strata_grid(quick: bool):
    sizes = STRATA_SIZES[:1] + STRATA_SIZES[-1:] if quick else STRATA_SIZES
    for (n, margin), count, (inside, rho), flips, (pattern, flip_rate) in itertools.product(
            sizes, STRATA_COUNTS, STRATA_INSIDE, STRATA_FLIPS, STRATA_PATTERNS):
        if inside != "items" and n // (count * inside) < 2:
            continue
        yield {"kind": "declared", "n": n, "margin": margin, "strata": count, "inside": inside, "rho": rho,
               "flips": flips, "pattern": pattern, "flip_rate": flip_rate}
    for (n, margin), (cells, rho), (pattern, flip_rate) in itertools.product(sizes, MISDECLARED, STRATA_PATTERNS):
        if n // cells < 2:
            continue
        yield {"kind": "misdeclared", "n": n, "margin": margin, "strata": cells, "inside": "items", "rho": rho,
               "flips": "random cells", "pattern": pattern, "flip_rate": flip_rate}


def run_strata_row(rng: np.random.Generator, design_row: dict, reps: int) -> dict | None:
    """One stratified design: false pass at Δ = -m (``reps`` data sets), power at -m/2 and 0 (half as many),
    for the candidates of ``stratified_decisions`` and today's rule (the cells taken as clusters, ``decisions``)."""
    row = dict(design_row)
    n, margin, count = design_row["n"], design_row["margin"], design_row["strata"]
    p_refs = np.linspace(0.1, 0.9, count)
    top = np.argsort(p_refs)[::-1][: max(1, count // 4)]
    flipping = np.ones(count, bool) if design_row["flips"] != "concentrated" else np.isin(np.arange(count), top)
    for name, delta in (("at_margin", -margin), ("half", -margin / 2), ("zero", 0.0)):
        size = reps if name == "at_margin" else max(1, reps // 2)
        if design_row["kind"] == "misdeclared":  # the cells are random clusters (bench's original simulate)
            r = rates(0.5, delta, design_row["pattern"], design_row["flip_rate"])
            if r is None:
                return None
            diffs, cells = simulate(rng, size, n, count, design_row["rho"], 0.5, *r, False)
            codes, strata, cell_codes = np.arange(n), cells, cells
        else:
            r = stratum_rates(p_refs, flipping, delta, design_row["pattern"], design_row["flip_rate"])
            if r is None:
                return None
            diffs, codes, strata = simulate_strata(rng, size, n, count, design_row["inside"], design_row["rho"],
                                                   p_refs, *r)
            cell_codes = strata if design_row["inside"] == "items" else codes  # today: the finest cell is the cluster
        cells_count = int(cell_codes.max()) + 1
        new = stratified_decisions(diffs, codes, strata, margin)
        today = decisions(diffs, cell_codes, cells_count, margin)["new_pass"]
        key = {"at_margin": "false_pass", "half": "power_half", "zero": "power_zero"}[name]
        for rule in ("new", "nocorr", "common", "wald"):
            row[f"{key}_{rule}"] = float(new[f"{rule}_pass"].mean())
        row[f"{key}_today"] = float(today.mean())
        row[f"{key}_today_guard"] = float(today.mean()) if cells_count >= 20 else 0.0  # gate.min_clusters_pass
        # The guard after issue 37 counts random clusters, not strata: G - K + 1 (K: components of the
        # cluster-stratum graph; G without strata), and only when clusters hold several items.
        clusters = int(codes.max()) + 1
        within = clusters - design(diffs[0], codes, strata).components + 1
        row[f"{key}_new_guard"] = float(new["new_pass"].mean()) if clusters == n or within >= 20 else 0.0
        if name == "at_margin":
            row["false_fail_new"] = float(new["new_fail"].mean())
    return row


# Sequential (group-sequential spending test, harness.stats.spending_test) on stratified slices at Δ = -m: its
# false-pass rate must stay <= α (every item its own cluster; the fail side Bonferroni over 5 slices).
SEQUENTIAL_DESIGNS = [(96, 0.05, 4, "spread", "both", 0.1), (300, 0.05, 12, "concentrated", "one-way", 0.0)]


def strata_sequential(rng: np.random.Generator, reps: int) -> list[dict]:
    """False pass of the stratified spending test (and of it without strata) at Δ = -m, ``reps`` data sets each."""
    out = []
    for n, margin, count, flips, pattern, flip_rate in SEQUENTIAL_DESIGNS:
        p_refs = np.linspace(0.1, 0.9, count)
        top = np.argsort(p_refs)[::-1][: max(1, count // 4)]
        flipping = np.ones(count, bool) if flips != "concentrated" else np.isin(np.arange(count), top)
        diffs, codes, strata = simulate_strata(rng, reps, n, count, "items", 0.0, p_refs,
                                               *stratum_rates(p_refs, flipping, -margin, pattern, flip_rate))
        seeds = rng.integers(0, 1 << 31, reps)
        stratified = [spending_test(d, codes, margin, family=5, seed=int(k), strata=strata).state == "pass"
                      for d, k in zip(diffs, seeds)]
        plain = [spending_test(d, codes, margin, family=5, seed=int(k)).state == "pass" for d, k in zip(diffs, seeds)]
        out.append({"n": n, "margin": margin, "strata": count, "flips": flips, "pattern": pattern,
                    "flip_rate": flip_rate, "reps": reps, "false_pass_stratified": float(np.mean(stratified)),
                    "false_pass_unstratified": float(np.mean(plain))})
        print(out[-1], flush=True)
    return out


def strata_main(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    rows = [row for d in strata_grid(args.quick) if (row := run_strata_row(rng, d, args.reps)) is not None]
    sequential = strata_sequential(rng, args.sequential_reps) if args.sequential_reps else []
    mc_error = math.sqrt(ALPHA * (1 - ALPHA) / args.reps)
    declared = [r for r in rows if r["kind"] == "declared"]
    summary = {"designs": len(rows)}
    for rule in ("new", "new_guard", "nocorr", "common", "wald", "today", "today_guard"):
        worst = max(declared, key=lambda r: r[f"false_pass_{rule}"])
        summary[rule] = {"max_false_pass_declared": worst[f"false_pass_{rule}"],
                         "rows_above_alpha_plus_2se": sum(r[f"false_pass_{rule}"] > ALPHA + 2 * mc_error for r in declared),
                         "rows_above_alpha_plus_3se": sum(r[f"false_pass_{rule}"] > ALPHA + 3 * mc_error for r in declared),
                         "median_power_zero": float(np.median([r[f"power_zero_{rule}"] for r in declared])),
                         "median_power_half": float(np.median([r[f"power_half_{rule}"] for r in declared]))}
    result = {"command": "python benchmarks/bench_gate_oc.py " + " ".join(sys.argv[1:]), "alpha": ALPHA,
              "reps": args.reps, "mc_se_at_alpha": mc_error, "rows": rows, "summary": summary,
              "sequential": sequential,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load": os.getloadavg()},
              "seconds": round(time.perf_counter() - start, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(rows)} stratified designs x {args.reps} reps in {result['seconds']} s; MC SE at alpha {mc_error:.4f}")
    for rule, s in summary.items():
        if rule != "designs":
            print(rule, s)
    return 0


def _guarded(r: dict) -> bool:
    """Whether the gate's guard on random clusters (G - K + 1 >= 20 when clusters hold several items) admits a pass."""
    if r["kind"] == "misdeclared" or r["inside"] == "items":
        return True
    return r["strata"] * r["inside"] - r["strata"] + 1 >= 20


def strata_markdown(result: dict) -> str:
    """Tables of a ``--strata`` results file: candidates, new against today per design, misdeclared, sequential."""
    rows, se, alpha = result["rows"], result["mc_se_at_alpha"], result["alpha"]
    declared = [r for r in rows if r["kind"] == "declared"]
    admitted = [r for r in declared if _guarded(r)]
    both = [r for r in admitted if r["pattern"] == "both"]
    names = {"new": "chosen: V_h at Δ̂_h + (δ − Δ̂), times (n − 1)/(n − H)", "nocorr": "the same without (n − 1)/(n − H)",
             "common": "V_h at a common δ_h = δ", "wald": "observed within-stratum variance (Wald)"}
    lines = [f"{result['reps']} data sets per design at Δ = −m ({result['reps'] // 2} at −m/2 and 0); α = {alpha}, "
             f"Monte-Carlo SE {se:.4f}; {len(declared)} correctly declared designs, {len(admitted)} of them admitted by "
             "the guard on random clusters; power: median over the admitted designs with flips both ways.", "",
             "| candidate | max false pass | designs > α + 2 SE (all / admitted) | power Δ = 0 | power Δ = −m/2 |",
             "|---|---:|---:|---:|---:|"]
    for rule, label in names.items():
        key = f"false_pass_{rule}"
        lines.append(f"| {label} | {max(r[key] for r in declared):.3f} | "
                     f"{sum(r[key] > alpha + 2 * se for r in declared)} / {sum(r[key] > alpha + 2 * se for r in admitted)} | "
                     f"{float(np.median([r[f'power_zero_{rule}'] for r in both])):.2f} | "
                     f"{float(np.median([r[f'power_half_{rule}'] for r in both])):.2f} |")
    lines += ["", "CANDIDATES_END", "",
              "| n, m | H | inside the strata | flips | pattern | false pass new (today) | power Δ=0 new (today) | "
              "power Δ=−m/2 new (today) |", "|---|---:|---|---|---|---:|---:|---:|"]
    refused = [r for r in declared if not _guarded(r) and r["strata"] * r["inside"] < 20]
    for r in declared:
        if r in refused:  # both guards refuse every pass: nothing to show
            continue
        inside = "items" if r["inside"] == "items" else f"{r['inside']} clusters, ρ {r['rho']:g}"
        pattern = r["pattern"] if r["pattern"] == "one-way" else f"both {100 * r['flip_rate']:g} %"
        cells = [f"{r[f'{k}_new_guard']:.3f} ({r[f'{k}_today_guard']:.3f})" for k in ("false_pass", "power_zero", "power_half")]
        lines.append(f"| {r['n']}, {100 * r['margin']:g} pt | {r['strata']} | {inside} | {r['flips']} | {pattern} | "
                     + " | ".join(cells) + " |")
    lines += ["", f"Not shown: the {len(refused)} designs of 4 strata x 4 clusters (16 random clusters), where both rules "
              "refuse every pass (the guard).", "", "OC_END", "", "| n, m | random cells | ρ | pattern | false pass declared as strata | declared as clusters (today, no guard) |",
              "|---|---:|---:|---|---:|---:|"]
    for r in rows:
        if r["kind"] == "misdeclared":
            pattern = r["pattern"] if r["pattern"] == "one-way" else f"both {100 * r['flip_rate']:g} %"
            lines.append(f"| {r['n']}, {100 * r['margin']:g} pt | {r['strata']} | {r['rho']:g} | {pattern} | "
                         f"{r['false_pass_new']:.3f} | {r['false_pass_today']:.3f} |")
    lines += ["", "MISDECLARED_END", "", "| n, m | H | flips | pattern | false pass stratified | unstratified |",
              "|---|---:|---|---|---:|---:|"]
    for r in result.get("sequential", []):
        pattern = r["pattern"] if r["pattern"] == "one-way" else f"both {100 * r['flip_rate']:g} %"
        lines.append(f"| {r['n']}, {100 * r['margin']:g} pt | {r['strata']} | {r['flips']} | {pattern} | "
                     f"{r['false_pass_stratified']:.3f} | {r['false_pass_unstratified']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--out", default="benchmarks/results/gate_oc.json")
    parser.add_argument("--table", metavar="JSON", help="print the README tables of a results file and exit")
    parser.add_argument("--sequential-reps", type=int, default=0,
                        help="with --strata: data sets per design of the stratified spending test (slow: ~0.3 s each)")
    parser.add_argument("--strata", action="store_true",
                        help="the stratified designs only (docs/explanation/strata.md); default out gate_oc_strata.json")
    args = parser.parse_args(argv)
    if args.table:
        loaded = json.loads(Path(args.table).read_text())
        print((strata_markdown if loaded["rows"] and "kind" in loaded["rows"][0] else markdown)(loaded), end="")
        return 0
    if args.strata:
        if args.out == parser.get_default("out"):
            args.out = "benchmarks/results/gate_oc_strata.json"
        return strata_main(args)
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
