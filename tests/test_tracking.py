"""MLflow logging from a results directory: the job's own times, the experiment kind, one
dataset input per slice. Results directories are written here by hand, in the layout
run.py writes (summary.json, config.json, items.parquet), so each test says what it logs.
"""
from __future__ import annotations

import calendar
import hashlib
import json
import urllib.parse
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import pytest

from harness.results import tracking

FINISHED_AT = "2026-11-29T14:13:57+0000"
FINISHED_EPOCH = calendar.timegm((2026, 11, 29, 14, 13, 57, 0, 0, 0))
TIMINGS = {"load": 2.0, "model_load_s": 1.9, "reference": 43.25, "quantize": 1.5, "evaluate": 36.75,
           "divergence": 5.5, "write": 0.25, "logging": 3.0}
BEFORE_FINISH = 2.0 + 43.25 + 1.5 + 36.75 + 5.5  # every stage but model_* (inside load), write, logging


def write_result_dir(root: Path, scheme: str = "int4_g128", *, slices: dict[str, int] | None = None,
                     metrics: dict[str, float] | None = None, **summary_fields: Any) -> Path:
    """A finished results directory with ``slices`` ({name: number of items}) in items.parquet."""
    slices = slices or {"math": 6, "code": 4}
    directory = root / f"tiny__{scheme}"
    directory.mkdir(parents=True)
    rows = [{"item_id": f"{name}_task/{name}-{i:03d}", "slice": name, "task": f"{name}_task",
             "sub_slice": f"level={i % 2}", "cluster": f"c{i // 2}", "target": str(i),
             "correct_ref": float(i % 2), "correct_quant": float(i % 3 == 0)}
            for name, n in slices.items() for i in range(n)]
    pd.DataFrame(rows).to_parquet(directory / "items.parquet", index=False)
    summary = {"run_key": f"key-{scheme}", "run_name": f"tiny/{scheme}", "model": "tiny_random", "scheme": scheme,
               "method": "rtn", "slices": list(slices), "tags": {},
               "metrics": metrics or {"overall/acc_delta": -0.1, "overall/kl_mean": 0.02,
                                      "overall/flips_right_to_wrong": 3.0},
               "timings": dict(TIMINGS), "quant": {"bits_per_weight": 4.125}, "finished_at": FINISHED_AT,
               **summary_fields}
    (directory / "summary.json").write_text(json.dumps(summary))
    (directory / "config.json").write_text(json.dumps({"quant": {"name": scheme}, "model": {
        "name": "tiny_random", "source": "tiny_random", "dtype": "float32"}}))
    return directory


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One store for the module (creating its tables takes seconds); each test has its own experiment."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def experiment(request: pytest.FixtureRequest) -> str:
    return request.node.name


def only_run(uri: str, experiment: str) -> Any:
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


# -- the job's start and end times ---------------------------------------------------------------

def test_explicit_start_and_end_are_used_as_written():
    assert tracking.job_times({"started_at": 1_790_000_000.25, "ended_at": 1_790_000_900.5,
                               "finished_at": FINISHED_AT, "timings": TIMINGS}) == (1_790_000_000.25, 1_790_000_900.5)
    assert tracking.job_times({"started_at": "2026-11-29T14:00:00+00:00", "ended_at": "1795961000.5"}) == (
        calendar.timegm((2026, 11, 29, 14, 0, 0, 0, 0, 0)), 1_795_961_000.5)


def test_older_summaries_give_times_from_finished_at_and_the_stage_durations():
    start, end = tracking.job_times({"finished_at": FINISHED_AT, "timings": TIMINGS})
    assert end == pytest.approx(FINISHED_EPOCH + 0.25)
    assert start == pytest.approx(FINISHED_EPOCH - BEFORE_FINISH)
    # Only a start: the end is the start plus every stage up to the written results.
    start, end = tracking.job_times({"started_at": 1_790_000_000, "timings": TIMINGS})
    assert (start, end) == (1_790_000_000, pytest.approx(1_790_000_000 + BEFORE_FINISH + 0.25))


