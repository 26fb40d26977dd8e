"""gate.thinking's false-pass rate at its limit, measured: simulated thinking runs whose trace worsens by exactly the
limit, put through the harness's own statistics (thinking.thinking_metrics) and criterion (criteria.thinking_criteria).

Per design: items in clusters that share a propensity (rates) or a length scale (trace tokens), the reference's
rate drawn per cluster; the candidate's rate raised by exactly the limit on average (a reply that was fine turns
unclosed / cap-hit / looping with probability limit / (1 - base)), or its trace tokens multiplied by 1 + limit with
mean-one noise per item. A pass there is a false pass: the criterion should pass it at most 2.5 % of the time (the
95 % two-sided interval's upper bound). With no change (the power column) it should pass often.

    .venv/bin/python benchmarks/bench_thinking_gate.py --runs 400
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RATE_KEYS = ("cap_hit", "unclosed", "loop")


def synthetic_frame(rng: np.random.Generator, key: str, clusters: int, size: int, base: float, change: float,
                    noise: float = 0.4) -> pd.DataFrame:
    """One simulated run's thinking frame (thinking.trace_frame's columns) whose ``key`` worsens by ``change``
    on average: a rate by ``change`` (a fraction), trace tokens by the factor 1 + ``change``."""
    n = clusters * size
    cluster = np.repeat(np.arange(clusters), size)
    flags = {side: np.zeros(n) for side in ("ref", "quant")}
    scale = np.repeat(rng.lognormal(0.0, 0.5, clusters), size)  # a cluster's problems are long or short alike
    tokens_ref = np.rint(scale * rng.gamma(4.0, 60.0, n)).astype(int) + 1
    tokens_quant = tokens_ref
    if key in RATE_KEYS:
        propensity = np.repeat(rng.beta(2.0, 2.0 / base - 2.0, clusters), size)  # mean ``base``, per cluster
        flags["ref"] = (rng.random(n) < propensity).astype(float)
        turned = rng.random(n) < change / (1 - base)  # the increase is ``change`` on average
        flags["quant"] = np.maximum(flags["ref"], turned.astype(float))
    else:
        factor = rng.lognormal(-noise ** 2 / 2, noise, n)  # mean one
        tokens_quant = np.rint(tokens_ref * (1 + change) * factor).astype(int)
    frame = {"item_id": [f"math/{i}" for i in range(n)], "slice": "math", "cluster": cluster.astype(str),
             "trace_identical": 0.0, "first_departure": 0.0}
    for side, tokens in (("ref", tokens_ref), ("quant", tokens_quant)):
        rate = flags[side] if key in RATE_KEYS else np.zeros(n)
        frame.update({f"trace_tokens_{side}": tokens, f"repeated_{side}": 0.0,
                      f"cap_hit_{side}": rate if key == "cap_hit" else 0.0,
                      f"unclosed_{side}": rate if key == "unclosed" else 0.0,
                      f"closed_{side}": 1.0 - rate if key == "unclosed" else 1.0,
                      f"loop_period_{side}": np.where(rate > 0, 4, 0) if key == "loop" else 0})
    return pd.DataFrame(frame)


def passes(frame: pd.DataFrame, key: str, limit: float, n_resamples: int, seed: int) -> str:
    """The gate's outcome on ``key`` for one simulated run (the run's metrics as the pipeline computes them)."""
    from harness.config import GateConfig
    from harness.decision.criteria import thinking_criteria
    from harness.decision.gate_inputs import RunResults
    from harness.evaluation.thinking import thinking_metrics

    if key == "trace_ratio":  # the one statistic the criterion reads, as thinking_metrics computes it (faster)
        from harness.evaluation.thinking import ratio_interval
        ratio, low, high = ratio_interval(frame["trace_tokens_ref"].to_numpy(), frame["trace_tokens_quant"].to_numpy(),
                                          frame["cluster"].to_numpy())
        metrics = {"math/think_n": float(len(frame)), "math/think_n_clusters": float(frame["cluster"].nunique()),
                   "math/think_tokens_ratio": ratio,
                   "math/think_tokens_ratio_ci_low": low, "math/think_tokens_ratio_ci_high": high}
    else:
        metrics = thinking_metrics(frame, n_resamples=n_resamples, seed=seed)
    decided, = thinking_criteria(RunResults(Path("."), {"metrics": metrics}, {}, pd.DataFrame()),
                                 GateConfig(thinking={key: limit}), ["math"])
    return decided.outcome


def simulate(key: str, clusters: int, size: int, base: float, limit: float, change: float, runs: int,
             seed: int = 0, n_resamples: int = 1000, noise: float = 0.4) -> dict[str, float]:
    """Share of ``runs`` simulated runs that pass, fail and are inconclusive at a true change of ``change``."""
    rng = np.random.default_rng(seed)
    counts = {"pass": 0, "fail": 0, "inconclusive": 0}
    for run in range(runs):
        frame = synthetic_frame(rng, key, clusters, size, base, change, noise)
        counts[passes(frame, key, limit, n_resamples, seed + run)] += 1
    return {outcome: count / runs for outcome, count in counts.items()}


# (key, clusters, items per cluster, reference base rate, limit): 96 items in 32 clusters of 3 (the quick math
# slice's size), 200 items in 40 clusters of 5, 120 single-item clusters; rates at 5 % and 20 %, traces 20 % longer
DESIGNS = [("unclosed", 32, 3, 0.2, 0.05), ("unclosed", 40, 5, 0.2, 0.05), ("cap_hit", 32, 3, 0.05, 0.05),
           ("trace_ratio", 32, 3, 0.0, 0.2), ("trace_ratio", 120, 1, 0.0, 0.2), ("trace_ratio", 40, 5, 0.0, 0.2),
           ("trace_ratio", 16, 3, 0.0, 0.2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="simulated runs at the limit per design")
    parser.add_argument("--runs-unchanged", type=int, default=40, help="simulated runs with no change (power)")
    parser.add_argument("--resamples", type=int, default=1000, help="the trace-ratio bootstrap's resamples")
    parser.add_argument("--keys", nargs="*", default=None, help="only these keys' designs (default: all)")
    args = parser.parse_args()
    load_at_start, started = os.getloadavg(), time.perf_counter()
    rows = []
    for key, clusters, size, base, limit in DESIGNS:
        if args.keys and key not in args.keys:
            continue
        scale = 10 if key == "trace_ratio" else 1  # its statistic is cheap: a finer estimate
        runs = args.runs * scale
        at_limit = simulate(key, clusters, size, base, limit, limit, runs, n_resamples=args.resamples)
        unchanged = simulate(key, clusters, size, base, limit, 0.0, args.runs_unchanged * scale, seed=1,
                             n_resamples=args.resamples)
        rows.append({"key": key, "clusters": clusters, "size": size, "base": base, "limit": limit, "runs": runs,
                     "false_pass": at_limit["pass"], "pass_unchanged": unchanged["pass"]})
        print(json.dumps(rows[-1]), flush=True)
    out = REPO / "benchmarks" / "results" / f"thinking_gate_oc{'_' + '_'.join(args.keys) if args.keys else ''}.json"
    out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "runs": args.runs,
                               "runs_unchanged": args.runs_unchanged,
                               "resamples": args.resamples, "load_at_start": load_at_start,
                               "seconds": time.perf_counter() - started, "rows": rows}, indent=1) + "\n")
    print(out)


if __name__ == "__main__":
    main()
