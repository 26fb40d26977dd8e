"""harness.compare for a thinking model: both sides' trace lengths per run (quantiles and rates against hand
counts, intervals against Wilson on the Korn–Graubard effective size computed by hand), and a budget sweep whose
accuracies, Δ and smallest matching budget are fixed by construction; the fixed-sequence rule's false-claim rate
measured by simulation with the comparison's own interval."""
from __future__ import annotations

import copy
import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps
from statsmodels.stats.proportion import proportion_confint

from harness.compare import CompareOptions, RunData, analyse, load_results_dir, write_report
from harness.compare.budget import fixed_sequence_smallest
from harness.compare.render import plots
from harness.compare.render.tables import budget_findings, trace_text_table
from harness.stats.paired import paired_compare
from harness.stats.score import score_interval

CONFIG = {"model": {"name": "qwen3_tiny", "thinking": "tags"}, "quant": {"name": "int4"}, "slices": ["math"],
          "candidate": {}, "eval": {"max_gen_toks": None, "thinking_budget": 1024, "seed": 1234},
          "tracking": {"experiment": "x"}, "paths": {"results_dir": "results"}}


def _korn_graubard_wilson(count: int, n: int) -> tuple[float, float]:
    """Wilson's 95 % interval on the Korn–Graubard effective size, by hand for unclustered items (design effect 1:
    n_eff = n · (z / t_{n−1})²), through statsmodels' Wilson."""
    scale = (sps.norm.ppf(0.975) / sps.t.ppf(0.975, n - 1)) ** 2
    return proportion_confint(count * scale, n * scale, alpha=0.05, method="wilson")


def _items(n: int, ref_right: int, right_to_wrong: int, wrong_to_right: int = 0) -> pd.DataFrame:
    ref = [1.0] * ref_right + [0.0] * (n - ref_right)
    quant = list(ref)
    for k in range(right_to_wrong):
        quant[k] = 0.0
    for k in range(wrong_to_right):
        quant[ref_right + k] = 1.0
    return pd.DataFrame({"item_id": [f"math/{k:03d}" for k in range(n)], "slice": "math", "task": "t",
                         "sub_slice": None, "cluster": None, "output_type": "generate_until", "target": "x",
                         "correct_ref": ref, "correct_quant": quant, "response_ref": "a",
                         "response_quant": ["a" if r == q else "b" for r, q in zip(ref, quant)]})


def _run(scheme: str, items: pd.DataFrame, config: dict, thinking: pd.DataFrame | None = None) -> RunData:
    summary = {"run_key": f"k-{scheme}-{config['eval']['thinking_budget']}", "model": config["model"]["name"],
               "scheme": scheme, "method": "rtn", "slices": ["math"], "quant": {"bits_per_weight": 4.0}}
    return RunData(run_id=None, summary=summary, items=items, tokens=pd.DataFrame(), generation=pd.DataFrame(),
                   config=config, source=f"synthetic/{scheme}", thinking=thinking if thinking is not None
                   else pd.DataFrame())


# ------------------------------------------------------------------ trace lengths

def _thinking_frame() -> pd.DataFrame:
    """20 items: reference traces 10, 20, ..., 200 tokens; the candidate's twice as long, capped at 256 (cap hit on
    items whose doubled trace reaches 256: 130..200 → 8 items); unclosed: 2 of the reference's, 5 of the candidate's."""
    ref = np.arange(1, 21) * 10
    quant = np.minimum(2 * ref, 256)
    return pd.DataFrame({"item_id": [f"math/{k:03d}" for k in range(20)], "slice": "math", "cluster": None,
                         "trace_tokens_ref": ref, "trace_tokens_quant": quant,
                         "cap_hit_ref": 0.0, "cap_hit_quant": (2 * ref >= 256).astype(float),
                         "unclosed_ref": [1.0] * 2 + [0.0] * 18, "unclosed_quant": [1.0] * 5 + [0.0] * 15,
                         "state_ref": "closed", "state_quant": "closed",
                         "trace_ref": "…", "answer_ref": "42", "prompt": "p"})  # text columns the comparison skips