@pytest.mark.parametrize("summary", [
    {},
    {"finished_at": "yesterday", "timings": TIMINGS},
    {"started_at": None, "ended_at": float("nan"), "timings": {"load": "slow"}},
    {"started_at": True, "ended_at": -5},
])
def test_unusable_times_are_left_to_mlflow(summary):
    assert tracking.job_times(summary) == (None, None)


def test_a_start_after_the_end_is_dropped():
    assert tracking.job_times({"started_at": 1_790_000_100, "ended_at": 1_790_000_000}) == (None, 1_790_000_000)


@pytest.mark.slow
def test_logged_run_spans_the_job_not_the_logging(tmp_path, uri, experiment):
    directory = write_result_dir(tmp_path / "results", started_at=1_790_000_000.0, ended_at=1_790_000_725.5)
    run_id = tracking.log_results(directory, uri=uri, experiment=experiment)
    run = only_run(uri, experiment)
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert (run.info.start_time, run.info.end_time) == (1_790_000_000_000, 1_790_000_725_500)
    # results without item_stats.parquet have no headline: their numbers are under detail/
    assert run.data.metrics["detail/overall/acc_delta"] == -0.1 and run.data.metrics["detail/time/evaluate"] == 36.75
    assert run.data.params["quant.name"] == "int4_g128"
    assert run.data.tags["scheme"] == "int4_g128" and run.data.tags[tracking.RUN_KEY_TAG] == "key-int4_g128"
    assert tracking.log_results(directory, uri=uri, experiment=experiment) == run_id  # idempotent, still one run
    only_run(uri, experiment)


@pytest.mark.slow
def test_run_from_an_older_summary_lasts_as_long_as_its_stages(tmp_path, uri, experiment):
    tracking.log_results(write_result_dir(tmp_path / "results"), uri=uri, experiment=experiment)
    run = only_run(uri, experiment)
    assert run.info.end_time == round((FINISHED_EPOCH + 0.25) * 1000)
    assert (run.info.end_time - run.info.start_time) / 1000 == pytest.approx(BEFORE_FINISH + 0.25, abs=1e-3)


# -- the experiment opens on the classic runs table ----------------------------------------------

def test_created_experiment_is_marked_for_the_classic_run_view(tmp_path, uri, experiment):
    tracking.log_results(write_result_dir(tmp_path / "results"), uri=uri, experiment=experiment)
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    assert client.get_experiment_by_name(experiment).tags["mlflow.experimentKind"] == "custom_model_development"


def test_existing_experiment_gets_the_kind_only_when_it_has_none(tmp_path, uri, experiment):
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    untagged, chosen = f"{experiment}-untagged", f"{experiment}-chosen"
    client.create_experiment(untagged)
    client.create_experiment(chosen, tags={"mlflow.experimentKind": "genai_development"})
    for name in (untagged, chosen):
        tracking.log_results(write_result_dir(tmp_path / name), uri=uri, experiment=name)
    assert client.get_experiment_by_name(untagged).tags["mlflow.experimentKind"] == "custom_model_development"
    assert client.get_experiment_by_name(chosen).tags["mlflow.experimentKind"] == "genai_development"


# -- each slice is a dataset input ---------------------------------------------------------------

def reference_digest(ids_and_targets: list[tuple[str, str]]) -> str:
    text = "\n".join(sorted(f"{item}\t{target}" for item, target in ids_and_targets))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def test_each_slice_is_logged_as_a_dataset_with_its_items_digest_and_size(tmp_path, uri, experiment):
    directory = write_result_dir(tmp_path / "results", slices={"math": 6, "code": 4})
    tracking.log_results(directory, uri=uri, experiment=experiment)
    run = only_run(uri, experiment)
    datasets = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert set(datasets) == {"math", "code"}
    for name, n in (("math", 6), ("code", 4)):
        entry = datasets[name]
        expected = reference_digest([(f"{name}_task/{name}-{i:03d}", str(i)) for i in range(n)])
        assert entry.dataset.digest == expected
        profile = json.loads(entry.dataset.profile)
        assert profile["num_rows"] == n and profile["num_sub_slices"] == 2 and profile["num_clusters"] == (n + 1) // 2
        assert [t.value for t in entry.tags if t.key == "mlflow.data.context"] == ["eval"]
        assert json.loads(entry.dataset.source)["uri"] == f"{run.info.artifact_uri}/items.parquet"
    assert datasets["math"].dataset.digest != datasets["code"].dataset.digest


