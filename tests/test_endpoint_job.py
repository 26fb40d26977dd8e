"""A served candidate through the whole job (``quant=external candidate.endpoint=...``): paired with the
reference as any candidate (records, flips, the gate), its API key nowhere in what the job writes, and
contradictory or secret-leaking configs refused before any work. The server is tests/fake_openai.py
holding the reference's own tiny model, so every item must agree with the reference."""
from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import pandas as pd
import pytest

from harness import cli
from harness.infra import joblog
from harness.config import to_config
from harness.job import pipeline as run_mod
from harness.models import loading as models
from tests.conftest import TINY_MATH

sys.path.insert(0, str(Path(__file__).parent))
from fake_openai import FakeServer  # noqa: E402

KEY_ENV = "HARNESS_TEST_ENDPOINT_KEY"
PLANTED = "sk-planted-9b3e51c0a7"
SMALL = [*TINY_MATH, "slices.math.n_items=8", "eval.max_gen_toks=12"]


def _files(root: Path):
    for directory, _, names in os.walk(root, followlinks=False):  # the model cache is a symlink: not followed
        for name in names:
            path = Path(directory) / name
            if path.is_file() and not path.is_symlink():
                yield path


@pytest.mark.slow
def test_a_served_candidate_pairs_with_the_reference_and_its_key_is_written_nowhere(make_cfg, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    reference = to_config(make_cfg(*SMALL, "quant=none"))
    loaded = models.load(reference.model, reference.paths.cache_dir)  # the same seeded tiny model the job loads
    monkeypatch.setenv(KEY_ENV, PLANTED)
    with FakeServer(loaded.model, loaded.tokenizer, api_key=PLANTED, name="tiny-served") as server, \
            joblog.job_console(verbose=True, stream=io.StringIO()):  # the command line's console: job.log
        result = run_mod.run(make_cfg(*SMALL, "quant=external", f"candidate.endpoint={server.url}",
                                      f"candidate.endpoint_api_key_env={KEY_ENV}", "gate.enabled=true"))
    assert result["scheme"] == f"external:endpoint-127.0.0.1-{server.httpd.server_address[1]}"
    assert result["candidate"]["candidate.method"] == "served"
    assert result["candidate"]["candidate.served_model"] == "tiny-served"
    # the server names no local checkpoint: its bits are not known, and not reported as 16
    assert "bits_per_weight" not in result["quant"] and "weight_gb" not in result["quant"]
    (results_dir,) = [d for d in (tmp_path / "results").iterdir() if (d / "summary.json").exists()]
    items = pd.read_parquet(results_dir / "items.parquet")
    assert set(items["output_type"]) == {"generate_until", "multiple_choice"}
    # the reference's own model behind the server: every item answered as the reference answered it
    assert (items["correct_ref"] == items["correct_quant"]).all()
    assert (items["response_ref"] == items["response_quant"]).all()
    assert result["gate"]["outcome"] != "fail" and (results_dir / "gate.json").exists()  # 16 items: no "pass" yet
    # token divergence from the server's top-k log-probs: labelled a lower bound everywhere it is shown
    tokens = pd.read_parquet(results_dir / "tokens.parquet")
    assert len(tokens) and (tokens["kl_bound"] == "topk_partition").all()
    assert (tokens["kl_cells"] >= 20).all()  # candidate.endpoint_divergence_topk's default, plus the actual token
    # the reference's own model served: the bound is ~0, the NLLs agree (float rounding of two forwards), and
    # the top-1s agree but where a random-weight model's two best logits are within rounding of each other
    assert tokens["kl"].max() < 1e-4
    assert (tokens["nll_quant"] - tokens["nll_ref"]).abs().max() < 1e-3
    assert (tokens["top1_ref"] == tokens["top1_quant"]).mean() > 0.99
    assert "math/kl_lower_bound_mean" in result["metrics"] and "math/kl_mean" not in result["metrics"]
    assert result["candidate"]["candidate.kl_bound"] == "topk_partition"
    assert "LOWER BOUND" in result["candidate"]["candidate.divergence"]
    report_md = (results_dir / "report.md").read_text()
    assert "LOWER BOUND" in report_md and "≥ " in report_md and "top-k lower bound" in report_md
    token_stats = pd.read_parquet(results_dir / "token_stats.parquet")
    assert (token_stats["kl_bound"] == "topk_partition").all()
    # the key: in no file the job wrote (results, job log, MLflow store and artifacts), no MLflow param or tag
    written = list(_files(tmp_path))
    assert any(p.name == "job.log" for p in written) and any(p.name == "mlflow.db" for p in written)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    artifacts = Path(unquote(urlparse(run.info.artifact_uri).path))
    if artifacts.exists() and tmp_path not in artifacts.parents:
        written += list(_files(artifacts))
    leaked = [str(p) for p in written if PLANTED.encode() in p.read_bytes()]
    assert not leaked, leaked
    values = {**run.data.params, **run.data.tags}
    assert not [k for k, v in values.items() if PLANTED in str(v)]
    assert run.data.params.get("candidate.endpoint_api_key_env") == KEY_ENV  # the variable's name is logged


@pytest.mark.parametrize("overrides, message", [
    (["quant=int8", "candidate.endpoint=http://127.0.0.1:9"], "use quant=external"),
    (["quant=external", "candidate.endpoint=http://127.0.0.1:9", "candidate.serve='x --port {port}'"], "not both"),
    (["quant=external", "candidate.endpoint=http://user:sk-secret@127.0.0.1:9"], "credentials in it"),
    (["quant=external", "candidate.serve='vllm serve d --port {port} --api-key sk-secret'"], "--api-key"),
    (["quant=external", "candidate.serve='vllm serve d --port 8000'"], r"has no \{port\}"),
    (["quant=external", "candidate.endpoint=http://127.0.0.1:9", "candidate.endpoint_api_key_env=sk-secret-value"],
     "NAME of an environment variable"),
    (["quant=external", "candidate.endpoint=localhost:9"], "not an http"),
])
def test_a_served_candidate_config_that_cannot_run_or_would_log_a_secret_fails_before_work(make_cfg, overrides,
                                                                                          message):
    with pytest.raises(cli.UsageError, match=message) as err:
        run_mod.run(make_cfg(*TINY_MATH, *overrides))
    assert "sk-secret" not in str(err.value)


@pytest.mark.slow
def test_a_served_candidate_runs_sequential_rounds_like_an_in_process_one(make_cfg, tmp_path):
    """eval.sequential with the served reference model: the same rounds, stop and records as in process."""
    seq = ["model=tiny_random", "slices=[math]", "slices.math.n_items=24", "slices.math.divergence_texts=2",
           "eval.sequential=true", "eval.sequential_round_items=6", "gate.enabled=true", "gate.min_items=1",
           "eval.max_gen_toks=12", "slices.math.tasks=[harness_math_gen,harness_math_mc]"]
    own = run_mod.run(make_cfg(*seq, "quant=none"))
    reference = to_config(make_cfg(*seq, "quant=none"))
    loaded = models.load(reference.model, reference.paths.cache_dir)
    with FakeServer(loaded.model, loaded.tokenizer) as server:
        served = run_mod.run(make_cfg(*seq, "quant=external", f"candidate.endpoint={server.url}"))
    for key in ("items_used", "items_total", "trajectory"):
        assert served["sequential"]["math"][key] == own["sequential"]["math"][key], key
    assert served["gate"]["outcome"] == own["gate"]["outcome"]
    directories = {json.loads((d / "summary.json").read_text())["scheme"]: d for d in (tmp_path / "results").iterdir()}
    ours = pd.read_parquet(directories["none"] / "items.parquet").sort_values("item_id", ignore_index=True)
    theirs = pd.read_parquet(directories[served["scheme"]] / "items.parquet").sort_values("item_id", ignore_index=True)
    columns = ["item_id", "correct_ref", "correct_quant", "response_ref", "response_quant", "seq_round"]
    pd.testing.assert_frame_equal(ours[columns], theirs[columns])


@pytest.mark.slow
def test_a_server_without_log_probs_gives_accuracy_and_flips_only_and_says_so(make_cfg, tmp_path):
    gen_only = ["model=tiny_random", "slices=[math]", "slices.math.n_items=6", "slices.math.divergence_texts=2",
                "slices.math.tasks=[harness_math_gen]", "eval.max_gen_toks=8"]
    reference = to_config(make_cfg(*gen_only, "quant=none"))
    loaded = models.load(reference.model, reference.paths.cache_dir)
    console = io.StringIO()
    with FakeServer(loaded.model, loaded.tokenizer, prompt_logprobs=False) as server, \
            joblog.job_console(verbose=True, stream=console):
        result = run_mod.run(make_cfg(*gen_only, "quant=external", f"candidate.endpoint={server.url}"))
    line = result["candidate"]["candidate.divergence"]
    assert line.startswith("served candidate: accuracy and flips only") and "no log-probs" in line
    assert "candidate.kl_bound" not in result["candidate"]
    assert not [key for key in result["metrics"] if key.split("/")[-1].startswith(("kl", "top1", "ppl"))]
    assert "math/flips_right_to_wrong" in result["metrics"] and result["metrics"]["math/n"] == 6
    (results_dir,) = [d for d in (tmp_path / "results").iterdir() if (d / "summary.json").exists()]
    assert pd.read_parquet(results_dir / "tokens.parquet").empty
    assert line in (results_dir / "report.md").read_text()
    assert line in (results_dir / "job.log").read_text()
