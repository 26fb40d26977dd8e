"""The default job as a person sees it: in a real terminal (tmux), and with its output sent to a file.

``python -m harness model=tiny_random eval.max_gen_toks=8`` (the default job's five slices and
scheme on the tiny random model, its replies capped) with an empty reference cache, so the
reference runs in its second process (the model cache is the tests' shared one, as a user's is
after their first job). In the terminal: no warning line but the cap's own and no lm-eval bar
on the screen, the progress block redrawn in
place (one copy of it on the screen, many cursor moves in the raw output), every slice done
on both sides, the final table. In a file: no carriage return or escape code, one line per
stage start and end and one per finished slice and side, the final table.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.config import REPO_DIR
from tests.terminal import require_tmux, run_in_terminal

pytestmark = pytest.mark.slow

SLICES = ("math", "long_context", "multilingual", "code", "structured")  # conf/slices/all.yaml
STAGES = ("load", "reference", "quantize", "evaluate", "reference_wait", "divergence", "logging")
# tiny_random never stops, so every reply runs to its task's max_gen_toks (code: 256): the cap makes the
# job ~40 % shorter (the console is the same; it adds one warning line and a note under the table)
CAP = 8
CAPPED = "GENERATION CAPPED: eval.max_gen_toks=8"
# What the console carried before issue 20: lm-eval's warnings and bars, the libraries' warnings.
NOISE = re.compile(r"WARNING|Warning:|UserWarning|FutureWarning|pretrained|Custom kwargs|--metadata|it/s\]|"
                   r"Checking cached requests|Running generate_until|Tokenizing inputs")


def job_command(workdir: Path, cache_dir: Path, mlflow_template: Path) -> list[str]:
    # runtime.threads=2: the reference gets its second process only with two threads to split (one
    # each); under xdist the worker's share, inherited through OMP_NUM_THREADS, is one.
    shutil.copyfile(mlflow_template, workdir / "mlflow.db")  # an empty store, its tables made
    return [sys.executable, "-m", "harness", "model=tiny_random", f"paths.results_dir={workdir / 'results'}",
            f"paths.cache_dir={cache_dir}", f"tracking.uri=sqlite:///{workdir / 'mlflow.db'}",
            "runtime.threads=2", f"eval.max_gen_toks={CAP}"]


def job_log(workdir: Path) -> str:
    [path] = (workdir / "results").glob("*/job.log")
    return path.read_text()


def assert_final_table(text: str) -> None:
    assert "tiny_random  ·  int4_g128" in text and "Δacc pt [95% CI]" in text
    assert f"generation capped at {CAP} tokens a reply" in text
    for name in ("overall", *SLICES):
        assert re.search(rf"^\s*{name}\s+\d+\s", text, re.M), name


def test_the_default_job_in_a_terminal_redraws_its_progress_in_place(tmp_path, cache_dir, mlflow_template):
    require_tmux()
    capture = run_in_terminal(" ".join(job_command(tmp_path, cache_dir, mlflow_template)), tmp_path / "terminal",
                              env={"PYTHONPATH": str(REPO_DIR)}, width=140, height=45)
    screen = capture.screen
    from tests.test_html_report import artifact_dir  # kept for a look when an assertion fails
    (artifact_dir() / "console_terminal.txt").write_text(screen)
    (artifact_dir() / "console_terminal.raw").write_bytes(capture.raw)
    assert capture.status == 0, screen[-3000:]
    assert not [line for line in screen.splitlines() if NOISE.search(line) and CAPPED not in line], screen
    assert capture.raw.count(CAPPED.encode()) == 1
    assert_final_table(screen)
    # the progress block: one copy on the screen, each slice finished on both sides
    assert len(re.findall(r"^\s*slice\s+reference\s+quantized\s*$", screen, re.M)) == 1, screen
    for name in SLICES:
        [row] = [line for line in screen.splitlines() if re.match(rf"^\s*{name}\s+\d+/\d+ items", line)]
        done = re.findall(r"(\d+)/(\d+) items", row)
        assert len(done) == 2 and all(a == b and int(a) > 0 for a, b in done), row
    assert all(f"✓ {stage}" in screen for stage in STAGES), screen
    # redrawn in place: rich moves the cursor up over the block at every refresh
    assert capture.raw.count(b"\x1b[1A") > 50
    assert "job log: " in screen and "library message(s) kept off the console" in screen
    log = job_log(tmp_path)
    assert "`pretrained` model kwarg is not of type `str`" in log and "[reference process]" in log


def test_the_default_job_into_a_file_prints_one_line_per_step(tmp_path, cache_dir, mlflow_template):
    out = tmp_path / "job.txt"
    with out.open("w") as handle:
        status = subprocess.run(job_command(tmp_path, cache_dir, mlflow_template), cwd=REPO_DIR, stdout=handle,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO_DIR)}).returncode
    text = out.read_text()
    assert status == 0, text[-3000:]
    assert "\r" not in text and "\x1b" not in text
    assert not [line for line in text.splitlines() if NOISE.search(line) and CAPPED not in line], text
    lines = text.splitlines()
    assert sum(CAPPED in line for line in lines) == 1
    for stage in STAGES:
        assert sum(line.endswith(f"] ▶ {stage}") for line in lines) == 1, stage
        assert sum(bool(re.search(rf"\] ✓ {stage} [\d.]+ s$", line)) for line in lines) == 1, stage
    finished = [m.groups() for line in lines
                if (m := re.search(r"\] (reference|quantized) · (\w+): (\d+)/(\d+) items", line)) and m[3] == m[4]]
    assert sorted((side, name) for side, name, _, _ in finished) == sorted(
        (side, name) for side in ("reference", "quantized") for name in SLICES)
    assert_final_table(text)


def test_ctrl_c_mid_job_prints_one_line_naming_what_is_kept_and_how_to_resume(tmp_path, cache_dir, mlflow_template):
    """Ctrl-C in a terminal signals the whole foreground group: the job and its reference process alike."""
    import signal
    import time

    out = tmp_path / "job.txt"
    with out.open("w") as handle:
        job = subprocess.Popen(job_command(tmp_path, cache_dir, mlflow_template), cwd=REPO_DIR, stdout=handle,
                               stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": str(REPO_DIR)})
        deadline = time.monotonic() + 300
        while "▶ evaluate" not in out.read_text() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert job.poll() is None, out.read_text()[-3000:]
        os.killpg(job.pid, signal.SIGINT)
        status = job.wait(timeout=120)
    text = out.read_text()
    assert status == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    [line] = [line for line in text.splitlines() if line.startswith("interrupted:")]
    assert str(cache_dir) in line and "run the same command again to resume" in line
