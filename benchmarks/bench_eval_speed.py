"""Evaluation wall time against pure model time for the same tokens, and accuracy, per slice.

For each selected slice, on the model of the run config (quant is not applied: this is the
reference side of a run):

1. the slice is evaluated through the harness's lm-eval path (``evaluate.run_lm_eval``), timed;
2. every request lm-eval made is replayed without lm-eval: generation requests as a prefill
   of their prompts plus a greedy batch decode of as many tokens as each reply has (a row
   leaves the batch when its reply is complete, as ``eval.generator=harness`` does; with
   ``eval.generator=hf`` every row decodes until its batch's longest reply ends, as HF
   ``generate`` does), multiple-choice requests as one forward pass over context +
   continuation (with the harness generator: one pass over each shared context, then its
   choices, as the evaluation scores them); same batch size, prompts sorted by length as lm-eval sorts them. That is the
   model time the evaluation cannot go below.

The ratio evaluation wall / pure model time is what lm-eval, HF ``generate`` and the slice's
scoring add on top (goal <= 1.5). Accuracy is reported per task and per sub-slice (n, acc).
Results merge into benchmarks/results/eval_speed.json (one entry per slice; the load average
before and after each slice is recorded, since other work on the machine inflates both times).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/bench_eval_speed.py "slices=[math]" [eval.batch_size=8]
        [repeats=1] [torch_threads=1]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from harness import cli
from harness.evaluation import evaluate
from harness.models import loading as models
from harness.config import REPO_DIR
from harness.job.identity import eval_settings, tokenizer_dir
from harness.config import to_config
from harness.evaluation.slices import Slice, resolve

OUT = REPO_DIR / "benchmarks" / "results" / "eval_speed.json"


@dataclass
class Options:
    out: str = field(default=str(OUT), metadata={"help": "JSON file the per-slice results merge into"})
    torch_threads: int = field(default=1, metadata={"help": "torch intra-op threads for both timings"})
    repeats: int = field(default=1, metadata={"help": "pure-model replays (the median is reported)"})
    replay: bool = field(default=True, metadata={"help": "false: accuracy only (no pure-model replay)"})
    records_dir: str = field(default="", metadata={"help": "if set, each slice's per-item records go to <dir>/<slice>.csv"})


@dataclass
class Requests:
    generate: list[tuple[list[int], int]] = field(default_factory=list)  # (prompt ids, generated tokens)
    loglikelihood: list[list[int]] = field(default_factory=list)  # context + continuation ids
    pairs: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (context, continuation) ids


def collect_requests(results: dict, tokenizer: Any, max_length: int) -> Requests:
    """The token sequences lm-eval's requests fed the model, from ``simple_evaluate``'s sample log."""
    out = Requests()
    seen_filter: dict[str, Any] = {}
    for task, samples in results["samples"].items():
        for sample in samples:
            if seen_filter.setdefault(task, sample.get("filter")) != sample.get("filter"):
                continue  # the same requests, logged again under another filter
            for args, resps in zip(sample["arguments"], sample["resps"]):
                context = tokenizer(args[0], add_special_tokens=False)["input_ids"]
                if isinstance(args[1], dict):  # generate_until: (context, gen_kwargs)
                    max_gen = int(args[1].get("max_gen_toks", 256))
                    reply = resps[0] if isinstance(resps, (list, tuple)) else resps
                    generated = len(tokenizer(str(reply), add_special_tokens=False)["input_ids"])
                    # +1: the stop token itself (or the step that hit max_gen_toks) was generated too
                    out.generate.append((context[-(max_length - max_gen):], min(generated + 1, max_gen)))
                else:  # loglikelihood: (context, continuation); the last token is not fed
                    continuation = tokenizer(args[1], add_special_tokens=False)["input_ids"]
                    out.loglikelihood.append((context + continuation)[-(max_length + 1):][:-1])
                    out.pairs.append((context, continuation))
    return out


def _left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


@torch.inference_mode()
def pure_generate_s(model: Any, requests: list[tuple[list[int], int]], batch_size: int, pad: int,
                    compact: bool = True) -> float:
    """Prefill + greedy KV-cache decode of the same prompts and reply lengths, without lm-eval or ``generate``.

    ``compact``: a row leaves the batch once it has its reply's tokens (what ``eval.generator=harness``
    does); False: every row decodes until the batch's longest reply ends (HF ``generate``).
    """
    from transformers import DynamicCache

    ordered = sorted(requests, key=lambda r: -len(r[0]))
    start = time.perf_counter()
    for offset in range(0, len(ordered), batch_size):
        batch = ordered[offset:offset + batch_size]
        ids, mask = _left_padded([prompt for prompt, _ in batch], pad)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits
        remaining = torch.tensor([n - 1 for _, n in batch])  # the prefill already produced the first token
        if not compact:
            remaining[:] = remaining.max()
        while True:
            keep = (remaining > 0).nonzero().flatten()
            if len(keep) == 0:
                break
            if len(keep) < len(remaining):
                cache.batch_select_indices(keep)
                logits, mask, positions, remaining = logits[keep], mask[keep], positions[keep], remaining[keep]
            token = logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            positions = positions[:, -1:] + 1
            logits = model(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache,
                           use_cache=True).logits
            remaining -= 1
    return time.perf_counter() - start


@torch.inference_mode()
def pure_shared_context_s(model: Any, pairs: list[tuple[list[int], list[int]]], batch_size: int, pad: int) -> float:
    """The choices of one context scored after a single pass over it (``eval.generator=harness``)."""
    from harness.evaluation.generation import shared_context_logprobs

    groups: dict[tuple[int, ...], list[list[int]]] = {}
    for context, continuation in pairs:
        groups.setdefault(tuple(context), []).append(continuation)
    singles = [list(c) + cont for c, conts in groups.items() if len(conts) < 2 or len(c) < 2 for cont in conts]
    start = time.perf_counter()
    for context, conts in groups.items():
        if len(conts) >= 2 and len(context) >= 2:
            shared_context_logprobs(model, list(context), conts, pad_token_id=pad, device="cpu")
    elapsed = time.perf_counter() - start
    return elapsed + (pure_loglikelihood_s(model, [s[:-1] for s in singles], batch_size, pad) if singles else 0.0)


@torch.inference_mode()
def pure_loglikelihood_s(model: Any, sequences: list[list[int]], batch_size: int, pad: int) -> float:
    """One forward pass per batch over context + continuation (right-padded, as lm-eval scores them)."""
    ordered = sorted(sequences, key=lambda s: -len(s))
    start = time.perf_counter()
    for offset in range(0, len(ordered), batch_size):
        batch = ordered[offset:offset + batch_size]
        width = max(len(s) for s in batch)
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in batch])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch])
        model(input_ids=ids, attention_mask=mask).logits.log_softmax(-1)
    return time.perf_counter() - start


def accuracy_table(records: pd.DataFrame) -> dict[str, Any]:
    """Accuracy overall, per task and per sub-slice, with item counts."""
    def rows(column: str) -> dict[str, dict[str, float]]:
        grouped = records.groupby(column)["correct"]
        return {str(k): {"n": int(n), "acc": round(float(a), 3)} for k, n, a in
                zip(grouped.size().index, grouped.size(), grouped.mean())}
    return {"n": len(records), "acc": round(float(records["correct"].mean()), 3),
            "clusters": int(records["cluster"].nunique()), "tasks": rows("task"), "sub_slices": rows("sub_slice")}


def bench_slice(loaded: models.LoadedModel, lm: Any, slice_: Slice, settings: evaluate.EvalSettings,
                repeats: int, records_dir: str = "", replay: bool = True) -> dict[str, Any]:
    load_before = os.getloadavg()
    start = time.perf_counter()
    results = evaluate.run_lm_eval(lm, slice_, settings)
    wall = time.perf_counter() - start
    records, _ = evaluate.records_from_results(results, slice_)
    if records_dir:
        Path(records_dir).mkdir(parents=True, exist_ok=True)
        records.to_csv(Path(records_dir) / f"{slice_.name}.csv", index=False)
    requests = collect_requests(results, loaded.tokenizer, settings.max_length)
    pad = loaded.tokenizer.pad_token_id
    if not replay:
        repeats = 0
    compact = settings.generator == "harness"
    gen_s = 0.0 if not repeats else statistics.median(pure_generate_s(loaded.model, requests.generate, settings.batch_size, pad, compact)
                              for _ in range(repeats)) if requests.generate else 0.0
    def ll_once() -> float:
        if compact:
            return pure_shared_context_s(loaded.model, requests.pairs, settings.batch_size, pad)
        return pure_loglikelihood_s(loaded.model, requests.loglikelihood, settings.batch_size, pad)
    ll_s = 0.0 if not repeats else statistics.median(ll_once() for _ in range(repeats)) if requests.loglikelihood else 0.0
    pure = gen_s + ll_s
    return {
        "eval_wall_s": round(wall, 2), "pure_model_s": round(pure, 2),
        "pure_generate_s": round(gen_s, 2), "pure_loglikelihood_s": round(ll_s, 2),
        "ratio": round(wall / pure, 3) if pure else None,
        "generate_requests": len(requests.generate),
        "prompt_tokens": sum(len(p) for p, _ in requests.generate),
        "generated_tokens": sum(n for _, n in requests.generate),
        "loglikelihood_requests": len(requests.loglikelihood),
        "loglikelihood_tokens": sum(len(s) for s in requests.loglikelihood),
        "accuracy": accuracy_table(records),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "batch_size": settings.batch_size, "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def body(parsed: cli.Parsed[Options]) -> None:
    options = parsed.options
    torch.set_num_threads(options.torch_threads)
    cfg = to_config(parsed.run)
    slices = resolve(cfg.slices)
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    settings = eval_settings(cfg, tokenizer_dir(loaded))
    lm = evaluate.make_lm(loaded.model, loaded.tokenizer, settings)
    out = Path(options.out)
    merged = json.loads(out.read_text()) if out.exists() else {}
    print("| slice | n | acc | eval wall s | pure model s | ratio | gen tokens | load avg |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for slice_ in slices:
        entry = {"model": cfg.model.name, "size": slice_.config.size, **bench_slice(loaded, lm, slice_, settings,
                                                                                  options.repeats, options.records_dir,
                                                                                  options.replay)}
        merged[slice_.name] = entry
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(merged, indent=2) + "\n")
        acc = entry["accuracy"]
        print(f"| {slice_.name} | {acc['n']} | {acc['acc']:.3f} | {entry['eval_wall_s']:.1f} | "
              f"{entry['pure_model_s']:.1f} | {entry['ratio']} | {entry['generated_tokens']} | "
              f"{entry['load_average_before'][0]:.1f} |")
        for name, row in acc["sub_slices"].items():
            print(f"|   {name} | {row['n']} | {row['acc']:.3f} | | | | | |")


TOOL = cli.Tool(prog="python benchmarks/bench_eval_speed.py", summary=__doc__.split("\n\n")[0], options=Options,
                run_config=True)

if __name__ == "__main__":
    sys.exit(cli.main(TOOL, body))
