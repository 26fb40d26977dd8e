"""The staged production comparison on this CPU: two vLLM servers (the reference's own weights and a scheme's export)
answer the packaged prompt log, against the in-process comparison of the same scheme on the same prompts.

Three jobs per scheme, each an ordinary ``python -m harness`` run (cached, resumable):

* ``staged``: ``reference.serve`` (vLLM serving the reference's weights) beside ``candidate.serve`` (vLLM serving
  ``python -m harness.export quant=<scheme>``): both sides served, KL a two-sided top-k lower bound;
* ``served``: the same served candidate against the reference computed in this process (KL a one-sided bound);
* ``simulated``: the harness's own simulation of the scheme against the in-process reference (KL exact).

Writes benchmarks/results/staged_<model>.json and prints a markdown table (docs/benchmarks/staged.md). Needs
.venv-engine (``bash scripts/engine_venv.sh``).

    .venv/bin/python benchmarks/bench_staged.py --schemes int8_w8a8 fp8 --sample 32 --max-tokens 48

``--simulated-only`` times the in-process simulation alone (``force=true``: computed again, not read back), with
W8A16 INT8 beside it for scale, into benchmarks/results/staged_<model>_simulated.json; no engine needed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINE_PYTHON = REPO / ".venv-engine" / "bin" / "python"
def vllm(directory: Path, name: str) -> str:
    return (f"{ENGINE_PYTHON} -m vllm.entrypoints.openai.api_server --model {directory} --served-model-name {name} "
            "--host 127.0.0.1 --port {port} --dtype float32 --max-model-len 2048 --enforce-eager")


def newest_summary(out: Path) -> dict:
    summaries = sorted(out.glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(summaries[-1].read_text())


def run_job(overrides: list[str], out: Path) -> tuple[dict, float]:
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    done = subprocess.run([sys.executable, "-m", "harness", *overrides, f"paths.results_dir={out}",
                           "tracking.enabled=false"], cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):  # 1: a failed gate would be a result; no gate here
        raise SystemExit(f"job failed ({' '.join(overrides)}):\n{done.stderr[-3000:]}")
    return newest_summary(out), seconds


def picked(summary: dict) -> dict:
    """The prompt-log slice's numbers as benchmarks/bench_prompts.py reads them, plus a served run's KL bound."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_prompts import row

    metrics = summary.get("metrics") or {}
    return {**row(summary), "kl_lower_bound_mean": metrics.get("prompts/kl_lower_bound_mean")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--schemes", nargs="+", default=["int8_w8a8", "fp8"])
    parser.add_argument("--sample", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48,
                        help="prompts.max_tokens: the cap of rows without their own (a row's own max_tokens wins)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--work", default=str(REPO / "results" / "bench_staged"))
    parser.add_argument("--out", default=None, help="the JSON written (default benchmarks/results/staged_<model>.json)")
    parser.add_argument("--simulated-only", action="store_true",
                        help="time the in-process simulation of each scheme (and int8) alone; no servers")
    args = parser.parse_args()
    if args.simulated_only:
        return simulated_only(args)
    if not ENGINE_PYTHON.exists():
        raise SystemExit("no .venv-engine: bash scripts/engine_venv.sh")
    sys.path.insert(0, str(REPO))
    from harness.config import compose, to_config
    from harness.models.loading import serving_directory

    work = Path(args.work)
    base = [f"model={args.model}", "slices=prompts", f"prompts.sample={args.sample}",
            f"prompts.max_tokens={args.max_tokens}"]
    cfg = to_config(compose([*base, "quant=none"]))
    reference_dir = serving_directory(cfg.model, cfg.paths.cache_dir)
    served = [f"candidate.endpoint_concurrency={args.concurrency}"]
    rows, load = {}, os.getloadavg()
    for scheme in args.schemes:
        export = work / f"export-{scheme}"
        if not (export / "config.json").exists():
            subprocess.run([sys.executable, "-m", "harness.export", f"model={args.model}", f"quant={scheme}",
                            f"out={export}"], cwd=REPO, check=True, capture_output=True)
        candidate = [*base, "quant=external", f"candidate.name={scheme}-served",
                     f"candidate.serve='{vllm(export.resolve(), scheme)}'", *served]
        staged, t_staged = run_job([*candidate, f"reference.serve='{vllm(reference_dir, 'reference')}'",
                                    f"reference.endpoint_concurrency={args.concurrency}"], work / scheme / "staged")
        one_sided, t_served = run_job(candidate, work / scheme / "served")
        simulated, t_sim = run_job([*base, f"quant={scheme}"], work / scheme / "simulated")
        rows[scheme] = {"staged": {**picked(staged), "seconds": round(t_staged, 1),
                                   "divergence": staged["candidate"].get("candidate.divergence")},
                        "served": {**picked(one_sided), "seconds": round(t_served, 1)},
                        "simulated": {**picked(simulated), "seconds": round(t_sim, 1)}}
        print(json.dumps({scheme: rows[scheme]}, indent=1), flush=True)
        result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, CPU only",
                  "load_at_start": [round(x, 2) for x in load],
                  "load_at_end": [round(x, 2) for x in os.getloadavg()], "model": args.model,
                  "sample": args.sample, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                  "schemes": rows}
        target = Path(args.out or REPO / "benchmarks" / "results" / f"staged_{args.model}.json")
        target.write_text(json.dumps(result, indent=1) + "\n")  # after each scheme: a later failure keeps it
        print(f"wrote {target}")


def simulated_only(args: argparse.Namespace) -> None:
    """Each scheme's in-process simulation (and W8A16 int8's), computed again, one after another: the evaluate
    stage's seconds per 100 prompts; the machine's load before and after each job."""
    base = [f"model={args.model}", "slices=prompts", f"prompts.sample={args.sample}",
            f"prompts.max_tokens={args.max_tokens}", "force=true"]
    rows = {}
    for scheme in dict.fromkeys([*args.schemes, "int8"]):
        before = os.getloadavg()
        summary, seconds = run_job([*base, f"quant={scheme}"], Path(args.work) / scheme / "simulated")
        evaluate = float(summary["timings"]["evaluate"])
        rows[scheme] = {**picked(summary), "seconds": round(seconds, 1), "evaluate_s": round(evaluate, 1),
                        "evaluate_s_per_100_prompts": round(100 * evaluate / args.sample, 1),
                        "load_before": [round(x, 2) for x in before],
                        "load_after": [round(x, 2) for x in os.getloadavg()]}
        print(scheme, json.dumps({k: rows[scheme][k] for k in ("evaluate_s", "evaluate_s_per_100_prompts",
                                                               "load_before", "load_after")}), flush=True)
    target = Path(args.out or REPO / "benchmarks" / "results" / f"staged_{args.model}_simulated.json")
    target.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, CPU only",
                                  "model": args.model, "sample": args.sample, "max_tokens": args.max_tokens,
                                  "schemes": rows}, indent=1) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
