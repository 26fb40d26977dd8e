"""A small model as the pairwise judge: what it decides on saved prompt-log runs, and how often it can be read at all.

Starts one judge server (``--serve``, a command with ``{port}``; or ``--endpoint``) and judges each saved run's replies
through the harness's own stage (:func:`harness.evaluation.judge.run_judge`): win / tie / loss, loss − win with its
interval, order consistency, unparsable verdicts. The judge's raw replies are tallied by their first word (in this
script only; the harness keeps no judge text), so a page can say what a weak judge writes instead of one word. Beside
each run: its gold-free outcomes (identical replies, KL along the reference's replies) and, from ``--tasks`` result
directories, the task slices' Δ accuracy of the same scheme, for the direction check.

    python benchmarks/bench_judge.py --runs /tmp/po/results/smollm2_135m__int8__prompts__cf0d63c3 \\
        /tmp/po/results/smollm2_135m__int4_g128__prompts__bdecd915 --tasks results/example \\
        --serve ".venv-engine/bin/python -m vllm.entrypoints.openai.api_server --model <dir> --port {port} ..."
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path

import pandas as pd

from harness.config import JudgeConfig
from harness.evaluation import judge, judge_client

REPO = Path(__file__).resolve().parents[1]


def _first_word(text: str | None) -> str:
    words = re.findall(r"[A-Za-z]+", text or "")
    return words[0].lower() if words else "(none)"


def task_deltas(directories: list[Path]) -> dict[str, list]:
    out = {}
    for directory in directories:
        for path in sorted(directory.rglob("summary.json")):
            summary = json.loads(path.read_text())
            if "prompts" in summary.get("slices", []):
                continue
            metrics = summary["metrics"]
            out[summary["scheme"]] = [metrics.get(f"overall/acc_delta{s}") for s in ("", "_ci_low", "_ci_high")]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, nargs="+", required=True)
    parser.add_argument("--serve", default=None)
    parser.add_argument("--endpoint", default=None)
    parser.add_argument("--max-tokens", type=int, default=JudgeConfig.max_tokens)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tasks", type=Path, nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/judge_smollm2.json")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/bench_judge"))
    args = parser.parse_args()
    process = None
    if args.serve:
        from harness.engines.vllm_serve import ServedProcess

        process = ServedProcess(args.serve, args.log_dir / "judge_serve.log", startup_timeout_s=900).start()
    endpoint = process.url if process else args.endpoint
    raw: list[str | None] = []
    parse = judge_client.parse_verdict

    def recording(text: str | None) -> str:
        raw.append(text)
        return parse(text)

    judge_client.parse_verdict = recording  # this script's tally only; the stage itself is unchanged
    rows = []
    try:
        for directory in args.runs:
            summary = json.loads((directory / "summary.json").read_text())
            config = json.loads((directory / "config.json").read_text())
            items = pd.read_parquet(directory / "items.parquet")
            conversations = judge.saved_conversations(config, ["prompts"])
            cfg = JudgeConfig(endpoint=endpoint, max_tokens=args.max_tokens, concurrency=args.concurrency)
            raw.clear()
            started, load = time.time(), os.getloadavg()
            result = judge.run_judge(cfg, items, conversations, log_dir=args.log_dir)
            metrics = summary["metrics"]
            rows.append({"run": directory.name, "scheme": summary["scheme"], "judge": result.params,
                         "seconds": round(time.time() - started, 1), "load_before": [round(x, 2) for x in load],
                         "load_after": [round(x, 2) for x in os.getloadavg()],
                         "metrics": {k.split("/", 1)[1]: v for k, v in result.metrics.items()},
                         "verdict_pairs": {f"{a or '-'}|{b or '-'}": int(n) for (a, b), n in
                                           result.frame.groupby(["verdict_ref_first", "verdict_quant_first"]).size()
                                           .items()},
                         "first_words": dict(collections.Counter(_first_word(t) for t in raw).most_common(8)),
                         "raw_examples": [str(t)[:160] for t in raw[:4]],
                         "identical": metrics.get("prompts/po_identical"), "kl_mean": metrics.get("prompts/kl_mean"),
                         "usable_delta": [metrics.get(f"prompts/acc_delta{s}") for s in ("", "_ci_low", "_ci_high")]})
            print(json.dumps(rows[-1], default=str)[:2000])
    finally:
        judge_client.parse_verdict = parse
        if process is not None:
            process.stop()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    out = {"date": datetime.date.today().isoformat(), "commit": commit.strip(),
           "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "judge_command": args.serve or args.endpoint,
           "max_tokens": args.max_tokens, "rows": rows, "task_deltas": task_deltas(args.tasks)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
