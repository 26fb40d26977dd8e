"""Your prompts on SmolLM2: which gold-free outcomes move per scheme, beside the task slices' Δ accuracy.

Runs (or reads, when they exist) one job per scheme on the packaged prompt log, then writes
``benchmarks/results/prompts_<tag>.json`` with, per scheme: the usable-reply Δ, identical replies, KL and
top-1 along the reference's replies, each outcome's paired change with its interval, each kept share, the length
ratio, and the time per 100 prompts (the candidate's evaluation; the reference's on the first job). The task
slices' Δ accuracy comes from results directories given with ``--tasks DIR`` (a sweep over the same schemes on
the task slices), when there are any.

    python benchmarks/bench_prompts.py --schemes int8 fp8 int4_g128 awq_w4g128 --sample 60 --max-tokens 96 \\
        --results /tmp/po/results
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTCOMES = ("refused", "loop", "empty", "cap_hit")
KEPT = ("json", "code", "language")


def _interval(metrics: dict, stem: str) -> list[float | None]:
    return [metrics.get(stem), metrics.get(f"{stem}_ci_low"), metrics.get(f"{stem}_ci_high")]


def row(summary: dict) -> dict:
    metrics = summary["metrics"]
    n = metrics["prompts/po_n"]
    evaluate = summary["timings"].get("evaluate")
    return {
        "scheme": summary["scheme"], "run_key": summary["run_key"], "n": n,
        "usable_ref": metrics["prompts/acc_ref"], "usable_quant": metrics["prompts/acc_quant"],
        "usable_delta": _interval(metrics, "prompts/acc_delta"), "clusters": metrics.get("prompts/n_clusters"),
        "identical": _interval(metrics, "prompts/po_identical"),
        "first_diff_median": metrics.get("prompts/po_first_diff_median"),
        "length_ratio": _interval(metrics, "prompts/po_length_ratio"),
        "kl_mean": metrics.get("prompts/kl_mean"), "top1_agree": metrics.get("prompts/top1_agree"),
        **{f"{o}_ref": metrics.get(f"prompts/po_{o}_ref") for o in OUTCOMES},
        **{f"{o}_quant": metrics.get(f"prompts/po_{o}_quant") for o in OUTCOMES},
        **{f"{o}_delta": _interval(metrics, f"prompts/po_{o}_delta") for o in OUTCOMES},
        **{f"{k}_eligible": metrics.get(f"prompts/po_{k}_eligible") for k in KEPT},
        **{f"{k}_kept": _interval(metrics, f"prompts/po_{k}_kept") for k in KEPT},
        "evaluate_s": evaluate, "evaluate_s_per_100": None if evaluate is None else 100 * evaluate / n,
    }


def task_deltas(directories: list[Path]) -> dict[str, dict[str, list]]:
    """Δ accuracy per slice and overall of task-slice runs, by scheme."""
    out: dict[str, dict[str, list]] = {}
    for directory in directories:
        for summary_path in sorted(directory.rglob("summary.json")):
            summary = json.loads(summary_path.read_text())
            metrics = summary["metrics"]
            out[summary["scheme"]] = {name: _interval(metrics, f"{name}/acc_delta")
                                      for name in ["overall", *summary["slices"]] if "prompts" != name}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", default=["int8", "fp8", "int4_g128", "awq_w4g128"])
    parser.add_argument("--sample", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=96,
                        help="prompts.max_tokens: the cap of rows without their own (a row's own max_tokens wins)")
    parser.add_argument("--results", type=Path, default=Path("/tmp/bench_prompts/results"))
    parser.add_argument("--tasks", type=Path, nargs="*", default=[])
    parser.add_argument("--tag", default="smollm2")
    args = parser.parse_args()
    overrides = ["slices=prompts", f"prompts.sample={args.sample}", f"prompts.max_tokens={args.max_tokens}",
                 f"paths.results_dir={args.results}", f"tracking.uri=sqlite:///{args.results.parent / 'mlflow.db'}"]
    existing = {json.loads(p.read_text())["scheme"] for p in args.results.glob("*/summary.json")} \
        if args.results.exists() else set()
    missing = [s for s in args.schemes if s not in existing]
    if missing:
        subprocess.run([sys.executable, "-m", "harness", "-m", f"quant={','.join(missing)}", *overrides],
                       cwd=REPO, check=True)
    summaries = [json.loads(p.read_text()) for p in sorted(args.results.glob("*/summary.json"))]
    rows = [row(s) for s in summaries if s["scheme"] in args.schemes]
    rows.sort(key=lambda r: args.schemes.index(r["scheme"]))
    record = {
        "date": datetime.date.today().isoformat(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "model": "smollm2_135m",
        "command": " ".join(["python -m harness -m quant=" + ",".join(args.schemes), *overrides[:3]]),
        "rows": rows, "task_deltas": task_deltas(args.tasks),
    }
    out = REPO / "benchmarks" / "results" / f"prompts_{args.tag}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
