"""An inconclusive slice whose estimate lies beyond the margin: no number of items shows a pass, but more
items settle it as a fail, and the gate says how many (``harness.decision.criteria.fail_items``).

The number is checked against the gate's own statistic by simulation: at the items it names, the
fail claim (the score test's upper bound at level 1 - 2·level below -m) is made in about 80 % of data
sets drawn at the observed Δ, and at half of them far less often.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from harness.config import GateConfig
from harness.decision import gate
from harness.decision.criteria import fail_items
from harness.stats import score_test
from harness.stats.score import score_z

REPO = Path(__file__).resolve().parents[1]


def fail_rate(n: int, discordance: float, delta: float, margin: float, level: float, draws: int, seed: int) -> float:
    """Share of simulated unclustered slices of n items at true Δ = ``delta`` whose fail claim is made.

    The claim (upper bound of the 1 - 2·level score interval below -m) is the score test's p at -m
    below ``level``: Z(-m) < -t_{1-level, n-1}, vectorised over the draws (checked against
    ``score_test(...).interval`` on some of them below)."""
    rng = np.random.default_rng(seed)
    gains_p, losses_p = (discordance + delta) / 2, (discordance - delta) / 2
    counts = rng.multinomial(n, [gains_p, losses_p, 1 - gains_p - losses_p], size=draws)
    z = score_z(-margin, counts[:, 0], counts[:, 1], n)
    return float(np.mean(z < -sps.t.ppf(1 - level, n - 1)))


def test_the_vectorised_claim_is_the_gates_interval():
    rng = np.random.default_rng(7)
    n, margin, level = 200, 0.02, 0.01
    for _ in range(25):
        gains, losses = rng.integers(0, 20), rng.integers(10, 50)
        diffs = np.array([1.0] * gains + [-1.0] * losses + [0.0] * (n - gains - losses))
        upper = score_test(diffs, np.arange(n)).interval(1 - 2 * level)[1]
        z = float(score_z(-margin, gains, losses, n))
        if abs(upper + margin) > 1e-6:  # away from the boundary the two readings agree
            assert (upper < -margin) == (z < -sps.t.ppf(1 - level, n - 1))


@pytest.mark.parametrize("discordance, delta, margin, level", [
    (0.20, -0.10, 0.02, 0.01),   # Bonferroni over 5 slices at α 0.05
    (0.30, -0.08, 0.02, 0.05),
    (0.10, -0.06, 0.03, 0.01),
])
def test_fail_items_give_80_percent_power_at_the_observed_delta(discordance, delta, margin, level):
    n = fail_items(discordance, 1.0, delta, margin, level)
    assert n is not None and n > 10
    at_n = fail_rate(n, discordance, delta, margin, level, draws=20_000, seed=1)
    assert 0.77 <= at_n <= 0.84  # 80 % within the normal approximation (Monte Carlo SE 0.003)
    assert fail_rate(n // 2, discordance, delta, margin, level, draws=20_000, seed=2) < 0.6


def test_fail_items_only_beyond_the_margin_and_more_with_fewer_clusters():
    assert fail_items(0.2, 1.0, -0.02, 0.02, 0.01) is None  # at the margin: neither pass nor fail expected
    assert fail_items(0.2, 1.0, -0.01, 0.02, 0.01) is None  # inside it: a pass is reachable, not a fail
    unclustered = fail_items(0.2, 1.0, -0.10, 0.02, 0.01)
    clustered = fail_items(0.2, 3.0, -0.10, 0.02, 0.01, clusters_per_item=1 / 9)
    farther = fail_items(0.2, 1.0, -0.20, 0.02, 0.01)
    assert clustered > 3 * unclustered - 10  # the design effect multiplies the items, few clusters add more
    assert farther < unclustered


def test_the_default_jobs_inconclusive_slice_is_told_what_a_fail_needs():
    """results/example: multilingual, Δ̂ -6.1 pt against a 2-point margin, inconclusive with 132 items."""
    decision = gate.decide([REPO / "results" / "example"], GateConfig())
    (open_slice,) = [c for c in decision.runs[0].criteria
                     if c.criterion == "accuracy_noninferiority" and c.outcome == "inconclusive"]
    assert open_slice.slice == "multilingual"
    why = "; ".join(open_slice.reasons)
    assert "cannot be settled by more items" not in why
    assert "a pass is out of reach" in why and "would settle it as a fail" in why
    n_fail = open_slice.numbers["n_fail"]
    assert isinstance(n_fail, int) and n_fail > open_slice.numbers["n"]
    assert f"about {n_fail} items" in why and open_slice.numbers["n_needed"] is None
    row = gate.table(decision).set_index("slice").loc["multilingual"]
    assert row["n_needed"] == f"fail at ~{n_fail}"
