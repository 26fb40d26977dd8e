"""Sweeps: one job per scheme, grouped by a sweep id in MLflow, the reference computed once
even by jobs running in parallel, the launcher configs, and the dry-run plan.

The multi-process tests start real ``python -m harness`` processes (what a user or Slurm
runs); the helpers here are shared by the resume, tracking-server and Slurm tests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import pytest

from harness.job import pipeline as run_mod
from harness.job import sweep
from harness.results.tracking import RUN_KEY_TAG, SWEEP_TAG

REPO = Path(__file__).resolve().parents[1]
TINY = ["model=tiny_random", "slices=[math]", "slices.math.n_items=9", "slices.math.divergence_texts=2",
        "compare.n_resamples=1000", "slices.math.tasks=[harness_math_gen,harness_math_mc]"]  # both math tasks


# ------------------------------------------------------------------ helpers (shared) ---------


def job_env(**extra: str) -> dict[str, str]:
    """Environment of a harness subprocess: one thread each, so parallel jobs share the 2 cores."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(extra)
    return env


def paths(tmp_path: Path, cache_dir: Path, *, results: str = "results", mlflow_uri: str | None = None) -> list[str]:
    return [f"paths.results_dir={tmp_path / results}", f"paths.cache_dir={cache_dir}",
            f"tracking.uri={mlflow_uri or sqlite_uri(tmp_path)}"]


def sqlite_uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def harness_command(*args: str, module: str = "harness") -> list[str]:
    return [sys.executable, "-m", module, *args]


def run_harness(*args: str, cwd: Path, module: str = "harness", timeout: float = 900,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m <module> <args>`` to completion; fails the test with its output if it fails."""
    proc = subprocess.run(harness_command(*args, module=module), cwd=cwd, env=env or job_env(), timeout=timeout,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"python -m {module} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-8000:]}")
    return proc


def summaries(results_root: Path) -> dict[str, dict[str, Any]]:
    """{scheme: summary.json} of the finished results under a results root."""
    found = {}
    for path in sorted(results_root.glob("*/summary.json")):
        summary = json.loads(path.read_text())
        found[summary["scheme"]] = summary
    return found


def mlflow_runs(uri: str, experiment: str = "quant-harness") -> list[Any]:
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


def create_store(uri: str, experiment: str = "quant-harness") -> None:
    """Create the MLflow tables and experiment up front, as a team server would have them."""
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    if client.get_experiment_by_name(experiment) is None:
        client.create_experiment(experiment)


# ------------------------------------------------------------------ sweep id (fast) ----------


def test_sweep_id_is_explicit_else_absent_outside_a_multirun():
    assert sweep.tags_with_sweep_id({"sweep_id": "overnight-1", "owner": "me"}) == {
        SWEEP_TAG: "overnight-1", "owner": "me"}
    assert sweep.tags_with_sweep_id({"sweep_id": "", "owner": "me"}) == {"owner": "me"}
    assert sweep.tags_with_sweep_id({}) == {}
    assert sweep.tags_with_sweep_id({"sweep_id": "", SWEEP_TAG: "set-in-code"}) == {SWEEP_TAG: "set-in-code"}


@pytest.mark.slow
def test_a_later_sweep_reuses_results_but_logs_its_own_run(make_cfg, tmp_path):
    base = [*TINY, "quant=int8"]
    first = run_mod.run(make_cfg(*base, "tracking.tags.sweep_id=night-1"))
    again = run_mod.run(make_cfg(*base, "tracking.tags.sweep_id=night-2"))
    assert again["finished_at"] == first["finished_at"]  # reused from disk, not recomputed
    run_mod.run(make_cfg(*base, "tracking.tags.sweep_id=night-2"))  # the same sweep again: no new run
    runs = mlflow_runs(sqlite_uri(tmp_path))
    assert sorted(r.data.tags[SWEEP_TAG] for r in runs) == ["night-1", "night-2"]
    assert {r.data.tags[RUN_KEY_TAG] for r in runs} == {first["run_key"]}
    assert all(r.info.status == "FINISHED" for r in runs)


# ------------------------------------------------------------------ launcher configs (fast) --


def test_slurm_launcher_config_makes_a_valid_sbatch_script(tmp_path):
    """Every key of conf/hydra/launcher/slurm.yaml is a parameter submitit's Slurm executor knows."""
    import submitit
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from harness.config import CONF_DIR, register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    assert launcher["_target_"].endswith("SlurmLauncher")
    base = {"timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name",
            "stderr_to_stdout"}
    params = {(k if k in base else f"slurm_{k}"): v for k, v in launcher.items()
              if k not in ("_target_", "submitit_folder", "max_num_timeout")}
    params["name"] = "harness"
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm",
                                     slurm_max_num_timeout=launcher["max_num_timeout"])
    executor.update_parameters(**params)  # raises on a key submitit does not know
    script = executor._executor._make_submission_file_text("python -m x", "uid")
    for option in ("--partition=gpu", "--gpus-per-node=1", "--cpus-per-task=8", "--mem=64GB", "--time=720",
                   "--signal=USR2@120"):
        assert option in script, option


