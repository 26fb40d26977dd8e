"""Strata through the harness (issue 37): the per-item records, the run's comparison, the gate's guard on
random clusters and sequential evaluation, each against the stratified statistic of harness.stats called
directly, and records without strata against the numbers they had before."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from harness import stats
from harness.config import CompareConfig, GateConfig, SliceConfig
from harness.decision import gate
from harness.evaluation import evaluate
from harness.evaluation import sequential_run as seqeval
from harness.results.summary import paired_statistics, pair_items

COMPARE = {"n_resamples": 1000, "ci_level": 0.95, "seed": 0, "margin": 0.02, "correction": "holm"}
MODEL = {"name": "m", "source": "hf", "path": "org/m", "gguf_file": None, "revision": None, "dtype": "float32"}


def _lm_eval_results(docs: list[dict]) -> dict:
    """What simple_evaluate(log_samples=True) returns for one generative task over ``docs`` (the parts read)."""
    samples = [{"doc": doc, "doc_id": i, "doc_hash": f"h{i}", "filter": "none", "target": "1",
                "exact_match": float(i % 2), "resps": [["1"]], "filtered_resps": ["1"], "arguments": [["q", {}]]}
               for i, doc in enumerate(docs)]
    return {"samples": {"t": samples},
            "configs": {"t": {"output_type": "generate_until", "metric_list": [{"metric": "exact_match"}]}},
            "results": {"t": {"exact_match,none": 0.5}}}


def _slice(**config) -> SimpleNamespace:
    return SimpleNamespace(name="s", config=SliceConfig(tasks=["t"], **config))


def test_records_carry_stratum_and_cluster_and_a_config_may_name_other_fields() -> None:
    docs = [{"id": f"i{k}", "stratum": f"cell{k % 3}", "cluster": f"doc{k // 2}", "level": f"L{k % 2}",
             "source": f"S{k // 3}"} for k in range(6)]
    records, _ = evaluate.records_from_results(_lm_eval_results(docs), _slice())
    assert records["stratum"].tolist() == [d["stratum"] for d in docs]
    assert records["cluster"].tolist() == [d["cluster"] for d in docs]
    named, _ = evaluate.records_from_results(_lm_eval_results(docs), _slice(stratum_field="level",
                                                                             cluster_field="source"))
    assert named["stratum"].tolist() == [d["level"] for d in docs]
    assert named["cluster"].tolist() == [d["source"] for d in docs]
    # A registry task's documents declare neither: every item its own cluster, no stratum.
    plain, _ = evaluate.records_from_results(_lm_eval_results([{"question": "q"}] * 4), _slice())
    assert plain["stratum"].tolist() == [""] * 4 and plain["cluster"].tolist() == ["0", "1", "2", "3"]


def _paired(n: int, strata: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    layer = np.arange(n) % strata
    ref = (rng.random(n) < np.linspace(0.1, 0.9, strata)[layer]).astype(float)
    quant = np.where((layer == strata - 1) & (rng.random(n) < 0.5), 0.0, ref)
    return pd.DataFrame({"item_id": [f"s-{i}" for i in range(n)], "slice": "s", "task": "t",
                         "sub_slice": [f"sub{k % 2}" for k in layer], "cluster": [f"c{i}" for i in range(n)],
                         "output_type": "generate_until", "target": "x", "correct_ref": ref, "correct_quant": quant,
                         "stratum": [f"h{k}" for k in layer]})


def test_the_comparison_is_stratified_where_records_carry_strata_and_unchanged_where_not() -> None:
    items = _paired(200, 5, 1)
    table = paired_statistics(items, CompareConfig())
    row = table[table["level"] == "slice"].iloc[0]
    direct = stats.paired_compare(items["correct_ref"], items["correct_quant"], clusters=items["cluster"],
                                  strata=items["stratum"], margin=CompareConfig().margin)
    assert (row["delta_ci_low"], row["delta_ci_high"]) == direct.delta_ci and row["n_strata"] == 5
    before = paired_statistics(items.drop(columns="stratum"), CompareConfig())
    unstratified = stats.paired_compare(items["correct_ref"], items["correct_quant"], clusters=items["cluster"],
                                        margin=CompareConfig().margin)
    assert tuple(before[before["level"] == "slice"].iloc[0][["delta_ci_low", "delta_ci_high"]]) == unstratified.delta_ci
    assert row["delta_ci_high"] - row["delta_ci_low"] < unstratified.delta_ci[1] - unstratified.delta_ci[0]


def test_pairing_takes_the_strata_from_the_candidate_when_a_cached_reference_has_none() -> None:
    items = _paired(20, 2, 2)
    ref = items.rename(columns={"correct_ref": "correct"}).assign(response="r").drop(columns=["correct_quant", "stratum"])
    quant = items.rename(columns={"correct_quant": "correct"}).assign(response="q").drop(columns="correct_ref")
    assert pair_items(ref, quant)["stratum"].tolist() == items["stratum"].tolist()


def _write_run(directory: Path, items: pd.DataFrame) -> Path:
    directory.mkdir(parents=True)
    items.to_parquet(directory / "items.parquet")
    (directory / "config.json").write_text(json.dumps({"model": MODEL, "compare": COMPARE}))
    (directory / "summary.json").write_text(json.dumps({"run_name": "m/int4/x", "model": "m", "scheme": "int4",
                                                        "metrics": {}, "tags": {}}))
    return directory


def _unchanged(name: str, n: int, strata: np.ndarray | None, clusters: np.ndarray) -> pd.DataFrame:
    ref = (np.arange(n) < int(0.8 * n)).astype(float)
    frame = pd.DataFrame({"item_id": [f"{name}-{i}" for i in range(n)], "slice": name, "task": f"t_{name}",
                          "sub_slice": "all", "cluster": [f"c{c}" for c in clusters], "output_type": "generate_until",
                          "target": "x", "correct_ref": ref, "correct_quant": ref})
    return frame.assign(stratum=[f"h{h}" for h in strata]) if strata is not None else frame


def test_the_guard_counts_random_clusters_not_strata(tmp_path) -> None:
    """400 unchanged items. Twelve design cells declared as strata, items independent: a slice of 400
    clusters, which passes (as clusters, the same cells were held inconclusive). Four strata of five
    clusters: 20 clusters but 17 once the strata's means are out, under gate.min_clusters_pass."""
    n = 400
    cells = np.arange(n) % 12
    nested = (np.arange(n) % 4) * 5 + (np.arange(n) // 4) % 5
    items = pd.concat([_unchanged("cells", n, cells, np.arange(n)),
                       _unchanged("as_clusters", n, None, cells),
                       _unchanged("nested", n, np.arange(n) % 4, nested)])
    decision = gate.gate_results(_write_run(tmp_path / "run", items), GateConfig())
    found = {c.slice: c for c in decision.runs[0].criteria if c.criterion == "accuracy_noninferiority"}
    assert found["cells"].outcome == gate.PASS
    assert found["as_clusters"].outcome == gate.INCONCLUSIVE
    assert found["nested"].outcome == gate.INCONCLUSIVE
    assert "17 of 400 items" in found["nested"].message and "20 clusters in all" in found["nested"].message


def test_sequential_spending_looks_are_stratified_and_the_guard_counts_within() -> None:
    items = _paired(240, 6, 3)
    record = {"method": "spending", "seed": 4, "round_items": 40}
    result = seqeval.gate_sequence(items, None, record, 0.05, 0.05, 1)
    codes = seqeval._codes(items["cluster"])[1]
    strata = seqeval._codes(items["stratum"])[1]
    direct = stats.spending_test((items["correct_quant"] - items["correct_ref"]).to_numpy(), codes, 0.05,
                                 seed=4, round_items=40, stop=False, strata=strata)
    assert result.looks_lower == direct.looks_lower and result.looks_upper == direct.looks_upper
    unstratified = seqeval.gate_sequence(items.drop(columns="stratum"), None, record, 0.05, 0.05, 1)
    assert unstratified.looks_lower != result.looks_lower
    diffs = np.zeros(40)
    assert seqeval._clusters_within(diffs, np.arange(40) // 2, np.arange(40) // 10) == 20 - 4 + 1
    assert seqeval._clusters_within(diffs, np.arange(40) // 2, None) == 20


@pytest.mark.parametrize("method", ["betting", "spending"])
def test_run_test_gives_strata_to_the_spending_test_only(method) -> None:
    diffs = -(np.arange(120) % 7 == 0).astype(float)
    result = seqeval.run_test(method, diffs, np.arange(120), 0.05, np.arange(120) % 4, alpha=0.05, family=1, seed=0,
                              round_items=None, stop=False)
    assert result.n == 120
