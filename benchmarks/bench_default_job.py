"""Wall time of the default job, split by stage; cold vs warm model load; a second scheme's cost.

Runs the real CLI three times in subprocesses against a fresh cache directory:
1. the default job with an empty cache (cold: GGUF dequantization + reference computed),
2. the same scheme again with force=true (warm model load; reference reused),
3. a second scheme (int8) with the reference reused.
Writes benchmarks/results/default_job.json and prints a Markdown table.

    .venv/bin/python benchmarks/bench_default_job.py [extra hydra overrides...]
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_job(workdir: Path, cache: Path, *overrides: str) -> tuple[dict, float]:
    env = {**os.environ, "HARNESS_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "harness", f"paths.results_dir={workdir / 'results'}",
                    f"tracking.uri=sqlite:///{workdir / 'mlflow.db'}", *overrides],
                   cwd=workdir, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    newest = max((workdir / "results").glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(newest.read_text()), wall


def main() -> None:
    extra = sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        workdir, cache = Path(tmp) / "work", Path(tmp) / "cache"
        workdir.mkdir()
        cold, cold_wall = run_job(workdir, cache, *extra)
        warm, warm_wall = run_job(workdir, cache, "force=true", *extra)
        second, second_wall = run_job(workdir, cache, "quant=int8", *extra)
    rows = {"cold (empty cache)": (cold, cold_wall), "same scheme, warm": (warm, warm_wall),
            "second scheme (int8), reference reused": (second, second_wall)}
    stages = ["load", "reference", "quantize", "evaluate", "divergence", "write", "logging"]
    print("| job | wall s | " + " | ".join(stages) + " |")
    print("|---|---|" + "---|" * len(stages))
    for name, (summary, wall) in rows.items():
        t = summary["timings"]
        print(f"| {name} | {wall:.1f} | " + " | ".join(f"{t.get(s, 0):.1f}" for s in stages) + " |")
    print(f"\nsecond scheme / first (cold) wall ratio: {second_wall / cold_wall:.2f}; "
          f"cold model load {cold['timings'].get('load', 0):.1f}s vs warm {warm['timings'].get('load', 0):.1f}s")
    out = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "overrides": extra,
           "date": time.strftime("%Y-%m-%d"),
           "runs": {name: {"wall_s": wall, "timings": s["timings"], "reference_cached": s["reference_cached"]}
                    for name, (s, wall) in rows.items()}}
    (REPO / "benchmarks" / "results" / "default_job.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
