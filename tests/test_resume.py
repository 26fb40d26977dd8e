"""Resume after preemption: lm-eval's per-request checkpoint, SIGKILLed jobs, reuse and force.

The checkpoint is lm-eval's own ``CachingLM`` (SQLite, one row per finished request) under
``results/<run>/checkpoint/`` for the quantized model and next to the reference cache entry
for the reference. These tests kill real ``python -m harness`` processes with SIGKILL (what
preemption does) once rows have been written, start the same command again, and compare with
an uninterrupted run.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Callable

import pandas as pd
import pytest

from harness.evaluation import evaluate
from harness.models import loading as models
from harness.job import pipeline as run_mod
from harness.config import compose
from harness.job import identity
from harness.config import to_config
from harness.evaluation.slices import resolve
from tests.test_sweeps import TINY, harness_command, job_env, mlflow_runs, paths, run_harness, sqlite_uri


def count_rows(files: list[Path]) -> int:
    """Rows of SqliteDict files, read with sqlite3 directly (independent of the harness helper)."""
    total = 0
    for path in files:
        with contextlib.closing(sqlite3.connect(path, timeout=10)) as db:
            try:
                total += db.execute("SELECT COUNT(*) FROM unnamed").fetchone()[0]
            except sqlite3.OperationalError:  # table not created yet
                pass
    return total


def kill_when_checkpointed(args: list[str], cwd: Path, find_db: Callable[[], list[Path]], log: Path,
                           min_rows: int = 4, timeout: float = 900) -> int:
    """Start ``python -m harness args``, SIGKILL it once its checkpoint holds ``min_rows`` rows."""
    with log.open("w") as out:
        proc = subprocess.Popen(harness_command(*args), cwd=cwd, env=job_env(), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"the job ended (rc {proc.returncode}) before it could be killed; see {log}:\n"
                            f"{log.read_text()[-3000:]}")
            if count_rows(find_db()) >= min_rows:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=60)
                assert proc.returncode == -signal.SIGKILL
                return count_rows(find_db())
            time.sleep(0.05)
        pytest.fail(f"no checkpoint rows within {timeout} s; see {log}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    raise AssertionError("unreachable")


# ------------------------------------------------------------------ in-process (fast) --------


@pytest.mark.slow
def test_checkpoint_replays_stored_requests_and_computes_only_the_rest(make_cfg, tmp_path):
    cfg = to_config(make_cfg(*TINY, "quant=none", "eval.batch_size=1"))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    slice_ = resolve(cfg.slices)[0]
    settings = identity.eval_settings(cfg, None)
    prefix = tmp_path / "checkpoint" / "math"
    first, _ = evaluate.evaluate_slice(evaluate.make_lm(loaded.model, loaded.tokenizer, settings), slice_, settings,
                                       checkpoint=prefix)
    total = evaluate.checkpoint_rows(prefix)
    assert total == 9 + 9 * 4  # 9 generation requests + 9 items x 4 choices
    assert count_rows(evaluate.checkpoint_files(prefix)) == total
    # Forget a third of the stored requests, as if the job had been killed.
    db_path = evaluate.checkpoint_files(prefix)[0]
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        db.execute("DELETE FROM unnamed WHERE rowid % 3 = 0")
        db.commit()
    kept = evaluate.checkpoint_rows(prefix)
    assert 0 < kept < total
    lm = evaluate.make_lm(loaded.model, loaded.tokenizer, settings)
    computed: list[int] = []
    for name in ("loglikelihood", "generate_until"):
        original = getattr(lm, name)
        setattr(lm, name, lambda requests, _original=original: (computed.append(len(requests)), _original(requests))[1])
    second, _ = evaluate.evaluate_slice(lm, slice_, settings, checkpoint=prefix)
    assert sum(computed) == total - kept  # only the forgotten requests reached the model
    pd.testing.assert_frame_equal(first, second)
    assert evaluate.checkpoint_rows(prefix) == total


@pytest.mark.slow
def test_an_lm_without_checkpoint_does_not_write_into_a_previous_one(make_cfg, tmp_path):
    cfg = to_config(make_cfg(*TINY, "quant=none"))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    slice_ = resolve(cfg.slices)[0]
    settings = identity.eval_settings(cfg, None)
    lm = evaluate.make_lm(loaded.model, loaded.tokenizer, settings)
    prefix = tmp_path / "checkpoint" / "math"
    evaluate.evaluate_slice(lm, slice_, settings, checkpoint=prefix)
    for path in evaluate.checkpoint_files(prefix):
        path.unlink()
    evaluate.evaluate_slice(lm, slice_, settings)
    assert evaluate.checkpoint_files(prefix) == []


# ------------------------------------------------------------------ real processes (slow) ----


@pytest.mark.slow
def test_killed_job_resumes_from_its_checkpoint_and_logs_one_run(tmp_path, cache_dir, shared_model_cache,
                                                                  mlflow_template):
    # batch 1: the checkpoint fills request by request; replies capped at 8 tokens (tiny_random never stops)
    job = [*TINY, "slices.math.n_items=24", "eval.batch_size=1", "quant=int4_g128", "eval.max_gen_toks=8"]
    for work in ("a", "b", "c"):  # each job's own MLflow store, its tables made (conftest's mlflow_template)
        (tmp_path / work).mkdir()
        shutil.copyfile(mlflow_template, tmp_path / work / "mlflow.db")
    # The uninterrupted run, for comparison (own results, cache and MLflow), in this process: one torch
    # thread, as the jobs below get (job_env), so its numbers are theirs.
    run_mod.run(compose([*job, *paths(tmp_path / "a", cache_dir), "runtime.threads=1"]))
    [uninterrupted_dir] = (tmp_path / "a" / "results").glob("*/")
    uninterrupted = json.loads((uninterrupted_dir / "summary.json").read_text())
    total = uninterrupted["checkpoint"]["requests"]["math"]
    assert total == 24 + 24 * 4 and uninterrupted["checkpoint"]["restored_requests"]["math"] == 0
    uninterrupted_items = pd.read_parquet(uninterrupted_dir / "items.parquet")
    cache_b = tmp_path / "cache_b"  # an empty reference cache shared by the preempted jobs below
    cache_b.mkdir()
    (cache_b / "models").symlink_to(shared_model_cache)

    # 1. Killed while computing the reference; started again, it continues the reference.
    work = tmp_path / "b"
    args = [*job, *paths(work, cache_b)]
    killed_in_reference = kill_when_checkpointed(
        args, work, lambda: list((cache_b / "reference").glob("*.checkpoint_rank*.db")), work / "attempt1.log")
    assert 0 < killed_in_reference < total
    assert not list((cache_b / "reference").glob("*/COMPLETE"))
    assert mlflow_runs(sqlite_uri(work)) == []
    run_harness(*args, cwd=work)
    [results_dir] = (work / "results").glob("*/")
    resumed = json.loads((results_dir / "summary.json").read_text())
    assert resumed["reference_cached"]["math"] is False
    assert resumed["checkpoint"]["reference_restored_requests"]["math"] == killed_in_reference
    pd.testing.assert_frame_equal(pd.read_parquet(results_dir / "items.parquet"), uninterrupted_items)
    assert not list((cache_b / "reference").glob("*.checkpoint_rank*.db"))  # dropped once the entry is complete
    assert [r.info.status for r in mlflow_runs(sqlite_uri(work))] == ["FINISHED"]

    # 2. Killed while evaluating the quantized model (reference cached); it continues the evaluation.
    work = tmp_path / "c"
    args = [*job, *paths(work, cache_b)]
    uri = sqlite_uri(work)
    killed_in_evaluation = kill_when_checkpointed(
        args, work, lambda: list((work / "results").glob("*/checkpoint/math_rank*.db")), work / "attempt1.log")
    assert 0 < killed_in_evaluation < total
    [results_dir] = (work / "results").glob("*/")
    assert not (results_dir / "summary.json").exists()
    assert mlflow_runs(uri) == []  # the run is created only from finished results: nothing half-logged
    run_harness(*args, cwd=work)
    resumed = json.loads((results_dir / "summary.json").read_text())
    assert resumed["checkpoint"]["restored_requests"]["math"] == killed_in_evaluation
    assert resumed["checkpoint"]["requests"]["math"] == total  # only total - restored were computed
    assert resumed["run_key"] == uninterrupted["run_key"]
    pd.testing.assert_frame_equal(pd.read_parquet(results_dir / "items.parquet"), uninterrupted_items)
    # Items restored from the checkpoint were answered by the killed process, so their token states were not
    # kept for the divergence stage and are scored again: the same numbers to float rounding, not to the bit. A
    # per-token KL from float32 logits carries ~1e-6 of absolute rounding (logits ~10, eps 1.2e-7), which is
    # relative error on the smallest ones (kl_min): measured 4.3e-7 absolute, 1.5e-5 relative at most.
    assert resumed["metrics"] == pytest.approx(uninterrupted["metrics"], rel=1e-5, abs=1e-6, nan_ok=True)
    assert {k: v for k, v in resumed["metrics"].items() if "acc" in k or "flip" in k} == \
        {k: v for k, v in uninterrupted["metrics"].items() if "acc" in k or "flip" in k}
    assert not (results_dir / "checkpoint").exists()
    assert [r.info.status for r in mlflow_runs(uri)] == ["FINISHED"]

    # 3. Started again: the finished results are reused, not recomputed, and not logged twice (in this
    # process: nothing is computed, and a job's start-up is ~12 s of this test's CPU).
    run_mod.run(compose(args))
    assert json.loads((results_dir / "summary.json").read_text())["finished_at"] == resumed["finished_at"]
    assert len(mlflow_runs(uri)) == 1

    # 4. force=true recomputes everything (no checkpoint left to replay) with the same answers.
    time.sleep(1.1)  # finished_at has a resolution of one second
    run_mod.run(compose([*args, "force=true", "runtime.threads=1"]))  # in this process, one thread as the jobs
    forced = json.loads((results_dir / "summary.json").read_text())
    assert forced["finished_at"] != resumed["finished_at"]
    assert forced["checkpoint"]["restored_requests"]["math"] == 0
    assert forced["reference_cached"]["math"] is True
    pd.testing.assert_frame_equal(pd.read_parquet(results_dir / "items.parquet"), uninterrupted_items)
    assert len(mlflow_runs(uri)) == 1
