"""The deployment gate: each outcome on constructed results, exit codes, JUnit XML, bad input, a real run."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from harness.decision import gate
from harness.config import GateConfig, TokenGateConfig
from tests.conftest import TINY_MATH

MODEL = {"name": "m", "source": "hf", "path": "org/m", "gguf_file": None, "revision": None, "dtype": "float32"}
COMPARE = {"n_resamples": 1000, "ci_level": 0.95, "seed": 0, "margin": 0.02, "correction": "holm"}


def slice_items(name: str, ref: np.ndarray, quant: np.ndarray, clusters: np.ndarray | None = None,
                output_type: str = "generate_until") -> pd.DataFrame:
    n = len(ref)
    return pd.DataFrame({
        "item_id": [f"{name}-{i}" for i in range(n)], "slice": name, "task": f"t_{name}", "sub_slice": "all",
        "cluster": [f"c{i}" for i in range(n)] if clusters is None else [f"c{c}" for c in clusters],
        "output_type": output_type, "target": "x", "correct_ref": ref.astype(float),
        "correct_quant": quant.astype(float)})


def scores(n: int, ref_right: int, lost: int, gained: int) -> tuple[np.ndarray, np.ndarray]:
    """ref right on the first ``ref_right`` items; quant loses ``lost`` of them and gains ``gained`` others."""
    ref = np.zeros(n)
    ref[:ref_right] = 1
    quant = ref.copy()
    quant[:lost] = 0
    quant[ref_right:ref_right + gained] = 1
    return ref, quant


def write_run(directory: Path, items: pd.DataFrame, *, model: dict | None = None, metrics: dict | None = None,
              scheme: str = "int4", sweep: str = "") -> Path:
    directory.mkdir(parents=True)
    items.to_parquet(directory / "items.parquet")
    (directory / "config.json").write_text(json.dumps({"model": model or MODEL, "compare": COMPARE}))
    (directory / "summary.json").write_text(json.dumps({"run_name": f"m/{scheme}/x", "model": "m", "scheme": scheme,
                                                        "metrics": metrics or {},
                                                        "tags": {"harness.sweep_id": sweep} if sweep else {}}))
    return directory


def outcome_of(decision: gate.GateDecision, slice_name: str, criterion: str = "accuracy_noninferiority") -> gate.Criterion:
    (found,) = [c for c in decision.runs[0].criteria if c.slice == slice_name and c.criterion == criterion]
    return found


def test_each_outcome_on_constructed_slices(tmp_path):
    items = pd.concat([
        slice_items("same", *scores(400, 320, 2, 2)),  # Δ 0 with 4 discordant of 400: non-inferior at 2 pt
        slice_items("broken", *scores(400, 320, 60, 0)),  # Δ -15 pt: worse beyond the margin
        slice_items("noisy", *scores(60, 40, 6, 6)),  # Δ 0, 12 flips of 60: the MDE is far above 2 pt
        slice_items("floor", *scores(400, 20, 0, 0)),  # reference right on 5%: cannot show a loss
        slice_items("few", *scores(20, 16, 0, 0)),  # 20 items < min_items
        slice_items("lumped", *scores(400, 320, 0, 0), clusters=np.arange(400) % 3),  # 3 clusters
    ])
    run = write_run(tmp_path / "run", items)
    decision = gate.decide([run], GateConfig())
    assert outcome_of(decision, "same").outcome == "pass"
    assert outcome_of(decision, "broken").outcome == "fail"
    noisy = outcome_of(decision, "noisy")
    assert noisy.outcome == "inconclusive" and any("MDE" in r for r in noisy.reasons)
    assert noisy.numbers["n_needed"] > 60  # more items would settle it, and the gate says how many
    floor = outcome_of(decision, "floor")
    assert floor.outcome == "inconclusive" and "floor" in floor.reasons[0] and floor.numbers["n_needed"] is None
    assert "too few items" in outcome_of(decision, "few").reasons[0]
    lumped = outcome_of(decision, "lumped")
    assert "too few clusters" in lumped.reasons[0] and lumped.numbers["n_needed"] is None
    assert decision.outcome == "fail" and decision.exit_code == 1


def test_noninferiority_p_matches_an_independent_tango_score_test(tmp_path):
    from tests.test_stats_score import _tango_z

    ref, quant = scores(400, 320, 5, 2)
    run = write_run(tmp_path / "run", slice_items("s", ref, quant))
    found = outcome_of(gate.decide([run], GateConfig(margin=0.03)), "s")
    expected = sps.t.sf(_tango_z(-0.03, 2.0, 5.0, 400), 399)  # items are their own clusters: Tango's test
    assert found.numbers["noninferiority_p"] == pytest.approx(expected, rel=1e-6)
    assert found.numbers["ci_level"] == pytest.approx(0.90)  # the interval shown is the 1 - 2α one
    assert (found.numbers["noninferiority_p"] < 0.05) == (found.numbers["delta_ci_low"] > -0.03)


def _table_slice(name: str, n: int, lost: int, gained: int) -> pd.DataFrame:
    return slice_items(name, *scores(n, int(0.8 * n), lost, gained))


def test_passing_needs_no_correction_over_slices(tmp_path):
    """Intersection-union: a slice that passes alone passes among five (Holm made it fail before)."""
    close = _table_slice("close", 2000, 30, 8)  # Δ -1.1 pt against a 2-point margin
    others = [_table_slice(f"ok{i}", 2000, 10, 10) for i in range(4)]
    run = write_run(tmp_path / "run", pd.concat([close, *others]))
    decision = gate.decide([run], GateConfig(margin=0.02))  # the run's compare.correction: holm
    found = outcome_of(decision, "close")
    assert found.numbers["delta_ci_low"] > -0.02  # the shown interval lies inside the margin ...
    assert found.outcome == "pass" and decision.outcome == "pass"  # ... so it never fails, and here passes


def test_the_fail_claim_is_bonferroni_corrected_and_shows_its_bound(tmp_path):
    lost = next(k for k in range(5, 200) if _fails_alone_not_among_two(k))
    items = pd.concat([_table_slice("a", 600, lost, 0), _table_slice("b", 600, lost, 0)])
    run = write_run(tmp_path / "run", items)
    alone = gate.decide([run], GateConfig(margin=0.02, correction="none"))
    corrected = gate.decide([run], GateConfig(margin=0.02))
    assert alone.outcome == "fail" and corrected.outcome == "inconclusive"
    a = outcome_of(corrected, "a")
    assert a.numbers["family"] == 2 and a.numbers["fail_level"] == pytest.approx(0.95)
    assert a.numbers["fail_ci_high"] >= -0.02 and "Bonferroni over 2 slices" in a.message


def _fails_alone_not_among_two(lost: int) -> bool:
    from harness.stats import score_test

    ref, quant = scores(600, 480, lost, 0)
    test = score_test(quant - ref, np.arange(600))
    return test.interval(0.90)[1] < -0.02 <= test.interval(0.95)[1]


def test_per_slice_margin_overrides_the_default(tmp_path):
    ref, quant = scores(2000, 1600, 70, 10)  # Δ -3 pt
    run = write_run(tmp_path / "run", slice_items("s", ref, quant))
    assert gate.decide([run], GateConfig()).outcome == "fail"
    assert gate.decide([run], GateConfig(margins={"s": 0.10})).outcome == "pass"


def test_a_slice_at_the_margin_is_not_told_more_items_would_settle_it(tmp_path):
    ref, quant = scores(300, 240, 7, 1)  # Δ -2 pt exactly against a 2-point margin
    run = write_run(tmp_path / "run", slice_items("s", ref, quant))
    found = outcome_of(gate.decide([run], GateConfig(margin=0.02)), "s")
    assert found.outcome == "inconclusive" and found.numbers["n_needed"] is None
    assert any("cannot be settled by more items" in r for r in found.reasons)


def test_token_gates_per_slice(tmp_path):
    ref, quant = scores(400, 320, 2, 2)
    metrics = {"s/kl_mean": 0.08, "s/kl_mean_se": 0.01, "s/top1_agree": 0.91}
    run = write_run(tmp_path / "run", slice_items("s", ref, quant), metrics=metrics)
    ok = gate.decide([run], GateConfig(token=TokenGateConfig(kl_mean_max=0.1, top1_agree_min=0.9)))
    assert [c.outcome for c in ok.runs[0].criteria] == ["pass", "pass", "pass"]
    strict = gate.decide([run], GateConfig(token_slices={"s": TokenGateConfig(kl_mean_max=0.05)}))
    kl = outcome_of(strict, "s", "kl_mean")
    assert kl.outcome == "fail" and "0.08" in kl.message and strict.exit_code == 1


def test_cli_exit_codes_and_junit_xml(tmp_path, capsys):
    passing = write_run(tmp_path / "pass", slice_items("s", *scores(400, 320, 2, 2)))
    failing = write_run(tmp_path / "fail", slice_items("s", *scores(400, 320, 60, 0)))
    unsure = write_run(tmp_path / "unsure", slice_items("s", *scores(60, 40, 6, 6)))
    assert gate.main([str(passing)]) == 0
    assert gate.main([str(failing)]) == 1
    assert gate.main([str(unsure)]) == 2
    out = capsys.readouterr().out
    assert "n_needed" in out and "inconclusive" in out

    root = ET.parse(failing / "gate.xml").getroot()
    assert root.tag == "testsuites" and root.get("failures") == "1" and root.get("tests") == "1"
    (case,) = root.iter("testcase")
    assert case.get("classname") == "m/int4/x.s" and case.get("name") == "accuracy_noninferiority"
    assert "-15.0 pt" in case.find("failure").get("message")
    skipped = ET.parse(unsure / "gate.xml").getroot()
    assert skipped.get("skipped") == "1" and next(skipped.iter("skipped")).get("message").startswith("inconclusive")
    saved = json.loads((passing / "gate.json").read_text())
    assert saved["outcome"] == "pass" and saved["runs"][0]["slices"] == {"s": "pass"}


def test_a_verdict_on_simulated_activations_says_what_it_leaves_out(tmp_path, capsys):
    items = slice_items("s", *scores(400, 320, 2, 2))
    plain = write_run(tmp_path / "w4", items)
    w8a8 = write_run(tmp_path / "fp8", items, scheme="fp8")
    summary = json.loads((w8a8 / "summary.json").read_text())
    summary["simulated_activations"] = "fp8_e4m3, per token, dynamic scales"
    (w8a8 / "summary.json").write_text(json.dumps(summary))
    assert gate.main([str(plain)]) == 0 and "note:" not in capsys.readouterr().out
    assert gate.main([str(w8a8)]) == 0  # the verdict stands; the note travels with it
    out = capsys.readouterr().out
    assert "note: fp8: activations quantized in simulation (fp8_e4m3, per token, dynamic scales)" in out
    assert "python -m harness.parity model=m quant=fp8" in out
    (note,) = json.loads((w8a8 / "gate.json").read_text())["runs"][0]["notes"]
    assert "serving engine" in note
    assert json.loads((plain / "gate.json").read_text())["runs"][0]["notes"] == []


def test_sweep_directory_gates_every_run_and_takes_the_worst(tmp_path):
    sweep = tmp_path / "results"
    write_run(sweep / "a", slice_items("s", *scores(400, 320, 2, 2)), scheme="int8", sweep="night1")
    write_run(sweep / "b", slice_items("s", *scores(400, 320, 60, 0)), scheme="int4", sweep="night2")
    (sweep / "compare").mkdir()  # other outputs under results/ are not runs
    assert gate.main([str(sweep)]) == 1
    saved = json.loads((sweep / "gate.json").read_text())
    assert [r["outcome"] for r in saved["runs"]] == ["pass", "fail"]
    assert len(list(ET.parse(sweep / "gate.xml").getroot().iter("testsuite"))) == 2
    assert gate.main([str(sweep), "sweep=night1"]) == 0  # one sweep's runs, by harness.sweep_id
    assert gate.main([str(sweep), "sweep=night3"]) == gate.EXIT_BAD_INPUT


def test_bad_input_is_refused_with_a_clear_message(tmp_path, capsys):
    items = slice_items("s", *scores(400, 320, 2, 2))
    run = write_run(tmp_path / "results" / "run", items)
    for margin in ("0", "1.5", "-0.01"):
        assert gate.main([str(run), f"gate.margin={margin}"]) == gate.EXIT_BAD_INPUT
        assert "must lie in (0, 1)" in capsys.readouterr().err
    assert gate.main([str(run), "gate.margins.s=1"]) == gate.EXIT_BAD_INPUT
    assert gate.main([str(run), "gate.margins.typo=0.05"]) == gate.EXIT_BAD_INPUT
    assert "no gated run has" in capsys.readouterr().err

    other = write_run(tmp_path / "results" / "other", items, model={**MODEL, "name": "n", "path": "org/n"})
    assert gate.main([str(run), str(other), f"out={tmp_path}"]) == gate.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "different reference models (m (org/m): 1 run; n (org/n): 1 run)" in err
    assert f"`python -m harness.gate {run} {other} model=m` or `python -m harness.gate {run} {other} model=n`" in err
    assert gate.main([str(tmp_path / "results"), "model=m"]) == 0  # picking one model's runs is the fix
    assert gate.main([str(tmp_path / "results"), "model=zz"]) == gate.EXIT_BAD_INPUT
    assert "models there: m, n" in capsys.readouterr().err

    (other / "summary.json").unlink()  # as an interrupted job leaves it
    assert gate.main([str(other)]) == gate.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "not a finished run" in err and "summary.json" in err and err.count("\n") == 1
    assert gate.main([str(tmp_path / "nothing-here")]) == gate.EXIT_BAD_INPUT


@pytest.mark.parametrize("damage", ["truncated summary", "truncated items", "nan score", "missing column"])
def test_corrupt_run_files_exit_3_with_one_line(tmp_path, capsys, damage):
    ref, quant = scores(400, 320, 2, 2)
    items = slice_items("s", ref, quant)
    if damage == "nan score":
        items.loc[3, "correct_quant"] = np.nan
    if damage == "missing column":
        items = items.drop(columns="correct_ref")
    run = write_run(tmp_path / "run", items)
    if damage == "truncated summary":
        text = (run / "summary.json").read_text()
        (run / "summary.json").write_text(text[: len(text) // 2])
    if damage == "truncated items":
        data = (run / "items.parquet").read_bytes()
        (run / "items.parquet").write_bytes(data[: len(data) // 2])
    assert gate.main([str(run)]) == gate.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    expected = {"truncated summary": "summary.json", "truncated items": "items.parquet",
                "nan score": "correct_quant", "missing column": "correct_ref"}[damage]
    assert expected in err and "force=true" in err


def test_sweep_filter_applies_before_loading(tmp_path):
    sweep = tmp_path / "results"
    write_run(sweep / "a", slice_items("s", *scores(400, 320, 2, 2)), scheme="int8", sweep="night1")
    unfinished = sweep / "b"  # another sweep's job, still running: only the run.json a job writes at start
    unfinished.mkdir(parents=True)
    (unfinished / "run.json").write_text(json.dumps({"model": "m", "scheme": "int4", "sweep_id": "night2"}))
    assert gate.main([str(sweep), "sweep=night1"]) == 0
    assert gate.main([str(sweep), "sweep=night2"]) == gate.EXIT_BAD_INPUT  # that one is not finished


def test_gate_on_a_real_tiny_random_run_reproduces_its_statistics(make_cfg, tmp_path):
    from harness.job import pipeline as run_mod

    result = run_mod.run(make_cfg(*TINY_MATH, "slices.math.n_items=40", "quant=int4_g128", "tracking.enabled=false"))
    (directory,) = [p for p in (tmp_path / "results").iterdir() if p.is_dir()]
    assert result["run_key"][:8] in directory.name
    default = gate.gate_results(directory, GateConfig())
    math_row = outcome_of(default, "math")
    assert math_row.outcome == "inconclusive"  # random weights: the reference is at the floor
    # With the floor check off the decision rests on the paired test; its Δ and CI are the run's own.
    # alpha 0.025: the gate's 1 - 2α interval is the run's 95 % one.
    decision = gate.decide([directory], GateConfig(min_headroom=-1.0, min_items=1, min_clusters=2, alpha=0.025))
    numbers = outcome_of(decision, "math").numbers
    stats_row = pd.read_parquet(directory / "item_stats.parquet").query("level == 'slice' and slice == 'math'").iloc[0]
    assert numbers["delta"] == pytest.approx(stats_row["delta"])
    assert (numbers["delta_ci_low"], numbers["delta_ci_high"]) == pytest.approx(
        (stats_row["delta_ci_low"], stats_row["delta_ci_high"]))
    assert numbers["n"] == stats_row["n"]
    root = ET.parse(directory / "gate.xml").getroot()
    assert root.get("tests") == str(len(default.runs[0].criteria))
    assert json.loads((directory / "gate.json").read_text())["exit_code"] == default.exit_code


def test_a_clustered_pass_needs_min_clusters_pass_clusters(tmp_path):
    """400 items, no flips: non-inferior on the interval whatever the clustering. In 12 clusters of
    multi-item sources it is held inconclusive (the measured false-pass rate exceeds α there), in
    25 clusters it passes, and gate.min_clusters_pass=0 lifts the minimum."""
    items = pd.concat([
        slice_items("twelve", *scores(400, 320, 0, 0), clusters=np.arange(400) % 12),
        slice_items("twentyfive", *scores(400, 320, 0, 0), clusters=np.arange(400) % 25),
        slice_items("singletons", *scores(400, 320, 0, 0)),
    ])
    run = write_run(tmp_path / "run", items)
    decision = gate.gate_results(run, GateConfig())
    twelve = outcome_of(decision, "twelve")
    assert twelve.outcome == gate.INCONCLUSIVE and twelve.numbers["delta_ci_low"] > -0.02
    assert "gate.min_clusters_pass" in twelve.message and "12 of 400 items" in twelve.message
    assert outcome_of(decision, "twentyfive").outcome == gate.PASS
    assert outcome_of(decision, "singletons").outcome == gate.PASS
    lifted = gate.gate_results(run, GateConfig(min_clusters_pass=0))
    assert outcome_of(lifted, "twelve").outcome == gate.PASS


def test_a_kl_lower_bound_can_fail_a_kl_gate_but_never_pass_it(tmp_path):
    """A served candidate reports only a lower bound of its KL (the server's top-k partition)."""
    ref, quant = scores(400, 320, 2, 2)
    above = write_run(tmp_path / "above", slice_items("s", ref, quant), metrics={"s/kl_lower_bound_mean": 0.2})
    below = write_run(tmp_path / "below", slice_items("s", ref, quant), metrics={"s/kl_lower_bound_mean": 0.01})
    cfg = GateConfig(token=TokenGateConfig(kl_mean_max=0.1))
    failed = outcome_of(gate.decide([above], cfg), "s", "kl_mean")
    assert failed.outcome == "fail" and "lower bound" in failed.message
    unknown = outcome_of(gate.decide([below], cfg), "s", "kl_mean")
    assert unknown.outcome == "inconclusive" and "cannot show" in unknown.message


def test_two_runs_of_one_config_are_labelled_by_their_directories(tmp_path, capsys):
    """results/ after a fresh default job holds it beside results/example: same run name, two rows groups."""
    write_run(tmp_path / "a", slice_items("s", *scores(400, 320, 2, 2)))
    write_run(tmp_path / "b", slice_items("s", *scores(400, 320, 60, 0)))
    assert gate.main([str(tmp_path)]) == 1
    runs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("run ")]
    assert len(runs) == 2 and runs[0] != runs[1]
    assert all(line.endswith(("/a)", "/b)")) for line in runs), runs