def test_local_launcher_config_selects_submitits_local_executor():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config import CONF_DIR, register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=local"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("LocalLauncher")
    assert cfg.hydra.launcher.timeout_min == 720


# ------------------------------------------------------------------ real processes (slow) ----


@pytest.mark.slow
def test_parallel_jobs_compute_the_reference_once(tmp_path, cache_dir):
    """Three jobs with different schemes start at once on one cache: one computes, two wait."""
    common = [*TINY, *paths(tmp_path, cache_dir), "tracking.enabled=false"]
    procs = [subprocess.Popen(harness_command(*common, f"quant={scheme}"), cwd=tmp_path, env=job_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for scheme in ("int8", "int4", "int4_g128")]
    outputs = [proc.communicate(timeout=900)[0] for proc in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    found = summaries(tmp_path / "results")
    assert set(found) == {"int8", "int4", "int4_g128"}
    assert sorted(s["reference_cached"]["math"] for s in found.values()) == [False, True, True]
    entries = [p for p in (cache_dir / "reference").iterdir() if p.is_dir()]
    assert len(entries) == 1, entries  # no half-written or duplicate entry
    entry = entries[0]
    assert (entry / "COMPLETE").exists()
    assert not list((cache_dir / "reference").glob("*.checkpoint_rank*.db"))  # dropped once complete
    cached = pd.read_parquet(entry / "records.parquet").set_index("item_id")
    for path in (tmp_path / "results").glob("*/items.parquet"):
        items = pd.read_parquet(path).set_index("item_id")
        assert (items["correct_ref"] == cached.loc[items.index, "correct"]).all()
        assert (items["response_ref"] == cached.loc[items.index, "response"]).all()


@pytest.mark.slow
def test_multirun_groups_its_runs_under_one_sweep_id(tmp_path, cache_dir):
    sweep_dir = tmp_path / "multirun"
    run_harness("-m", *TINY, *paths(tmp_path, cache_dir), "quant=int8,int4_g128", f"hydra.sweep.dir={sweep_dir}",
                cwd=tmp_path)
    found = summaries(tmp_path / "results")
    assert sorted(s["reference_cached"]["math"] for s in found.values()) == [False, True]
    runs = mlflow_runs(sqlite_uri(tmp_path))
    assert sorted(r.data.tags["scheme"] for r in runs) == ["int4_g128", "int8"]
    assert {r.data.tags[SWEEP_TAG] for r in runs} == {str(sweep_dir)}


@pytest.mark.slow
def test_submitit_local_launcher_runs_each_job_in_its_own_process(tmp_path, cache_dir):
    sweep_dir = tmp_path / "multirun"
    create_store(sqlite_uri(tmp_path))
    run_harness("-m", "hydra/launcher=local", *TINY, *paths(tmp_path, cache_dir), "quant=int8,int4_g128",
                f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    job_logs = sorted((sweep_dir / ".submitit").glob("*/*_log.out"))
    assert len(job_logs) == 2  # one submitit job (process) per scheme
    found = summaries(tmp_path / "results")
    assert sorted(s["reference_cached"]["math"] for s in found.values()) == [False, True]
    runs = mlflow_runs(sqlite_uri(tmp_path))
    assert sorted(r.data.tags["scheme"] for r in runs) == ["int4_g128", "int8"]
    assert {r.data.tags[SWEEP_TAG] for r in runs} == {str(sweep_dir)}
    assert all(r.info.status == "FINISHED" for r in runs)


# ------------------------------------------------------------------ plan (dry run) -----------


@pytest.mark.slow
def test_plan_counts_each_jobs_tokens_without_evaluating(tmp_path, cache_dir):
    from harness.planning import plan as plan_mod
    from harness.infra.cache import Cache
    from harness.config import load_model_config
    from harness.models.loading import load_tokenizer
    from harness.evaluation.slices import SLICES_DIR, import_slice_module

    plan = plan_mod.plan_sweep([*TINY, *paths(tmp_path, cache_dir), "quant=int8,int4"],
                               tokens_per_s=1000.0, decode_tokens_per_s=100.0)
    assert [(j.scheme, j.status) for j in plan.jobs] == [("int8", "not checked"), ("int4", "not checked")]
    assert len(plan.references) == 1  # one model, one slice: the reference is counted once
    # Independent count: the prompts as slices/math/*.yaml define them, tokenized here.
    tokenizer = load_tokenizer(load_model_config("smollm2_135m"), Cache(cache_dir))
    items = import_slice_module(SLICES_DIR / "math", "generate").items(size="quick", seed=1234, n_items=9)

    def n(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    scored = sum(n(f"{item['question']}\nAnswer:") + n(f" {choice}") for item in items for choice in item["choices"])
    prompt = sum(n(f"{item['question']} Reply with the number only.") for item in items)
    # one prefill per prompt, no gold texts (eval.divergence_plain=false): a candidate runs forward again only the
    # reference's replies (at most max_gen_toks=24 each), the reference none
    for counts, divergence in ((plan.jobs[0].slices[0], 9 * 24), (plan.jobs[1].slices[0], 9 * 24),
                               (plan.references[0].slices[0], 0)):
        assert (counts.requests, counts.scored, counts.prompt, counts.generated, counts.divergence) == (
            9 + 9 * 4, scored, prompt, 9 * 24, divergence)
    seconds = (scored + prompt) / 1000.0 + 9 * 24 / 100.0
    assert plan.jobs[0].estimated_s == pytest.approx(seconds + 9 * 24 / 1000.0)
    assert plan.total_s == pytest.approx(3 * seconds + 2 * 9 * 24 / 1000.0)
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_plan_measures_throughput_and_skips_finished_work(make_cfg, tmp_path, cache_dir, capsys):
    from harness.planning import plan as plan_mod

    run_mod.run(make_cfg(*TINY, "quant=int8", "tracking.enabled=false"))
    overrides = [*TINY, *paths(tmp_path, cache_dir), "quant=int8,int4", "hydra/launcher=local"]
    plan = plan_mod.plan_sweep(overrides)
    assert [(j.scheme, j.status) for j in plan.jobs] == [("int8", "finished (reused)"), ("int4", "to run")]
    assert [r.status for r in plan.references] == ["cached"]
    assert plan.jobs[0].estimated_s == 0 and plan.references[0].estimated_s == 0
    [rate] = plan.throughput.values()
    assert rate.prefill_tokens_per_s > 0 and rate.decode_tokens_per_s > 0
    assert plan.jobs[1].estimated_s > rate.load_s
    assert plan_mod.main(["-m", *overrides, "tokens_per_s=500"]) == 0
    assert "Sweep plan: 2 job(s), 1 reference(s)" in capsys.readouterr().out


def test_plan_command_line_typos_fail_before_any_work(capsys, monkeypatch):
    from harness.planning import plan as plan_mod

    monkeypatch.setattr(plan_mod, "plan_sweep", lambda *a, **k: pytest.fail("work started"))
    assert plan_mod.main(["-m", "quant=int8", "--tokens-per-s", "500"]) == 2
    assert "unknown flag '--tokens-per-s'" in capsys.readouterr().err
    assert plan_mod.main(["-m", "quant=int8,int5"]) == 2
    assert "unknown quant option(s) ['int5']" in capsys.readouterr().err
    assert plan_mod.main(["tokens_per_s=-3"]) == 2
    assert capsys.readouterr().err.strip() == ("error: tokens_per_s=-3.0: give a positive rate, or leave it unset "
                                               "to measure it here")
    assert plan_mod.main(["--help"]) == 0
    assert "tokens_per_s=None" in capsys.readouterr().out