def test_trace_lengths_both_sides_against_hand_counts(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run = _run("int4", _items(20, 12, 1), CONFIG)
    (run_dir / "summary.json").write_text(json.dumps(run.summary))
    (run_dir / "config.json").write_text(json.dumps(CONFIG))
    run.items.to_parquet(run_dir / "items.parquet")
    _thinking_frame().to_parquet(run_dir / "thinking.parquet")
    loaded = load_results_dir(run_dir)
    assert "trace_ref" not in loaded.thinking and "trace_tokens_quant" in loaded.thinking
    report = analyse([loaded], CompareOptions(n_resamples=200))
    stats = report.trace_stats.set_index("side")
    assert stats.loc["reference", "tokens_median"] == 105 and stats.loc["candidate", "tokens_median"] == 210
    assert stats.loc["reference", "tokens_p90"] == pytest.approx(10 * (1 + 0.9 * 19))  # numpy's linear rule
    assert stats.loc["candidate", "tokens_max"] == 256
    assert stats.loc["candidate", "cap_hit"] == 8 / 20 and stats.loc["reference", "cap_hit"] == 0
    assert stats.loc["candidate", "unclosed"] == 5 / 20 and stats.loc["reference", "unclosed"] == 2 / 20
    low, high = _korn_graubard_wilson(5, 20)
    assert (stats.loc["candidate", "unclosed_ci_low"], stats.loc["candidate", "unclosed_ci_high"]) == \
        pytest.approx((low, high))
    table = trace_text_table(report).set_index("side")
    assert table.loc["candidate", "cap hit % [CI]"].startswith("40.0 [")

    fig = plots.trace_lengths(report.traces, report.trace_stats)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["reference: median 105, cap hit 0%, unclosed 10% (n=20)",
                      "candidate: median 210, cap hit 40%, unclosed 25% (n=20)"]
    written = write_report(report, tmp_path / "out")
    md = written["markdown"].read_text()
    assert "## Thinking: trace lengths" in md and "![trace_lengths](trace_lengths.png)" in md
    assert written["trace_lengths"].exists()


# ------------------------------------------------------------------ budget sweep

# budget -> (reference right of 400, right->wrong flips): Δ = −flips / 400. At 256 no flip (passes by chance),
# at 512 −10 pt (fails), at 1024 and 2048 no flip: fixed-sequence from the top claims 1024, not 256.
SWEEP = {256: (160, 0), 512: (200, 40), 1024: (240, 0), 2048: (260, 0)}


def _sweep_runs() -> list[RunData]:
    runs = []
    for budget, (right, flips) in SWEEP.items():
        config = copy.deepcopy(CONFIG)
        config["eval"]["thinking_budget"] = budget
        config["tracking"]["experiment"] = f"e{budget}"  # a transient section: still the same sweep
        runs.append(_run("int4", _items(400, right, flips), config))
    other = copy.deepcopy(CONFIG)
    other["quant"]["name"] = "int8"  # another scheme at one budget: not part of the sweep
    runs.append(_run("int8", _items(400, 240, 0), other))
    return runs


def test_budget_sweep_accuracy_and_smallest_matching_budget(tmp_path):
    report = analyse(_sweep_runs(), CompareOptions(n_resamples=200, margin=0.02))
    budget = report.budget.set_index("budget")
    assert list(budget.index) == [256, 512, 1024, 2048] and set(budget["budget_key"]) == {"eval.thinking_budget"}
    for value, (right, flips) in SWEEP.items():
        assert budget.loc[value, "acc_ref"] == right / 400
        assert budget.loc[value, "acc_quant"] == (right - flips) / 400
        assert budget.loc[value, "delta"] == pytest.approx(-flips / 400)
        low, high = _korn_graubard_wilson(right, 400)
        assert (budget.loc[value, "acc_ref_ci_low"], budget.loc[value, "acc_ref_ci_high"]) == pytest.approx((low, high))
    assert list(budget["non_inferior"]) == [True, False, True, True]
    assert set(budget["matched_from"]) == {1024}
    (line,) = budget_findings(report)
    assert line.startswith("qwen3_tiny/int4: the candidate matches the reference from eval.thinking_budget=1024 on")

    fig = plots.budget_curves(report.budget, margin=0.02)
    assert "matches from 1024" in fig.axes[1].get_title()
    written = write_report(report, tmp_path)
    md = written["markdown"].read_text()
    assert "## Thinking budget sweep" in md and "from eval.thinking_budget=1024 on" in md
    assert "![budget_curves](budget_curves.png)" in md and written["budget_curves"].exists()


def test_budget_sweep_with_no_match_and_on_max_gen_toks():
    runs = []
    for cap, flips in ((512, 40), (1024, 0), (2048, 40)):  # the largest fails: nothing is claimed
        config = copy.deepcopy(CONFIG)
        config["eval"]["max_gen_toks"] = cap
        runs.append(_run("int4", _items(400, 240, flips), config))
    report = analyse(runs, CompareOptions(n_resamples=200, margin=0.02))
    assert set(report.budget["budget_key"]) == {"eval.max_gen_toks"}
    assert report.budget["matched_from"].isna().all()
    assert "matches the reference at no budget tried" in budget_findings(report)[0]
    assert fixed_sequence_smallest([1, 2, 3], [True, True, True]) == 1


def test_fixed_sequence_false_claim_rate_by_simulation():
    """At the margin's boundary (true Δ = −margin at every budget) any claim is false. Fixed-sequence testing keeps
    the rate at one test's one-sided error (2.5 %); the smallest budget that passes anywhere does not (4 budgets:
    about 1 − 0.975⁴ ≈ 9.6 %). The interval is the comparison's own (the score interval, no clusters, t on n − 1),
    checked against harness.stats.paired_compare on one table first."""
    n, margin, budgets = 400, 0.02, 4
    critical = float(sps.t.ppf(0.975, n - 1))
    ref = np.array([1.0] * 240 + [0.0] * 160)
    quant = ref.copy()
    quant[:12], quant[240:236 + 8] = 0.0, 1.0  # 12 losses, 4 gains
    shown = paired_compare(ref, quant, n_resamples=200, margin=margin).delta_ci
    assert np.allclose(score_interval(4, 12, n, critical), shown, atol=1e-6)

    rng = np.random.default_rng(7)
    reps = 20_000
    tables = rng.multinomial(n, [0.02, 0.04, 0.94], size=(reps, budgets))  # gains, losses, ties: Δ = −0.02
    low, _ = score_interval(tables[..., 0], tables[..., 1], n, critical)
    passed = low > -margin
    fixed = np.array([np.isfinite(fixed_sequence_smallest(range(budgets), row)) for row in passed])
    anywhere = passed.any(axis=1)
    se = np.sqrt(0.025 * 0.975 / reps)
    assert fixed.mean() <= 0.025 + 3 * se, fixed.mean()
    assert anywhere.mean() > 0.06, anywhere.mean()