def test_digest_follows_the_items_not_their_order_or_the_answers():
    items = pd.DataFrame({"item_id": ["a", "b", "c"], "target": ["1", "2", "3"], "correct_quant": [1.0, 0.0, 1.0]})
    digest = tracking.slice_digest(items)
    assert digest == reference_digest([("a", "1"), ("b", "2"), ("c", "3")])
    assert tracking.slice_digest(items.iloc[::-1].assign(correct_quant=0.0)) == digest
    assert tracking.slice_digest(items.assign(target=["1", "2", "4"])) != digest
    assert tracking.slice_digest(items.iloc[:2]) != digest


def test_results_without_items_log_no_datasets_but_still_log(tmp_path, uri, experiment, caplog):
    directory = write_result_dir(tmp_path / "results")
    (directory / "items.parquet").unlink()
    tracking.log_results(directory, uri=uri, experiment=experiment)
    run = only_run(uri, experiment)
    assert run.inputs.dataset_inputs == [] and run.info.status == "FINISHED"
    assert "no items.parquet" in caplog.text


# -- links to the runs table, and a sweep's runs ---------------------------------------------------

def test_experiment_link_opens_the_classic_runs_table_and_filters_a_sweep():
    assert tracking.experiment_url("http://mlflow.lab:5000/", "7") == (
        "http://mlflow.lab:5000/#/experiments/7/runs?workflowType=machine_learning")
    link = tracking.experiment_url("sqlite:///x.db", "3", "multirun/2026-12-01/09-00-00")
    base, query = link.split("?")
    assert base == "http://127.0.0.1:5000/#/experiments/3/runs"
    assert urllib.parse.parse_qs(query) == {"workflowType": ["machine_learning"],
                                            "searchFilter": ["tags.`harness.sweep_id` = 'multirun/2026-12-01/09-00-00'"]}


def test_a_sweeps_runs_share_its_tag_and_the_logged_link_finds_exactly_them(tmp_path, uri, experiment, caplog):
    caplog.set_level("INFO", logger="harness.results.tracking")
    for scheme, sweep in (("int8", "A"), ("int4", "A"), ("int4_g128", "B")):
        tracking.log_results(write_result_dir(tmp_path / "results", scheme), uri=uri, experiment=experiment,
                             tags={tracking.SWEEP_TAG: sweep})
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    links = [m.split(": ", 1)[1] for m in caplog.messages if m.startswith("MLflow runs table")]
    filters = {urllib.parse.parse_qs(link.split("?")[1])["searchFilter"][0] for link in links}
    assert len(links) == 3 and len(filters) == 2  # one link per run, the same for runs of one sweep
    [search] = [f for f in filters if f.endswith("'A'")]
    found = client.search_runs([experiment_id], filter_string=search)
    assert sorted(r.data.tags["scheme"] for r in found) == ["int4", "int8"]
    assert all(r.data.tags.get("mlflow.parentRunId") is None for r in client.search_runs([experiment_id]))


def test_a_run_with_only_an_end_time_is_dated_by_it(tmp_path, uri, experiment):
    directory = write_result_dir(tmp_path / "results", ended_at=1_790_000_725.5, timings={})
    tracking.log_results(directory, uri=uri, experiment=experiment)
    run = only_run(uri, experiment)
    assert run.info.start_time == run.info.end_time == 1_790_000_725_500


# -- the run page's description: the terminal table and the gate --------------------------------

