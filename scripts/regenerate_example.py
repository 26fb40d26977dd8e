"""Regenerate ``results/example`` and everything derived from it, in one command.

1. The default job (``python -m harness``, no overrides) into a scratch directory, with an empty
   reference cache (the dequantized model weights are shared, not recomputed) and its own MLflow store.
2. Its files that the example keeps are copied into ``results/example`` (see results/README.md).
3. ``scripts/docs_reference.py``: the metrics glossary reads the example's summary.json.
4. ``scripts/example_docs.py``: the README's and the docs' tables, the sample gate output, the
   sentences quoting them, docs/assets/forest.png and flips.png.

    .venv/bin/python scripts/regenerate_example.py             # all of it (~8 min on an idle 2-core VM)
    .venv/bin/python scripts/regenerate_example.py --from DIR  # steps 2-4 from a finished default job's DIR

``tests/test_example.py`` fails until this has run after any change to the statistics or the slices.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "results" / "example"
KEPT = ["config.yaml", "config.json", "summary.json", "report.md", "items.parquet", "item_stats.parquet",
        "token_stats.parquet", "generation.parquet", "decode_floor.csv"]


def default_cache() -> Path:
    return Path(os.environ.get("HARNESS_CACHE_DIR", Path.home() / ".cache" / "quant-harness"))


def run_default_job(scratch: Path) -> Path:
    """The default job with an empty reference cache; returns its results directory."""
    cache = scratch / "cache"
    cache.mkdir(parents=True)
    models = default_cache() / "models"
    if models.is_dir():
        (cache / "models").symlink_to(models)
    env = {**os.environ, "HARNESS_CACHE_DIR": str(cache)}
    command = [sys.executable, "-m", "harness", f"paths.results_dir={scratch / 'results'}",
               f"tracking.uri=sqlite:///{scratch / 'mlflow.db'}"]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=REPO, env=env, check=True)
    return finished_run(scratch / "results")


def finished_run(results: Path) -> Path:
    runs = [d for d in results.iterdir() if (d / "summary.json").exists()] if results.is_dir() else []
    if len(runs) != 1:
        raise SystemExit(f"{results}: expected one finished run, found {len(runs)}")
    return runs[0]


def copy_run(run: Path) -> None:
    result = json.loads((run / "summary.json").read_text())
    if result.get("model") != "smollm2_135m" or result.get("scheme") != "int4_g128" or result.get("max_gen_toks"):
        raise SystemExit(f"{run} is not the default job (model {result.get('model')}, scheme {result.get('scheme')})")
    missing = [name for name in KEPT if not (run / name).exists()]
    if missing:
        raise SystemExit(f"{run} lacks {missing}")
    for name in KEPT:
        shutil.copyfile(run / name, EXAMPLE / name)
    for stale in ("gate.json", "gate.xml"):
        (EXAMPLE / stale).unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, help="a finished default job's results directory")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="example-") as scratch:
        run = finished_run(args.source) if args.source and not (args.source / "summary.json").exists() else \
            args.source or run_default_job(Path(scratch))
        copy_run(run)
    job_s = time.perf_counter() - start
    for script in ("docs_reference.py", "example_docs.py"):
        subprocess.run([sys.executable, str(REPO / "scripts" / script)], cwd=REPO, check=True)
    print(f"results/example regenerated from {'the given run' if args.source else 'a fresh default job'} "
          f"({job_s:.0f} s) and the docs derived from it ({time.perf_counter() - start - job_s:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
