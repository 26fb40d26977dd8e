"""Cost of the sweep machinery: the submitit launcher path vs a plain run, and a 3-scheme sweep
(reference computed once) vs three separate single-scheme runs (each computing the reference).

Every measurement is the wall time of a real ``python -m harness`` process (imports and model
load included), in a fresh results directory:

1. launcher overhead, reference already cached: ``python -m harness quant=int8`` vs
   ``python -m harness -m hydra/launcher=local quant=int8`` (one job through submitit's local
   executor: pickling, a job subprocess, result files), each ``--repeats`` times;
2. ``python -m harness -m quant=int8,int4,int4_g128`` (basic launcher, one process, empty
   reference cache) vs three ``python -m harness quant=<s>`` runs each with an empty cache
   (the reference recomputed by each) — and vs the same three runs sharing one cache.

Writes benchmarks/results/sweep.json (one entry per model) and prints a Markdown table. The
machine load average is recorded: other processes on a shared machine inflate every number.

    .venv/bin/python benchmarks/bench_sweep.py [--model smollm2_135m] [--n-items 12] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMES = ["int8", "int4", "int4_g128"]


STAGES = ("load", "reference", "quantize", "evaluate", "divergence", "write", "logging")


def timed(args: list[str], workdir: Path, cache: Path) -> float:
    """Wall seconds of ``python -m harness <args>`` with its outputs under ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HARNESS_CACHE_DIR": str(cache)}
    command = [sys.executable, "-m", "harness", *args, f"paths.results_dir={workdir / 'results'}",
               f"paths.cache_dir={cache}", f"tracking.uri=sqlite:///{workdir / 'mlflow.db'}"]
    start = time.perf_counter()
    subprocess.run(command, cwd=workdir, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def outside_job_s(args: list[str], workdir: Path, cache: Path) -> tuple[float, float]:
    """(wall s, wall s minus the job's own stages): the second is process start-up + launcher."""
    wall = timed(args, workdir, cache)
    [summary] = (workdir / "results").glob("*/summary.json")
    stages = json.loads(summary.read_text())["timings"]
    return wall, wall - sum(stages.get(stage, 0.0) for stage in STAGES)


def stage_totals(workdirs: list[Path]) -> dict[str, float]:
    """Seconds per pipeline stage, summed over every job whose results are under ``workdirs``."""
    totals = dict.fromkeys(STAGES, 0.0)
    for workdir in workdirs:
        for summary in (workdir / "results").glob("*/summary.json"):
            timings = json.loads(summary.read_text())["timings"]
            for stage in STAGES:
                totals[stage] += timings.get(stage, 0.0)
    return totals


def fresh_cache(root: Path, name: str, models: Path) -> Path:
    """An empty reference cache that shares the dequantized model weights (not what is measured)."""
    cache = root / name
    cache.mkdir()
    models.mkdir(parents=True, exist_ok=True)
    (cache / "models").symlink_to(models)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny_random")
    parser.add_argument("--n-items", type=int, default=12, help="items per math task (small: overhead is measured)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    models = Path(os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness")).expanduser() / "models"
    job = [f"model={args.model}", "slices=[math]", f"slices.math.n_items={args.n_items}",
           "slices.math.divergence_texts=4"]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        warm = fresh_cache(root, "warm", models)
        timed([*job, "quant=none"], root / "warmup", warm)  # fills the reference cache for part 1
        plain, launcher = [], []
        for repeat in range(args.repeats):
            plain.append(outside_job_s([*job, "quant=int8"], root / f"plain{repeat}", warm))
            sweep_dir = root / f"sweep{repeat}"
            launcher.append(outside_job_s(["-m", "hydra/launcher=local", *job, "quant=int8",
                                           f"hydra.sweep.dir={sweep_dir}"], root / f"local{repeat}", warm))
        sweep = timed(["-m", *job, f"quant={','.join(SCHEMES)}", f"hydra.sweep.dir={root / 'sweep3'}"],
                      root / "sweep3", fresh_cache(root, "sweep3_cache", models))
        separate = [timed([*job, f"quant={s}"], root / f"single_{s}", fresh_cache(root, f"cold_{s}", models))
                    for s in SCHEMES]
        shared = fresh_cache(root, "shared", models)
        sequential = [timed([*job, f"quant={s}"], root / f"shared_{s}", shared) for s in SCHEMES]
        stages = {"sweep": stage_totals([root / "sweep3"]),
                  "separate": stage_totals([root / f"single_{s}" for s in SCHEMES]),
                  "sharing_cache": stage_totals([root / f"shared_{s}" for s in SCHEMES])}
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "date": time.strftime("%Y-%m-%d"), "model": args.model, "n_items_per_task": args.n_items,
        "launcher_overhead": {
            "plain_run_wall_s": [wall for wall, _ in plain],
            "submitit_local_run_wall_s": [wall for wall, _ in launcher],
            "plain_outside_job_s": [outside for _, outside in plain],
            "submitit_local_outside_job_s": [outside for _, outside in launcher],
            "overhead_wall_s": statistics.median(w for w, _ in launcher) - statistics.median(w for w, _ in plain),
            "overhead_outside_job_s": (statistics.median(o for _, o in launcher)
                                       - statistics.median(o for _, o in plain)),
        },
        "three_scheme_sweep": {
            "sweep_basic_launcher_s": sweep,
            "three_single_runs_each_computing_the_reference_s": separate,
            "three_single_runs_sharing_the_reference_cache_s": sequential,
            "sweep_over_three_separate": sweep / sum(separate),
            "sweep_over_three_sharing_cache": sweep / sum(sequential),
            "stage_seconds_summed_over_jobs": stages,  # less sensitive to other load than wall times
        },
    }
    out = REPO / "benchmarks" / "results" / "sweep.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.read_text()) if out.exists() else {}
    previous[args.model] = result  # one entry per model measured
    out.write_text(json.dumps(previous, indent=2) + "\n")
    print(f"| measurement ({args.model}, {args.n_items} items/task) | wall s |\n|---|---|")
    print(f"| plain run, reference cached (median of {args.repeats}) | {statistics.median(w for w, _ in plain):.1f} |")
    print(f"| same job via hydra/launcher=local (median) | {statistics.median(w for w, _ in launcher):.1f} |")
    print(f"| plain run outside the job's stages (start-up, median) | {statistics.median(o for _, o in plain):.1f} |")
    print(f"| launcher run outside the job's stages (median) | {statistics.median(o for _, o in launcher):.1f} |")
    print(f"| 3-scheme sweep, one process, reference computed once | {sweep:.1f} |")
    print(f"| 3 single runs, each computing the reference (sum) | {sum(separate):.1f} |")
    print(f"| 3 single runs sharing the reference cache (sum) | {sum(sequential):.1f} |")
    print(f"| reference stage, summed over the sweep's 3 jobs | {stages['sweep']['reference']:.1f} |")
    print(f"| reference stage, summed over the 3 separate runs | {stages['separate']['reference']:.1f} |")
    print(f"\nlauncher overhead {result['launcher_overhead']['overhead_outside_job_s']:+.1f} s; sweep / separate runs "
          f"{result['three_scheme_sweep']['sweep_over_three_separate']:.2f}; load average {load_before[0]:.1f}")


if __name__ == "__main__":
    main()
