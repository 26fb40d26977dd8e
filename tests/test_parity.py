"""Simulation against served (harness.compare.parity_table, python -m harness.parity) on hand-built runs.

Every number is checked against a count made here from the items, not by the module's own code.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from harness.compare.parity_table import ParityInputs, agreement_frame, parity_table
from harness.compare.sources import RunData, load_results_dir
from harness.errors import UsageError
from harness.job import parity_runs as parity_cli


def _items(n: int, seed: int, flip: float, answers: np.ndarray | None = None) -> pd.DataFrame:
    """``n`` items in two slices and n/2 clusters; the quantized answer differs from the reference's
    on a ``flip`` share of items (a different answer is a wrong one)."""
    rng = np.random.default_rng(seed)
    ref = rng.integers(0, 4, n) if answers is None else answers
    changed = rng.random(n) < flip
    quant = np.where(changed, (ref + 1) % 4, ref)
    return pd.DataFrame({
        "item_id": [f"i{k}" for k in range(n)], "slice": np.where(np.arange(n) < n // 2, "math", "code"),
        "sub_slice": "all", "cluster": [f"c{k // 2}" for k in range(n)], "output_type": "generate_until",
        "target": "0", "correct_ref": (ref == 0).astype(float), "correct_quant": (quant == 0).astype(float),
        "response_ref": ref.astype(str), "response_quant": quant.astype(str)})


def _run(items: pd.DataFrame, scheme: str, source: str, metrics: dict | None = None) -> RunData:
    return RunData(run_id=None, summary={"model": "m", "scheme": scheme, "metrics": metrics or {}}, items=items,
                   tokens=pd.DataFrame(), generation=pd.DataFrame(), source=source)


def _three(n: int = 200, parity_flip: float = 0.05, floor_flip: float = 0.05, seed: int = 0):
    reference = np.random.default_rng(seed + 100).integers(0, 4, n)
    simulation = _items(n, seed, 0.2, reference)
    served = simulation.copy()
    rng = np.random.default_rng(seed + 1)
    moved = rng.random(n) < parity_flip
    answers = np.where(moved, (simulation["response_quant"].astype(int) + 1) % 4,
                       simulation["response_quant"].astype(int))
    served["response_quant"] = answers.astype(str)
    served["correct_quant"] = (answers == 0).astype(float)
    floor = _items(n, seed + 2, floor_flip, reference)
    return (_run(simulation, "fp8", "sim", {"math/kl_mean": 0.01, "overall/kl_mean": 0.02}),
            _run(served, "external:fp8-served", "served", {"math/kl_lower_bound_mean": 0.008}),
            _run(floor, "external:reference-served", "floor"))


def test_counts_equal_a_hand_count():
    sim, served, floor = _three()
    table = parity_table(ParityInputs(sim, served, floor)).set_index("slice")
    for name in ("overall", "math", "code"):
        keep = slice(None) if name == "overall" else sim.items["slice"] == name
        s, v, f = sim.items[keep], served.items[keep], floor.items[keep]
        row = table.loc[name]
        assert row["n"] == len(s)
        assert row["acc_sim"] == pytest.approx(s["correct_quant"].mean())
        assert row["acc_served"] == pytest.approx(v["correct_quant"].mean())
        assert row["delta"] == pytest.approx(v["correct_quant"].mean() - s["correct_quant"].mean())
        assert row["sim_right_served_wrong"] == int(((s["correct_quant"] == 1) & (v["correct_quant"] == 0)).sum())
        assert row["sim_wrong_served_right"] == int(((s["correct_quant"] == 0) & (v["correct_quant"] == 1)).sum())
        differ = (s["response_quant"].to_numpy() != v["response_quant"].to_numpy()).mean()
        floor_differ = (f["response_ref"].to_numpy() != f["response_quant"].to_numpy()).mean()
        assert row["disagree_sim_served"] == pytest.approx(differ)
        assert row["disagree_floor"] == pytest.approx(floor_differ)
        assert row["excess"] == pytest.approx(floor_differ - differ)  # agreement (1 - differ) difference
        assert row["excess_ci_low"] <= row["excess"] <= row["excess_ci_high"]
    assert table.loc["math", "kl_sim"] == 0.01 and table.loc["overall", "kl_sim"] == 0.02
    assert table.loc["math", "kl_served"] == 0.008 and table.loc["math", "kl_served_on"] == "top-k lower bound"
    assert np.isnan(table.loc["code", "kl_served"])


def test_the_flag_follows_the_excess():
    sim, served, floor = _three(n=400, parity_flip=0.4, floor_flip=0.02)
    far = parity_table(ParityInputs(sim, served, floor)).set_index("slice")
    assert far.loc["overall", "exceeds_floor"] and far.loc["overall", "excess_ci_high"] < 0
    sim, served, floor = _three(n=400, parity_flip=0.0, floor_flip=0.2)  # the simulation matches the engine
    near = parity_table(ParityInputs(sim, served, floor)).set_index("slice")
    assert not near.loc["overall", "exceeds_floor"] and near.loc["overall", "excess"] > 0


def test_without_a_floor_there_is_no_flag():
    sim, served, _ = _three()
    table = parity_table(ParityInputs(sim, served, None))
    assert table["exceeds_floor"].isna().all() and table["excess"].isna().all()
    assert agreement_frame(ParityInputs(sim, served, None))["agree_floor"].isna().all()


def test_runs_of_other_items_or_models_are_refused():
    sim, served, floor = _three()
    fewer = _run(served.items.iloc[:-3], "x", "served")
    with pytest.raises(UsageError, match="other items"):
        parity_table(ParityInputs(sim, fewer, floor))
    other = _run(served.items, "x", "served")
    other.summary["model"] = "other"
    with pytest.raises(UsageError, match="one model"):
        parity_table(ParityInputs(sim, other, floor))
    unquantized = _run(sim.items, "none", "sim")
    with pytest.raises(UsageError, match="unquantized"):
        parity_table(ParityInputs(unquantized, served, floor))


def _write(directory, run: RunData) -> str:
    directory.mkdir()
    (directory / "summary.json").write_text(json.dumps(run.summary))
    run.items.to_parquet(directory / "items.parquet", index=False)
    return str(directory)


def test_command_on_finished_runs_writes_the_table(tmp_path, capsys):
    sim, served, floor = _three(parity_flip=0.4, floor_flip=0.0)
    dirs = [_write(tmp_path / name, run) for name, run in (("sim", sim), ("served", served), ("floor", floor))]
    out = tmp_path / "parity"
    code = parity_cli.main([f"simulation={dirs[0]}", f"served={dirs[1]}", f"floor={dirs[2]}", f"out={out}",
                            "log=false"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "EXCEEDS FLOOR" in printed and "disagree beyond the larger noise floor" in printed
    table = pd.read_parquet(out / "parity.parquet")
    again = parity_table(ParityInputs(load_results_dir(dirs[0]), load_results_dir(dirs[1]), load_results_dir(dirs[2])))
    pd.testing.assert_frame_equal(table, again)
    assert json.loads((out / "parity.json").read_text())["floor"] == dirs[2]


def test_command_needs_its_runs(tmp_path):
    assert parity_cli.main(["simulation=/nonexistent"]) == 2
    assert parity_cli.main(["serve=vllm serve --port {port}", "model=tiny_random", "quant=int8"]) == 2


def test_compare_shows_the_parity_table(tmp_path):
    from harness.compare import compare_runs

    sim, served, floor = _three(parity_flip=0.4, floor_flip=0.0)
    dirs = [_write(tmp_path / name, run) for name, run in (("sim", sim), ("served", served), ("floor", floor))]
    report = compare_runs(dirs=dirs, parity=True, out=str(tmp_path / "compare"), n_resamples=200)
    expected = parity_table(ParityInputs(*[load_results_dir(d) for d in dirs]))
    pd.testing.assert_frame_equal(report.parity, expected)
    written = (tmp_path / "compare" / "comparison.md").read_text()
    assert "## Simulation against served" in written and "EXCEEDS FLOOR" in written
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "compare" / "parity.parquet"), expected)
    with pytest.raises(ValueError, match="2 to 4 runs"):
        compare_runs(dirs=dirs[:1], parity=True, write=False)
