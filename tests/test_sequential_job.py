"""eval.sequential inside a job (harness.evaluation.sequential_run): rounds of whole clusters, the stop, the record, the gate.

The loop is tested with lm-eval replaced by a table of known answers (so the stop can be worked
out independently from the cluster sums, with :func:`harness.stats.sequential.cs_bounds` on the
plan's order); the job itself runs on tiny_random end to end, killed and resumed.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.evaluation import evaluate
from harness.decision import gate
from harness.job import identity
from harness.config import config_dict, to_config
from harness.evaluation import sequential_run as sequential
from harness.config import GateConfig
from harness.evaluation.slices import resolve
from harness.stats import sequential as seqstats


def _reference(n_clusters: int, size: int, ref_correct: float = 1.0) -> pd.DataFrame:
    """Reference records: ``n_clusters`` clusters of ``size`` items over two tasks, doc ids per task."""
    rows = []
    for item in range(n_clusters * size):
        task = ("t_gen", "t_mc")[item % 2]
        rows.append({"item_id": f"{task}/{item}", "slice": "s", "task": task, "sub_slice": "all",
                     "cluster": f"c{item // size:03d}", "output_type": "generate_until", "correct": ref_correct,
                     "response": "", "target": "", "prompt": f"prompt {item}", "reply": "", "doc_id": item // 2})
    return pd.DataFrame(rows, columns=evaluate.RECORD_COLUMNS)


class FakeLmEval:
    """Stands in for :func:`harness.evaluation.evaluate.evaluate_slice`: answers the documents asked for from ``answers``."""

    def __init__(self, reference: pd.DataFrame, quant_correct: dict[str, float], prompt_suffix: str = ""):
        self.reference, self.quant_correct, self.suffix = reference, quant_correct, prompt_suffix
        self.calls: list[dict[str, list[int]]] = []

    def __call__(self, lm, slice_, settings, checkpoint=None, samples=None, progress_offset=None):
        assert samples is not None, "a sequential round must ask for its documents"
        self.calls.append(samples)
        asked = pd.concat([self.reference[(self.reference["task"] == task) & self.reference["doc_id"].isin(ids)]
                           for task, ids in samples.items()])
        out = asked.copy()
        out["correct"] = out["item_id"].map(self.quant_correct)
        out["prompt"] = out["prompt"] + self.suffix
        return out.reset_index(drop=True), {}


class _Slice:
    name = "s"


def _rule(margin: float, min_items: int = 10, min_clusters: int = 2, method: str = "betting") -> sequential.StopRule:
    return sequential.StopRule(alpha=0.05, family=1, margins={"s": margin}, min_items=min_items,
                               min_clusters=min_clusters, method=method)


def _run(monkeypatch, reference, quant_correct, rule, round_items=20, **fake):
    fake_eval = FakeLmEval(reference, quant_correct, **fake)
    monkeypatch.setattr(evaluate, "evaluate_slice", fake_eval)
    out = sequential.evaluate_sequential(None, _Slice(), None, Path("unused"), reference, rule, seed=7,
                                         round_items=round_items)
    return (*out, fake_eval)


def test_a_broken_candidate_stops_after_the_round_that_settles_it(monkeypatch) -> None:
    reference = _reference(40, 5)  # 200 items, the reference right on all
    wrong = {item: 0.0 for item in reference["item_id"]}  # the candidate wrong on all: Δ = -1
    answered, aggregates, record, placement, fake = _run(monkeypatch, reference, wrong, _rule(0.05))

    plan = sequential.plan_slice(reference, "s", 7, 20)
    sizes = np.bincount(plan.codes).astype(float)
    sums = -sizes[plan.order]  # every item lost
    ends = np.cumsum([part.size for part in plan.rounds])
    _, upper = seqstats.cs_bounds(sums, sizes[plan.order], sizes.mean(), 0.05, looks=ends, horizon=sizes.size)
    first = int(np.argmax((upper < -0.05) & (np.cumsum(sizes[plan.order])[ends - 1] >= 10)))
    assert record["state"] == "fail" and record["reason"].startswith("fail: upper bound")
    assert record["rounds_used"] == first + 1 < record["rounds_total"]
    assert record["items_used"] == len(answered) < len(reference)
    assert len(fake.calls) == record["rounds_used"]
    # each call asked for whole clusters, and every answered item was asked for once
    asked = pd.concat([reference[(reference["task"] == t) & reference["doc_id"].isin(ids)]
                       for call in fake.calls for t, ids in call.items()])
    assert sorted(asked["item_id"]) == sorted(answered["item_id"])
    full = reference.groupby("cluster").size()
    counts = asked.groupby("cluster").size()
    assert (counts == full[counts.index]).all()
    assert aggregates == {"t_gen": 0.0, "t_mc": 0.0}
    # placement: every answered item, its round and its cluster's place in the order
    assert set(placement["item_id"]) == set(answered["item_id"])
    assert placement["seq_round"].between(1, record["rounds_used"]).all()
    # the gate recomputes the same sequence from the answered items and the ones not evaluated
    items = reference[reference["item_id"].isin(answered["item_id"])].rename(columns={"correct": "correct_ref"})
    items["correct_quant"] = 0.0
    skipped = sequential.not_evaluated_frame(reference, set(answered["item_id"]))
    assert set(skipped["status"]) == {"not evaluated"} and len(skipped) + len(items) == len(reference)
    again = sequential.gate_sequence(items, skipped, record, 0.05, 0.05, 1)
    assert (again.lower, again.upper, again.state, again.n) == pytest.approx(
        (record["lower"], record["upper"], "fail", record["items_used"]))


def test_an_unchanged_candidate_passes_a_wide_margin_early(monkeypatch) -> None:
    reference = _reference(200, 1)  # every item its own cluster
    same = {item: 1.0 for item in reference["item_id"]}
    margin = 0.3
    needed = seqstats.min_clusters_to_pass(margin, 0.05)  # no change: this many clusters to pass
    answered, _, record, _, _ = _run(monkeypatch, reference, same, _rule(margin), round_items=10)
    lower, _ = seqstats.cs_bounds(np.zeros(200), np.ones(200), 1.0, 0.05, looks=np.arange(10, 201, 10), horizon=200)
    expected = 10 * (int(np.argmax(lower > -margin)) + 1)
    assert record["state"] == "pass"
    assert record["items_used"] == expected == len(answered) < 200
    assert expected >= math.ceil(needed / 10) * 10  # never before the bets' cap allows
    assert record["trajectory"][-1]["lower"] > -margin >= record["trajectory"][-2]["lower"]


def test_spending_fails_a_clearly_broken_clustered_slice_early(monkeypatch) -> None:
    """20 sources of 10 items, the candidate loses 4 of every 10 (Δ = -40 pt, margin 2 pt): the score test
    at the rounds crosses its O'Brien–Fleming boundary before the last round, at a look whose boundary
    is finite; the gate recomputes the same stop from the answered and the skipped items."""
    from harness.stats.group_sequential import spending_boundaries
    reference = _reference(20, 10)
    lossy = {item: float(i % 10 >= 4) for i, item in enumerate(reference["item_id"])}
    answered, _, record, _, _ = _run(monkeypatch, reference, lossy, _rule(0.02, method="spending"), round_items=25)
    assert record["method"] == "spending" and record["state"] == "fail"
    assert record["rounds_used"] < record["rounds_total"] and record["items_used"] < 200
    # the stop is the first round whose score test crosses the boundary at that round's information fraction
    plan = sequential.plan_slice(reference, "s", 7, 25)
    items = np.array([trajectory["items"] for trajectory in record["trajectory"]])
    fractions = np.cumsum([np.isin(plan.codes, part).sum() for part in plan.rounds]) / 200
    bounds = spending_boundaries(fractions, 0.05)
    assert np.isfinite(bounds[record["rounds_used"] - 1])
    assert items[-1] == record["items_used"] == len(answered)
    items_frame = reference[reference["item_id"].isin(answered["item_id"])].rename(columns={"correct": "correct_ref"})
    items_frame["correct_quant"] = items_frame["item_id"].map(lossy)
    skipped = sequential.not_evaluated_frame(reference, set(answered["item_id"]))
    again = sequential.gate_sequence(items_frame, skipped, record, 0.02, 0.05, 1)
    assert (again.state, again.n, again.upper) == pytest.approx(("fail", record["items_used"], record["upper"]))


def test_a_slice_that_never_settles_uses_every_item_and_says_so(monkeypatch) -> None:
    reference = _reference(12, 4)
    mixed = {item: float(i % 5 != 0) for i, item in enumerate(reference["item_id"])}  # Δ = -0.2, 48 items
    answered, _, record, _, _ = _run(monkeypatch, reference, mixed, _rule(0.02), round_items=8)
    assert record["state"] == "open" and record["reason"] == "items exhausted"
    assert record["items_used"] == 48 == len(answered)
    assert record["rounds_used"] == record["rounds_total"] == len(record["trajectory"])


def test_the_minimum_items_hold_a_settled_slice_open(monkeypatch) -> None:
    reference = _reference(40, 5)
    wrong = {item: 0.0 for item in reference["item_id"]}
    _, _, early, _, _ = _run(monkeypatch, reference, wrong, _rule(0.05, min_items=10))
    _, _, late, _, _ = _run(monkeypatch, reference, wrong, _rule(0.05, min_items=150))
    assert late["items_used"] >= 150 > early["items_used"]


def test_a_round_prompted_differently_from_the_reference_is_refused(monkeypatch) -> None:
    reference = _reference(10, 3)
    with pytest.raises(RuntimeError, match="prompted differently"):
        _run(monkeypatch, reference, {item: 1.0 for item in reference["item_id"]}, _rule(0.05), prompt_suffix=" x")


@pytest.mark.slow
@pytest.mark.parametrize("override, message", [
    (["eval.sequential_round_items=0"], "must be >= 1"),
    (["eval.sequential_method=bayes"], "is unknown"),
    (["eval.backend=vllm"], "eval.backend=hf only"),
    (["gate.alpha=0.6"], r"must lie in \(0, 0.5\)"),
])
def test_bad_sequential_settings_are_refused_before_any_work(make_cfg, override, message) -> None:
    cfg = to_config(make_cfg("model=tiny_random", "eval.sequential=true", *override))
    with pytest.raises(sequential.SequentialConfigError, match=message):
        sequential.check_config(cfg, resolve(cfg.slices))


def test_registry_slices_with_few_shot_prompts_are_refused(make_cfg) -> None:
    cfg = to_config(make_cfg("model=tiny_random", "eval.sequential=true"))
    slices = resolve(cfg.slices)
    registry = type(slices[0])(name="gsm", config=type(slices[0].config)(tasks=["gsm8k"], num_fewshot=5),
                               directory=None)
    with pytest.raises(sequential.SequentialConfigError, match="few-shot"):
        sequential.check_config(cfg, [registry])


@pytest.mark.slow
def test_run_key_is_unchanged_by_the_option_off_and_covers_the_stop_rule_on(make_cfg) -> None:
    base = to_config(make_cfg("model=tiny_random"))
    config = config_dict(base)
    for key in ("sequential", "sequential_round_items", "sequential_method", "max_gen_toks"):  # off: not in the key
        config["eval"].pop(key)
    for served_only in ("endpoint_divergence_topk", "endpoint_concurrency"):  # keyed only for served candidates
        config["candidate"].pop(served_only)
    config["candidate"].pop("endpoint_max_requests_per_s")  # a rate limit is in no key
    for section in ("reference", "judge"):  # keyed only when a served reference or a judge is set
        config.pop(section)
    for thinking_only in identity.THINKING_MODEL_FIELDS:  # keyed only for a model that thinks
        config["model"].pop(thinking_only, None)
    config["eval"].pop("thinking_budget")
    for transient in identity.TRANSIENT_SECTIONS:
        config.pop(transient, None)
    config["quant"] = identity.keyed_quant(base.quant, config["quant"])  # the settings' layout from before
    for slice_config in config["slices"].values():  # unset sampling-design fields (issue 37): not in the key either
        for key in identity.DESIGN_FIELDS:
            slice_config.pop(key)
    from harness.infra.cache import stable_hash
    assert identity.run_key(base) == stable_hash({"config": config, "model": None}, 16)  # as before the option
    on = to_config(make_cfg("model=tiny_random", "eval.sequential=true"))
    stricter = to_config(make_cfg("model=tiny_random", "eval.sequential=true", "gate.alpha=0.01"))
    assert len({identity.run_key(base), identity.run_key(on), identity.run_key(stricter)}) == 3
    assert identity.run_key(to_config(make_cfg("model=tiny_random", "gate.alpha=0.01"))) == \
        identity.run_key(base)


TINY_SEQ = ["model=tiny_random", "slices=[math]", "slices.math.n_items=24", "slices.math.divergence_texts=2",
            "eval.sequential=true", "eval.sequential_round_items=6", "gate.enabled=true", "gate.min_items=1"]


@pytest.mark.slow
def test_a_sequential_job_writes_what_it_used_and_the_gate_reads_its_sequence(make_cfg, tmp_path) -> None:
    from harness.job.pipeline import run
    result = run(make_cfg(*TINY_SEQ))
    record = result["sequential"]["math"]
    directory = next((tmp_path / "results").iterdir())
    items = pd.read_parquet(directory / "items.parquet")
    skipped = pd.read_parquet(directory / "not_evaluated.parquet")
    assert len(items) == record["items_used"] and len(items) + len(skipped) == record["items_total"]
    assert items["correct_quant"].notna().all() and set(skipped["status"]) <= {"not evaluated"}
    assert {"seq_round", "seq_order"} <= set(items.columns) and items["seq_round"].min() == 1
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["sequential"]["math"]["trajectory"] == record["trajectory"]
    decision = gate.gate_results(directory, GateConfig(min_items=1))
    numbers = next(c for r in decision.runs for c in r.criteria if c.criterion == "accuracy_noninferiority").numbers
    assert numbers["interval"] == "sequence" and numbers["items_total"] == record["items_total"]
    assert numbers["delta_ci_low"] == pytest.approx(record["lower"])
    assert "## Sequential evaluation" in (directory / "report.md").read_text()
    assert (directory / "sequence.png").stat().st_size > 0


@pytest.mark.slow
def test_a_resumed_sequential_slice_replays_its_rounds_and_reaches_the_same_stop(make_cfg, tmp_path) -> None:
    """The rounds share the run's request checkpoint: with a third of its rows forgotten (a killed job),
    the same slice computes only those and gives the same records, stop and trajectory."""
    import contextlib
    import sqlite3

    from harness.models import loading as models
    from harness.job.reference import compute_reference
    from harness.infra.cache import Cache
    cfg = to_config(make_cfg(*TINY_SEQ, "quant=none", "eval.batch_size=1", "gate.margin=0.4"))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    slice_ = resolve(cfg.slices)[0]
    reference = compute_reference(loaded, slice_, identity.ReferenceSpec.of(cfg), Cache(cfg.paths.cache_dir)).records
    settings = identity.eval_settings(cfg, None)
    rule = sequential.stop_rule(cfg, [slice_.name])
    prefix = tmp_path / "checkpoint" / "math"

    def once(lm):
        return sequential.evaluate_sequential(lm, slice_, settings, prefix, reference, rule, cfg.eval.seed,
                                              cfg.eval.sequential_round_items)

    first = once(evaluate.make_lm(loaded.model, loaded.tokenizer, settings))
    total = evaluate.checkpoint_rows(prefix)
    with contextlib.closing(sqlite3.connect(evaluate.checkpoint_files(prefix)[0])) as db:
        db.execute("DELETE FROM unnamed WHERE rowid % 3 = 0")
        db.commit()
    kept = evaluate.checkpoint_rows(prefix)
    lm = evaluate.make_lm(loaded.model, loaded.tokenizer, settings)
    computed: list[int] = []
    for name in ("loglikelihood", "generate_until"):
        original = getattr(lm, name)
        setattr(lm, name, lambda requests, _original=original: (computed.append(len(requests)), _original(requests))[1])
    second = once(lm)
    assert 0 < kept < total and sum(computed) == total - kept
    pd.testing.assert_frame_equal(first[0], second[0])
    assert first[2] == second[2]  # the same stop, reason and trajectory
    pd.testing.assert_frame_equal(first[3], second[3])


@pytest.mark.slow
def test_spending_does_not_stop_for_a_pass_the_gate_would_not_accept(monkeypatch) -> None:
    """10 sources of 20 items, no change, a 30-pt margin: the score test at the rounds passes early, but
    with fewer than gate.min_clusters_pass clusters the gate would call that pass inconclusive, so the job
    does not stop on it (min_clusters_pass=0: it does)."""
    reference = _reference(10, 20)
    same = {item: 1.0 for item in reference["item_id"]}
    free = sequential.StopRule(0.05, 1, {"s": 0.3}, 10, 2, "spending", 0)
    guarded = sequential.StopRule(0.05, 1, {"s": 0.3}, 10, 2, "spending", 20)
    _, _, early, _, _ = _run(monkeypatch, reference, same, free, round_items=40)
    _, _, held, _, _ = _run(monkeypatch, reference, same, guarded, round_items=40)
    assert early["state"] == "pass" and early["items_used"] < 200
    assert held["items_used"] == 200 and held["rounds_used"] == held["rounds_total"]
