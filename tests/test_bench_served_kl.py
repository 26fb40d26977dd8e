"""benchmarks/bench_served_kl.py's rank correlations, against scipy on values computed here by hand.

The script ranks finished runs' KL against their accuracy drop, pooled over (run, slice) points
and within each slice; the numbers in the README's served-format table come from it.
"""
from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
from scipy.stats import spearmanr

from harness.config import REPO_DIR


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_served_kl", REPO_DIR / "benchmarks" / "bench_served_kl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _points(bench, rng):
    """4 schemes x 2 slices; slice b has large KL and small drops for every scheme (pooled ranking by slice)."""
    points = []
    for slice_, n, kl_scale in (("a", 40, 1.0), ("b", 30, 5.0)):
        correct_ref = np.ones(n)  # every flip is a drop: the drop rises strictly with k
        for k in range(4):
            correct_quant = correct_ref.copy()
            flip = rng.choice(n, size=k * (3 if slice_ == "a" else 1), replace=False)
            correct_quant[flip] = 0.0
            sums = {}
            for measure, (kind, _) in bench.MEASURES.items():
                units = 6 if kind == "plain" else n
                count = rng.integers(1, 9, units).astype(float)
                sums[measure] = (count * kl_scale * (0.1 + 0.2 * k + 0.05 * rng.random(units)), count)
            points.append(bench.Point(f"s{k}", slice_, correct_ref, correct_quant, sums, {}))
    return points


def test_pooled_and_within_slice_spearman_match_scipy(bench):
    points = _points(bench, np.random.default_rng(0))
    out = bench.rank_correlations(points, n_resamples=50, seed=1)
    for measure, (kind, _) in bench.MEASURES.items():
        drop = [p.correct_ref.mean() - p.correct_quant.mean() for p in points]
        value = [p.sums[measure][0].sum() / p.sums[measure][1].sum() for p in points]
        assert out[measure]["spearman"] == pytest.approx(spearmanr(value, drop).statistic)
        per = {s: spearmanr([v for v, p in zip(value, points) if p.slice == s],
                            [d for d, p in zip(drop, points) if p.slice == s]).statistic for s in ("a", "b")}
        assert out[measure]["per_slice"] == pytest.approx(per)
        assert out[measure]["within_slice"] == pytest.approx(np.mean(list(per.values())))
        assert out[measure]["within_ci_low"] <= out[measure]["within_slice"] <= out[measure]["within_ci_high"]
        assert out[measure]["values"]["s0 | b"] == pytest.approx(value[4])
    # the construction: within each slice KL rises with the drop; pooled, slice b's big KL and small drops blur it
    assert out["served KL"]["within_slice"] == pytest.approx(1.0)
    assert out["served KL"]["spearman"] < 0.8
