"""SmolLM2 told to think in tags: how often it closes its trace, per scheme, with the paired statistics.

The mechanics of the thinking path on a real (non-reasoning) chat model, not a claim about reasoning models:
SmolLM2-135M-Instruct's chat template gets the thinking instruction in place of its default system prompt
(:func:`think_template`; the preset and the test suite keep SmolLM2's own template), ``model.thinking=tags``, and the
quick math slice runs for each scheme. The reference is computed once (the first job) and read from the cache by
the others. Writes ``benchmarks/results/thinking_<tag>.json``: per scheme the closed, unclosed, cap-hit and loop rates
per side with the paired differences, the trace-token ratio, accuracy and the KL along the trace and the answer.

    .venv/bin/python benchmarks/bench_thinking.py --schemes int8 int4_g128 --items 48 --budget 104
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# SmolLM2's default system prompt, which its chat template writes when the conversation has none
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
INSTRUCTION = ("You are a helpful AI assistant. First think step by step inside <think> and </think> tags, "
               "then write the final answer after </think>.")
# --example: the instruction followed by one worked reply, the format shown once
EXAMPLE = " For example, to: Compute 2 + 3. you reply: <think>2 plus 3 is 5.</think>5"  # no quotes: a Jinja string
# its generation prompt, which the variant follows with an opened trace (as DeepSeek-R1's template does)
GENERATION_PROMPT = "{{ '<|im_start|>assistant\n' }}"
RATES = ("closed", "unclosed", "cap_hit", "loop")


def think_template(template: str, example: bool = False) -> str:
    """SmolLM2's chat template with the thinking instruction as its default system prompt and the trace opened
    after the generation prompt (``<think>\\n``): told to, SmolLM2 never writes the tag itself (a 4-item trial),
    so the variant opens it, and what is measured is whether it closes it."""
    if DEFAULT_SYSTEM not in template or GENERATION_PROMPT not in template:
        raise SystemExit("this tokenizer's chat template is not SmolLM2's (no default system prompt or generation "
                         "prompt to replace)")
    opened = GENERATION_PROMPT.replace("\n' }}", "\n<think>\n' }}")
    instruction = INSTRUCTION + (EXAMPLE if example else "")
    return template.replace(DEFAULT_SYSTEM, instruction).replace(GENERATION_PROMPT, opened)


def patch_loading(example: bool = False) -> None:
    """Every model the harness loads in this process gets the thinking template; its identity records it, so the
    reference cache and run keys never mix these runs with SmolLM2's own template."""
    from harness.models import loading

    original = loading.load

    def load(cfg, cache_dir):  # noqa: ANN001 - loading.load's own signature
        loaded = original(cfg, cache_dir)
        loaded.tokenizer.chat_template = think_template(loaded.tokenizer.chat_template, example)
        digest = hashlib.sha256(loaded.tokenizer.chat_template.encode()).hexdigest()[:16]
        loaded.identity = {**loaded.identity, "chat_template": digest}
        return loaded

    loading.load = load


def _interval(metrics: dict, stem: str) -> list[float | None]:
    return [metrics.get(stem), metrics.get(f"{stem}_ci_low"), metrics.get(f"{stem}_ci_high")]


def row(summary: dict, seconds: float) -> dict:
    metrics = summary["metrics"]
    out = {"scheme": summary["scheme"], "run_key": summary["run_key"], "n": metrics.get("math/think_n"),
           "acc_ref": metrics.get("math/acc_ref"), "acc_quant": metrics.get("math/acc_quant"),
           "acc_delta": _interval(metrics, "math/acc_delta"),
           "tokens_ref_mean": metrics.get("math/think_tokens_ref_mean"),
           "tokens_quant_mean": metrics.get("math/think_tokens_quant_mean"),
           "tokens_ratio": _interval(metrics, "math/think_tokens_ratio"),
           "identical_rate": metrics.get("math/think_identical_rate"), "seconds": seconds}
    for rate in RATES:
        out[f"{rate}_ref"] = metrics.get(f"math/think_{rate}_ref")
        out[f"{rate}_quant"] = metrics.get(f"math/think_{rate}_quant")
        out[f"{rate}_delta"] = _interval(metrics, f"math/think_{rate}_delta")
    for part in ("trace", "answer"):
        for stat in (f"n_tokens_{part}", f"kl_{part}_mean", f"top1_agree_{part}"):
            out[stat] = metrics.get(f"math/{stat}")
    out["kl_mean"], out["top1_agree"] = metrics.get("math/kl_mean"), metrics.get("math/top1_agree")
    return out


def rescore(work: Path, tag: str) -> None:
    """Recompute each finished run's trace statistics from its thinking.parquet with the code as it is now (a run
    measured before an interval changed keeps its replies; only the statistics are redone) into the JSON."""
    from harness.evaluation.thinking import thinking_metrics

    out = REPO / "benchmarks" / "results" / f"thinking_{tag}.json"
    record = json.loads(out.read_text())
    for summary_path in sorted((work / "results").glob("*/summary.json")):
        scheme = json.loads(summary_path.read_text())["scheme"]
        metrics = thinking_metrics(pd.read_parquet(summary_path.parent / "thinking.parquet"))
        for row_ in record["rows"]:
            if row_["scheme"] == scheme:
                row_["tokens_ratio"] = _interval(metrics, "math/think_tokens_ratio")
                for rate in RATES:
                    if rate != "closed":
                        row_[f"{rate}_delta"] = _interval(metrics, f"math/think_{rate}_delta")
    record["rescored"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                        text=True).stdout.strip()
    out.write_text(json.dumps(record, indent=1, default=float) + "\n")
    print(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", default=["int8", "int4_g128"])
    parser.add_argument("--items", type=int, default=48)
    parser.add_argument("--budget", type=int, default=104, help="eval.thinking_budget (tokens added to 24)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_thinking"))
    parser.add_argument("--tag", default="smollm2")
    parser.add_argument("--example", action="store_true", help="show one worked reply in the system prompt")
    parser.add_argument("--rescore", action="store_true", help="only redo the statistics of the finished runs")
    args = parser.parse_args()
    if args.rescore:
        rescore(args.work, args.tag)
        return
    load_at_start = os.getloadavg()
    patch_loading(args.example)
    from harness.config import compose
    from harness.job.pipeline import run

    base = ["model=smollm2_135m", "model.thinking=tags", f"eval.thinking_budget={args.budget}", "slices=[math]",
            f"slices.math.n_items={args.items}", f"paths.results_dir={args.work / 'results'}",
            f"paths.cache_dir={args.work / 'cache'}", f"tracking.uri=sqlite:///{args.work / 'mlflow.db'}",
            "runtime.reference_process=false"]  # the template patch lives in this process only
    rows = []
    for scheme in args.schemes:
        started = time.perf_counter()
        summary = run(compose([*base, f"quant={scheme}"]))
        rows.append(row(summary, time.perf_counter() - started))
        print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    record = {"date": datetime.date.today().isoformat(), "commit": commit, "machine": platform.platform(),
              "cpus": os.cpu_count(), "load_at_start": load_at_start, "load_at_end": os.getloadavg(),
              "instruction": INSTRUCTION + (EXAMPLE if args.example else ""), "trace_opened_by_template": True,
              "items": args.items, "budget": args.budget, "max_gen_toks": 24 + args.budget, "rows": rows}
    out = REPO / "benchmarks" / "results" / f"thinking_{args.tag}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(out)


if __name__ == "__main__":
    main()