HEADLINE = pd.DataFrame([
    {"slice": "overall", "n": 36, "acc ref": "0.556", "acc quant": "0.444", "Δacc [95% CI]": "-0.111 [-0.250, +0.028]",
     "flips r→w / w→r": "6 / 2", "verdict": "inconclusive", "KL mean ± SE": "0.0412 ± 0.0020"},
    {"slice": "math", "n": 24, "acc ref": "0.5", "acc quant": "0.375", "Δacc [95% CI]": "-0.125 [-0.292, +0.042]",
     "flips r→w / w→r": "4 / 1", "verdict": "inconclusive", "KL mean ± SE": "0.0388 ± 0.0021"}])
GATE = {"outcome": "fail", "exit_code": 1, "runs": [{"run_name": "tiny/int4_g128", "outcome": "fail", "criteria": [
    {"slice": "math", "criterion": "accuracy_noninferiority", "outcome": "fail",
     "message": "fail: delta -12.5 pt [-29.2, +4.2] vs margin -5 pt"},
    {"slice": "code", "criterion": "kl_mean", "outcome": "pass", "message": "pass: kl_mean 0.04 <= 0.1"}]}]}


def write_report(directory: Path, gate: dict | None = None) -> None:
    """report.md as report.markdown lays it out (title, a line, the terminal table, more sections)."""
    table = HEADLINE.to_markdown(index=False)
    (directory / "report.md").write_text(f"# tiny/int4_g128\n\nScheme `int4_g128` (rtn) on `tiny_random`.\n\n"
                                         f"{table}\n\n## Sub-slices\n\n| slice | sub_slice |\n|:--|:--|\n| math | level=0 |\n")
    if gate is not None:
        (directory / "gate.json").write_text(json.dumps(gate))


def test_the_run_description_holds_the_terminal_table_and_the_gate(tmp_path, uri, experiment):
    directory = write_result_dir(tmp_path / "results")
    write_report(directory, GATE)
    run = tracking.log_results(directory, uri=uri, experiment=experiment)
    note = mlflow.tracking.MlflowClient(tracking_uri=uri).get_run(run).data.tags[tracking.NOTE_TAG]
    assert note.startswith("**tiny_random · int4_g128** (4.125 bits/weight) vs the reference "
                           "(tiny_random as loaded: random weights in float32)")
    assert "unquantized" not in note
    assert HEADLINE.to_markdown(index=False) in note  # the table as the terminal shows it, rows in order
    assert "sub_slice" not in note  # report.md's later sections stay in the artifacts
    assert "**Gate: fail** (exit code 1)" in note
    assert "| math | accuracy_noninferiority | fail | fail: delta -12.5 pt [-29.2, +4.2] vs margin -5 pt |" in note
    assert "| code | kl_mean | pass |" in note


def test_an_ungated_run_has_no_gate_and_a_long_table_fits_mlflows_limit(tmp_path):
    directory = write_result_dir(tmp_path / "results")
    write_report(directory)
    note = tracking.run_description(directory, json.loads((directory / "summary.json").read_text()))
    assert "Gate" not in note and HEADLINE.to_markdown(index=False) in note
    many = {**GATE, "runs": [{"criteria": [{"slice": f"s{i}", "criterion": "kl_mean", "outcome": "pass",
                                            "message": "pass: " + "x" * 80} for i in range(200)]}]}
    write_report(directory, many)
    note = tracking.run_description(directory, json.loads((directory / "summary.json").read_text()))
    assert len(note) <= tracking.MAX_NOTE_CHARS
    assert HEADLINE.to_markdown(index=False) in note and "**Gate: fail**" in note  # gate rows go first


def test_the_experiment_gets_a_description_unless_it_has_one(tmp_path, uri, experiment):
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    described = f"{experiment}-described"
    client.create_experiment(described, tags={tracking.NOTE_TAG: "our own words"})
    for name in (experiment, described):
        tracking.log_results(write_result_dir(tmp_path / name), uri=uri, experiment=name)
    assert client.get_experiment_by_name(experiment).tags[tracking.NOTE_TAG] == tracking.EXPERIMENT_DESCRIPTION
    assert client.get_experiment_by_name(described).tags[tracking.NOTE_TAG] == "our own words"
    assert "\n" not in tracking.EXPERIMENT_DESCRIPTION  # one paragraph
