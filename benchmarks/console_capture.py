"""What a person sees while the default job runs: its terminal screen, captured as text.

Runs ``python -m harness model=tiny_random`` (the default job's slices and scheme on the
tiny random model) with an empty cache in a 120 x 40 tmux terminal, and the same job with
its output sent to a file, and writes ``results/example/console_<label>.txt`` (the screen,
scrollback included) and ``console_<label>_file.txt`` (the file), with the number of raw
bytes and of carriage returns / cursor moves the program wrote.

    .venv/bin/python benchmarks/console_capture.py LABEL [extra hydra overrides...]
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.terminal import run_in_terminal  # noqa: E402


def job_command(workdir: Path, *extra: str) -> str:
    return " ".join([sys.executable, "-m", "harness", "model=tiny_random", f"paths.results_dir={workdir / 'results'}",
                     f"paths.cache_dir={workdir / 'cache'}", f"tracking.uri=sqlite:///{workdir / 'mlflow.db'}",
                     *extra])


def main() -> None:
    label, extra = sys.argv[1], sys.argv[2:]
    out = REPO / "results" / "example"
    env = {"PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        capture = run_in_terminal(f"cd {REPO} && " + job_command(Path(tmp) / "tty", *extra), Path(tmp) / "tty",
                                  env=env)
        tty_s = time.perf_counter() - start
        (out / f"console_{label}.txt").write_text(capture.screen)
        start = time.perf_counter()
        with open(out / f"console_{label}_file.txt", "w") as log:
            status = subprocess.run(job_command(Path(tmp) / "file", *extra), shell=True, cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT, env={**os.environ, **env}).returncode
        file_s = time.perf_counter() - start
    redraws = capture.raw.count(b"\r") + capture.raw.count(b"\x1b[1A") + capture.raw.count(b"\x1b[A")
    print(f"{label}: terminal exit {capture.status}, {tty_s:.0f} s, {len(capture.screen.splitlines())} lines on "
          f"screen, {len(capture.raw)} raw bytes, {redraws} carriage returns / cursor-ups; file exit {status}, "
          f"{file_s:.0f} s, {len((out / f'console_{label}_file.txt').read_text().splitlines())} lines")


if __name__ == "__main__":
    main()
