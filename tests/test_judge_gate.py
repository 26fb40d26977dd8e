"""The judge gate's false-pass rate at its limit, by simulation through the harness's own statistics and criterion.

A candidate whose true loss − win equals ``gate.judge_loss_max`` must pass rarely: the gate passes when the upper end
of the 95 % two-sided interval is at or below the limit, 2.5 % nominally. Prompts come in clusters of 1 to 5 that
share their win / tie / loss propensities (Dirichlet, concentration 2: strongly alike), in 4 strata. The full
measurement over sizes and settings is benchmarks/bench_judge_gate.py (docs/benchmarks/judge.md).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from harness.decision.criteria import judge_outcome
from harness.evaluation.judge_stats import judge_metrics

pytestmark = pytest.mark.slow


def _log(rng: np.random.Generator, n: int, rates: np.ndarray) -> pd.DataFrame:
    outcomes, clusters = [], []
    index = 0
    while len(outcomes) < n:
        size = min(int(rng.integers(1, 6)), n - len(outcomes))
        outcomes += list(rng.choice(3, size=size, p=rng.dirichlet(2.0 * rates)))
        clusters += [f"c{index}"] * size
        index += 1
    drawn = np.array(outcomes)
    strata = [f"s{int(c[1:]) % 4}" for c in clusters]
    return pd.DataFrame({"slice": "prompts", "cluster": clusters, "stratum": strata, "sub_slice": strata,
                         "identical": 0, "outcome": np.array(["win", "tie", "loss"])[drawn],
                         "win": (drawn == 0).astype(int), "tie": (drawn == 1).astype(int),
                         "loss": (drawn == 2).astype(int), "consistent": 1.0, "first_chosen": 1, "decisive": 2})


def _passes(runs: int, n: int, true_gap: float, limit: float, seed: int) -> int:
    tie = 0.4
    win = (1 - tie - true_gap) / 2
    rates = np.array([win, tie, win + true_gap])
    rng = np.random.default_rng(seed)
    count = 0
    for _ in range(runs):
        m = judge_metrics(_log(rng, n, rates))
        count += judge_outcome(m["prompts/judge_loss_minus_win"], m.get("prompts/judge_loss_minus_win_ci_low"),
                               m.get("prompts/judge_loss_minus_win_ci_high"), m["prompts/judge_decided"], limit,
                               30) == "pass"
    return count


def test_a_candidate_exactly_at_the_limit_rarely_passes():
    runs = 300
    passes = _passes(runs, 120, 0.05, 0.05, seed=7)
    # nominal 2.5 %; 5 % is ~2.7 binomial standard deviations above it at 300 runs
    assert passes / runs <= 0.05, passes


def test_a_candidate_well_inside_the_limit_mostly_passes_so_the_check_above_can_fail():
    runs = 80
    assert _passes(runs, 500, 0.05 - 0.15, 0.05, seed=8) / runs >= 0.8
