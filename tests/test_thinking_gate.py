"""gate.thinking: a thinking model's trace gated off the intervals the report shows (criteria.thinking_criteria).

Each outcome against a hand-placed interval; refusals in one line (unknown key, a limit out of range, a
non-thinking model in preflight, a run without trace metrics at the gate); and the false-pass rate at the limit
measured by simulation through the harness's own statistics (benchmarks/bench_thinking_gate.py's generator).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.config import REPO_DIR, GateConfig, compose, to_config
from harness.decision.criteria import check_thinking_limits, thinking_criteria
from harness.decision.gate_inputs import GateInputError, RunResults


def _run(metrics: dict) -> RunResults:
    return RunResults(Path("."), {"metrics": metrics}, {}, pd.DataFrame())


METRICS = {"math/think_n": 96.0, "code/think_n": 12.0,
           # trace tokens ×1.12 [1.05, 1.18]: +12 % [+5, +18]
           "math/think_tokens_ratio": 1.12, "math/think_tokens_ratio_ci_low": 1.05,
           "math/think_tokens_ratio_ci_high": 1.18,
           # unclosed +9 pt [+4, +14]; cap hits +1 [-2, +4]; loops +2 [-1, +6]
           "math/think_unclosed_delta": 0.09, "math/think_unclosed_delta_ci_low": 0.04,
           "math/think_unclosed_delta_ci_high": 0.14,
           "math/think_cap_hit_delta": 0.01, "math/think_cap_hit_delta_ci_low": -0.02,
           "math/think_cap_hit_delta_ci_high": 0.04,
           "math/think_loop_delta": 0.02, "math/think_loop_delta_ci_low": -0.01,
           "math/think_loop_delta_ci_high": 0.06,
           "code/think_unclosed_delta": 0.0, "code/think_unclosed_delta_ci_low": -0.1,
           "code/think_unclosed_delta_ci_high": 0.1}


def test_each_key_is_read_off_its_interval():
    cfg = GateConfig(thinking={"trace_ratio": 0.2, "unclosed": 0.03, "cap_hit": 0.05, "loop": 0.03})
    found = {(c.slice, c.criterion): c for c in thinking_criteria(_run(METRICS), cfg, ["math", "code", "other"])}
    assert found["math", "thinking_trace_ratio"].outcome == "pass"  # at most +18 %, within 20 %
    assert found["math", "thinking_trace_ratio"].numbers["ci_high"] == pytest.approx(0.18)
    assert "+12.0 [+5.0, +18.0] %" in found["math", "thinking_trace_ratio"].message
    assert found["math", "thinking_unclosed"].outcome == "fail"  # at least +4 pt, beyond 3
    assert found["math", "thinking_cap_hit"].outcome == "pass"  # at most +4, within 5
    assert found["math", "thinking_loop"].outcome == "inconclusive"  # [-1, +6] straddles 3
    # code: 12 items < gate.min_items (30): inconclusive whatever its interval; other: no trace metrics, not judged
    assert found["code", "thinking_unclosed"].outcome == "inconclusive"
    assert "12 items" in found["code", "thinking_unclosed"].message
    assert not any(s == "other" for s, _ in found)
    # 96 items in 10 clusters: the trace_ratio interval is within the limit, but a pass needs gate.min_clusters_pass
    few = thinking_criteria(_run({**METRICS, "math/think_n_clusters": 10.0}), cfg, ["math"])
    ratio = next(c for c in few if c.criterion == "thinking_trace_ratio")
    assert ratio.outcome == "inconclusive" and "needs 20 clusters" in ratio.message
    lenient = thinking_criteria(_run({**METRICS, "math/think_n_clusters": 10.0}),
                                GateConfig(thinking={"trace_ratio": 0.2}, min_clusters_pass=0), ["math"])
    assert lenient[0].outcome == "pass"


def test_bad_limits_and_non_thinking_runs_are_refused_in_one_line():
    with pytest.raises(GateInputError, match="gate.thinking.length: unknown; use one of trace_ratio"):
        check_thinking_limits(GateConfig(thinking={"length": 0.2}))
    with pytest.raises(GateInputError, match="gate.thinking.unclosed=1.5"):
        check_thinking_limits(GateConfig(thinking={"unclosed": 1.5}))
    with pytest.raises(GateInputError, match="gate.thinking.trace_ratio=-0.1"):
        check_thinking_limits(GateConfig(thinking={"trace_ratio": -0.1}))
    with pytest.raises(GateInputError, match="model.thinking=none"):
        check_thinking_limits(GateConfig(thinking={"cap_hit": 0.02}), thinking_on=False)
    check_thinking_limits(GateConfig(), thinking_on=False)  # nothing set: nothing to refuse
    with pytest.raises(GateInputError, match="no trace metrics"):  # the gate command on a non-thinking run
        thinking_criteria(_run({"math/acc_delta": 0.0}), GateConfig(thinking={"cap_hit": 0.02}), ["math"])


@pytest.mark.slow
def test_preflight_refuses_gate_thinking_on_a_model_that_does_not_think():
    from harness.job.pipeline import preflight

    with pytest.raises(GateInputError, match="model.thinking=none"):
        preflight(to_config(compose(["model=tiny_random", "slices=[math]", "+gate.thinking.trace_ratio=0.2"])))
    with pytest.raises(GateInputError, match="gate.thinking.ratio: unknown"):
        preflight(to_config(compose(["model=tiny_random", "model.thinking=tags", "slices=[math]",
                                     "+gate.thinking.ratio=0.2"])))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_thinking_gate",
                                                  REPO_DIR / "benchmarks" / "bench_thinking_gate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_thinking_gate"] = module
    spec.loader.exec_module(module)
    return module


def test_the_simulated_frame_worsens_by_the_limit(bench):
    """The generator's own check: over many items the increase it draws is the limit (a rate) or 1 + limit
    (the ratio of summed trace tokens), so the false-pass rate below is measured at the limit."""
    import numpy as np

    rng = np.random.default_rng(0)
    rates = bench.synthetic_frame(rng, "unclosed", 4000, 3, 0.2, 0.05)
    assert rates["unclosed_quant"].mean() - rates["unclosed_ref"].mean() == pytest.approx(0.05, abs=0.006)
    tokens = bench.synthetic_frame(rng, "trace_ratio", 4000, 3, 0.0, 0.2)
    assert tokens["trace_tokens_quant"].sum() / tokens["trace_tokens_ref"].sum() == pytest.approx(1.2, abs=0.015)


@pytest.mark.slow
@pytest.mark.parametrize("key, limit, runs", [("unclosed", 0.05, 200), ("trace_ratio", 0.2, 2000)])
def test_a_change_at_the_limit_rarely_passes(bench, key, limit, runs):
    """Measured, not assumed: 96 items in 32 clusters of 3 (a quick slice's size) worsening by exactly the limit
    pass in at most gate.alpha = 5 % of the simulated runs (the 95 % interval's one-sided error is 2.5 % nominal;
    the trace ratio's measured 3.8 % at 3,000 runs, the percentile bootstrap's 7.0 % at 200, which this would
    catch); the thinking statistics and the criterion are the pipeline's and the gate's own."""
    shares = bench.simulate(key, 32, 3, 0.2, limit, limit, runs=runs, seed=11, n_resamples=1000)
    assert shares["pass"] <= 0.05, shares


def test_the_trace_ratio_interval_agrees_with_the_paired_cluster_bootstrap():
    """ratio_interval (delta method on the log ratio over cluster totals, t on G - 1) against an independent
    method on the same data: the paired cluster bootstrap's percentile interval (harness.stats.ratio_of_means),
    on 300 clusters where both should be close; and NaN where the ratio has no interval."""
    import numpy as np

    from harness.evaluation.thinking import ratio_interval
    from harness.stats.paired import ratio_of_means

    rng = np.random.default_rng(4)
    clusters = np.repeat(np.arange(300), 3)
    ref = np.repeat(rng.lognormal(0, 0.5, 300), 3) * rng.gamma(4.0, 60.0, 900)
    cand = ref * 1.15 * rng.lognormal(-0.08, 0.4, 900)
    ratio, low, high = ratio_interval(ref, cand, clusters)
    boot, boot_low, boot_high = ratio_of_means(ref, cand, clusters, n_resamples=4000, seed=2)
    assert ratio == pytest.approx(cand.sum() / ref.sum()) == pytest.approx(boot)
    width = boot_high - boot_low
    assert low == pytest.approx(boot_low, abs=0.1 * width) and high == pytest.approx(boot_high, abs=0.1 * width)
    assert low < ratio < high and ratio / low == pytest.approx(high / ratio)  # symmetric on the log scale
    assert all(np.isnan(ratio_interval(ref[:3], cand[:3], clusters[:3])[1:]))  # one cluster
    assert np.isnan(ratio_interval(np.zeros(6), cand[:6], clusters[:6])[0])  # no reference tokens
