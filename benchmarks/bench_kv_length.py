"""Does KV-cache quantization error grow with context length? KL and top-1 by position, on SmolLM2.

Scores a few deterministic long texts (the long-context slice's filler sentences, a fresh
``random.Random`` stream per text) with the unquantized reference, then with each scheme, and
reports KL(ref‖quant) and top-1 agreement per position bucket (0–128, …, 4k–8k). KV schemes
(kv8: static FP8 scales calibrated as the pipeline does; kv4: KIVI-style INT4) are set against a
weight scheme (int4_g128) whose error has no reason to depend on position. All numbers come
from the harness's own code: ``divergence.score_reference`` (store=hidden) and
``divergence.compare_to_reference``; buckets and summaries from ``harness.divergence.token_stats``.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_kv_length.py \
        [--schemes kv8,kv4,int4_g128] [--texts 2] [--max-tokens 8192] [--threads 1]

Writes benchmarks/results/kv_length.json, kv_length.md and kv_length.png (kv_length_4k.* is the same
run at --max-tokens 4096, renamed by hand). Per-token SEs treat
tokens as independent (optimistic: neighbouring tokens correlate), as harness.divergence.token_stats does.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import time
from pathlib import Path

import pandas as pd
import torch

from harness import quant
from harness.divergence import scoring as divergence
from harness.models import loading as models
from harness.results import report
from harness.divergence import token_stats
from harness.config import REPO_DIR, compose
from harness.config import to_config
from harness.sizing.report_quant import prepare
from harness.results.summary import Comparison

EDGES = [0, 128, 512, 1024, 2048, 4096]  # the last bucket, [4096, inf), holds 4k-8k at --max-tokens 8192
RESULTS = REPO_DIR / "benchmarks" / "results"


def _filler():
    path = REPO_DIR / "slices" / "long_context" / "filler.py"
    spec = importlib.util.spec_from_file_location("bench_kv_length_filler", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def long_texts(tokenizer, count: int, max_tokens: int) -> list[str]:
    """``count`` filler documents, each at least ``max_tokens`` tokens long (truncated when scored)."""
    filler = _filler()
    texts = []
    for index in range(count):
        rng = random.Random(f"kv-length-{index}")
        parts: list[str] = []
        while len(tokenizer(" ".join(parts), add_special_tokens=False)["input_ids"]) < max_tokens:
            parts.extend(filler.sentences(rng, 200))
        texts.append(" ".join(parts))
    return texts


def summarize(tokens: pd.DataFrame) -> pd.DataFrame:
    """One row per (scheme, bucket) plus 'all': kl_mean, kl_se, top1_agree, top1_agree_se, n_tokens."""
    bucketed = tokens.assign(bucket=token_stats.position_buckets(tokens["position"].to_numpy(), EDGES))
    everything = token_stats.summarize_by(tokens.assign(bucket="all"), ["slice", "bucket"])
    by_position = token_stats.summarize_by(bucketed, ["slice", "bucket"])
    return pd.concat([everything, by_position], ignore_index=True)


def measure(args: argparse.Namespace) -> tuple[dict, pd.DataFrame]:
    torch.set_num_threads(args.threads)
    schemes = [s for s in args.schemes.split(",") if s]
    overrides = [f"model={args.model}", f"runtime.threads={args.threads}", f"model.device={args.device}"]
    if args.cache_dir:
        overrides.append(f"paths.cache_dir={args.cache_dir}")
    base = to_config(compose([*overrides, "quant=none"]))
    timings: dict[str, float] = {}
    start = time.perf_counter()
    reference = models.load(base.model, base.paths.cache_dir)
    texts = long_texts(reference.tokenizer, args.texts, args.max_tokens)
    refs = divergence.score_reference(reference.model, reference.tokenizer, texts, max_tokens=args.max_tokens,
                                      store="hidden")
    timings["reference"] = time.perf_counter() - start
    n_tokens = [len(r.input_ids) for r in refs]
    print(f"reference: {len(refs)} texts of {n_tokens} tokens in {timings['reference']:.0f}s", flush=True)
    del reference
    frames = []
    for scheme in schemes:
        begin = time.perf_counter()
        prepared = prepare(to_config(compose([*overrides, f"quant={scheme}"])))
        quant.apply(prepared.loaded.model, prepared.scheme, prepared.context)
        quantized_at = time.perf_counter()
        frames.append(divergence.compare_to_reference(prepared.loaded.model, refs, scheme))
        timings[f"{scheme}_quantize"] = quantized_at - begin
        timings[f"{scheme}_score"] = time.perf_counter() - quantized_at
        print(f"{scheme}: quantized in {timings[f'{scheme}_quantize']:.0f}s, scored in "
              f"{timings[f'{scheme}_score']:.0f}s", flush=True)
        del prepared
    tokens = pd.concat(frames, ignore_index=True)
    table = summarize(tokens)
    keep = ["slice", "bucket", "n_tokens", "kl_mean", "kl_se", "kl_p99", "top1_agree", "top1_agree_se",
            "ppl_ratio"]
    rows = table[keep].rename(columns={"slice": "scheme"}).astype({"bucket": str}).to_dict("records")
    result = {"model": args.model, "schemes": schemes, "texts": len(texts), "tokens_per_text": n_tokens,
              "max_tokens": args.max_tokens, "edges": EDGES, "threads": args.threads, "device": args.device,
              "load_average": list(os.getloadavg()), "timings_s": timings,
              "total_s": time.perf_counter() - start, "rows": rows}
    return result, table


def markdown(result: dict) -> str:
    table = pd.DataFrame(result["rows"])
    buckets = [b for b in dict.fromkeys(table["bucket"]) if b != "all"] + ["all"]
    lines = [f"{result['model']} · {result['texts']} filler texts of {result['tokens_per_text']} tokens · "
             f"KL(ref‖quant) mean ± SE (per-token SE, optimistic), top-1 agreement", "",
             "| scheme | " + " | ".join(buckets) + " |", "|---|" + "---|" * len(buckets)]
    for scheme in result["schemes"]:
        rows = table[table["scheme"] == scheme].set_index("bucket")
        kl = " | ".join(f"{rows.loc[b, 'kl_mean']:.5f} ± {rows.loc[b, 'kl_se']:.5f}" if b in rows.index else "–"
                        for b in buckets)
        top1 = " | ".join(f"{rows.loc[b, 'top1_agree']:.4f}" if b in rows.index else "–" for b in buckets)
        lines += [f"| {scheme} KL | {kl} |", f"| {scheme} top-1 | {top1} |"]
    timing = ", ".join(f"{k} {v:.0f}s" for k, v in result["timings_s"].items())
    lines += ["", f"Wall time {result['total_s']:.0f}s ({timing}); {result['threads']} thread(s) on "
              f"{result['device']}, load average at the end {result['load_average'][0]:.2f}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--schemes", default="kv8,kv4,int4_g128")
    parser.add_argument("--texts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache-dir", default=os.environ.get("HARNESS_CACHE_DIR", ""))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.texts < 1 or args.max_tokens < 2:
        parser.error(f"--texts={args.texts} and --max-tokens={args.max_tokens} must be >= 1 and >= 2")
    result, table = measure(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_length.json").write_text(json.dumps(result, indent=2))
    (out / "kv_length.md").write_text(markdown(result))
    comparison = Comparison(items=pd.DataFrame(), item_stats=pd.DataFrame(), token_stats=table,
                            generation=pd.DataFrame())
    report.plot_kl_by_position(comparison, out / "kv_length.png",
                               title=f"{result['model']}: KL(ref‖quant) by position")
    print(markdown(result))
    print(f"written: {out / 'kv_length.json'}, kv_length.md, kv_length.png")


if __name__ == "__main__":
    main()
