"""How often does ``python -m harness.parity`` flag a scheme whose simulation and served export disagree no more
than the engines alone do (false flag), and how often does it flag a real excess (power)? By simulation.

``python benchmarks/bench_parity_oc.py [reps=400] [out=benchmarks/results/parity_oc.json]``

Each data set is a slice of n items in clusters of c items. Per item two 0/1 outcomes are drawn: whether the
reference and the reference served by an engine answer alike (the floor), and whether the simulation and its
served export do. Items differ in how fragile they are: each cluster draws a propensity from a Beta
distribution with intra-cluster correlation ρ, and both outcomes of an item depend on it (an item one engine
change disturbs is more likely to be disturbed by the other), so the two outcomes are positively correlated as
on real items. The floor disagrees at rate p; the simulation-vs-served pair at p (null: the false-flag rate)
or p + e (power at excess e). The decision is the one the command makes
(:func:`harness.compare.parity_table.excess_over_floor`: the interval of the agreement difference lies below 0),
at ci_level 0.95, so the false-flag rate must stay at or below 0.025 within Monte-Carlo error.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import cli  # noqa: E402
from harness.compare.parity_table import excess_over_floor  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Options:
    reps: int = field(default=400, metadata={"help": "data sets per design"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    out: str = field(default=str(RESULTS / "parity_oc.json"), metadata={"help": "JSON written here"})


def draw(rng: np.random.Generator, n: int, size: int, rho: float, p_floor: float, p_parity: float) -> pd.DataFrame:
    clusters = np.arange(n) // size
    groups = clusters.max() + 1
    if rho > 0:  # Beta propensity with mean 1 and variance giving intra-cluster correlation rho (scaled per rate)
        k = 1 / rho - 1
        fragile = rng.beta(k * 0.5, k * 0.5, groups)[clusters] * 2  # mean 1, in [0, 2]
    else:
        fragile = np.ones(n)
    floor = rng.random(n) < np.clip(p_floor * fragile, 0, 1)
    parity = rng.random(n) < np.clip(p_parity * fragile, 0, 1)
    return pd.DataFrame({"cluster": clusters.astype(str), "agree_floor": (~floor).astype(float),
                         "agree_parity": (~parity).astype(float)})


def measure(parsed: cli.Parsed[Options]) -> int:
    options = parsed.options
    assert options is not None
    rng = np.random.default_rng(options.seed)
    settings = dict(cluster_col="cluster", stratum_col=None, seed=0, correction="none", ci_level=0.95,
                    min_clusters=5, n_resamples=50)
    rows = []
    start = time.perf_counter()
    for n in (60, 150, 400):
        for size, rho in ((1, 0.0), (4, 0.3)):
            for p in (0.02, 0.1, 0.3):
                for excess in (0.0, 0.1):
                    flags = [excess_over_floor(draw(rng, n, size, rho, p, p + excess), **settings)["exceeds_floor"]
                             for _ in range(options.reps)]
                    rate = float(np.mean(flags))
                    rows.append({"n": n, "cluster_size": size, "rho": rho, "p_floor": p, "excess": excess,
                                 "flag_rate": rate, "mc_se": float(np.sqrt(max(rate * (1 - rate), 1e-12) / options.reps))})
                    print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    null = table[table["excess"] == 0]
    result = {"date": time.strftime("%Y-%m-%d"), "reps": options.reps, "seconds": time.perf_counter() - start,
              "machine": {"cpus": os.cpu_count(), "load": os.getloadavg()},
              "max_false_flag": float(null["flag_rate"].max()), "rows": rows}
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table.pivot_table(index=["n", "cluster_size", "p_floor"], columns="excess", values="flag_rate").to_markdown())
    print(f"max false-flag rate {result['max_false_flag']:.3f} over {len(null)} null designs ({options.reps} reps each)")
    return 0


TOOL = cli.Tool(prog="python benchmarks/bench_parity_oc.py", options=Options,
                summary="False-flag rate and power of the parity command's excess-over-floor flag, by simulation.")


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, measure, argv)


if __name__ == "__main__":
    raise SystemExit(main())
