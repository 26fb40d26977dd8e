"""The judge gate's operating characteristic: how often ``gate.judge_loss_max`` passes a candidate that is exactly at
the limit (a false pass), on simulated prompt logs of realistic shape.

Each simulated log has ``n`` prompts in clusters (conversations, users) of 1 to 5 prompts, drawn uniformly; the
clusters fall in ``strata`` use cases. A cluster draws its own win / tie / loss probabilities from a Dirichlet centred
on the true rates with concentration ``kappa`` (2: strongly alike prompts within a conversation; 20: nearly
independent), so the true loss − win over the population is exactly the limit. Each prompt then draws its outcome.
The run goes through the harness's own code: :func:`harness.evaluation.judge_stats.judge_metrics` (the clustered,
stratified paired score interval at compare.ci_level 0.95) and :func:`harness.decision.criteria.judge_outcome`
(pass when the interval's upper end is at or below the limit). A 95 % two-sided interval puts 2.5 % nominally above
its upper end, so the false-pass rate should be near 2.5 %. Each row also gives the pass rate of a candidate 10 points
better than the limit (the gate's power there).

    python benchmarks/bench_judge_gate.py --runs 500 --out benchmarks/results/judge_gate_oc.json
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np
import pandas as pd

from harness.decision.criteria import judge_outcome
from harness.evaluation.judge_stats import judge_metrics

PASS = "pass"


def simulated_log(rng: np.random.Generator, n: int, win: float, loss: float, kappa: float, strata: int) -> pd.DataFrame:
    """One simulated judged prompt log: the outcome columns judge_stats reads (module docstring)."""
    sizes = []
    while sum(sizes) < n:
        sizes.append(int(rng.integers(1, 6)))
    sizes[-1] -= sum(sizes) - n
    centre = np.array([win, 1 - win - loss, loss])
    outcomes, clusters, cells = [], [], []
    for index, size in enumerate(sizes):
        probabilities = rng.dirichlet(kappa * centre)
        outcomes.append(rng.choice(3, size=size, p=probabilities))
        clusters += [f"c{index}"] * size
        cells += [f"s{index % strata}"] * size
    drawn = np.concatenate(outcomes)
    frame = pd.DataFrame({"slice": "prompts", "cluster": clusters, "stratum": cells, "sub_slice": cells,
                          "identical": 0, "outcome": np.array(["win", "tie", "loss"])[drawn],
                          "win": (drawn == 0).astype(int), "tie": (drawn == 1).astype(int),
                          "loss": (drawn == 2).astype(int), "consistent": 1.0, "first_chosen": 1, "decisive": 2})
    return frame


def pass_rate(runs: int, n: int, true_loss_minus_win: float, limit: float, tie: float, kappa: float, strata: int,
              seed: int, min_items: int = 30) -> tuple[int, int]:
    """(passes, runs) of the gate at ``limit`` on logs whose true loss − win is ``true_loss_minus_win``."""
    win = (1 - tie - true_loss_minus_win) / 2
    loss = win + true_loss_minus_win
    rng = np.random.default_rng(seed)
    passes = 0
    for _ in range(runs):
        metrics = judge_metrics(simulated_log(rng, n, win, loss, kappa, strata), ci_level=0.95)
        get = metrics.get
        outcome = judge_outcome(get("prompts/judge_loss_minus_win"), get("prompts/judge_loss_minus_win_ci_low"),
                                get("prompts/judge_loss_minus_win_ci_high"), get("prompts/judge_decided"), limit,
                                min_items)
        passes += outcome == PASS
    return passes, runs


def wilson(successes: int, total: int, z: float = 1.96) -> list[float]:
    p = successes / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--sizes", type=int, nargs="+", default=[60, 120, 250, 500])
    parser.add_argument("--limit", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/judge_gate_oc.json"))
    args = parser.parse_args()
    rows = []
    started = time.time()
    for seed, (n, tie, kappa, strata) in enumerate(itertools.product(args.sizes, (0.3, 0.6), (2.0, 20.0), (1, 4))):
        passes, runs = pass_rate(args.runs, n, args.limit, args.limit, tie, kappa, strata, seed)
        better, _ = pass_rate(max(50, args.runs // 5), n, args.limit - 0.10, args.limit, tie, kappa, strata,
                              10_000 + seed)
        rows.append({"n": n, "tie": tie, "kappa": kappa, "strata": strata, "runs": runs,
                     "false_pass": passes / runs, "false_pass_ci": wilson(passes, runs),
                     "pass_10pt_better": better / max(50, args.runs // 5)})
        print(json.dumps(rows[-1]))
    total = sum(r["false_pass"] * r["runs"] for r in rows)
    runs = sum(r["runs"] for r in rows)
    out = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
           "limit": args.limit, "ci_level": 0.95, "nominal_false_pass": 0.025, "rows": rows,
           "false_pass_all": total / runs, "false_pass_all_ci": wilson(round(total), runs),
           "false_pass_max": max(r["false_pass"] for r in rows), "seconds": round(time.time() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"false pass at the limit: {out['false_pass_all']:.4f} over {runs} runs (max per cell "
          f"{out['false_pass_max']:.3f}); written {args.out}")


if __name__ == "__main__":
    main()
