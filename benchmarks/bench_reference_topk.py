"""Error of the compact (top-k + tail) reference against the exact KL, on SmolLM2-135M.

The reference model's next-token distribution can be cached in full (``eval.reference_topk=0``:
T x V floats, 196 KB per token on SmolLM2's 49,152-token vocabulary) or compactly as its top-k
log-probs plus the lumped tail (``eval.reference_topk=k``: 8k bytes per token). KL on the
top-k + tail partition is a lower bound of the exact KL (log-sum inequality); this measures by
how much, per slice, for several k, with the harness's own code (``divergence.score_reference``
builds the compact reference exactly as below; ``divergence._kl_pair`` computes both KLs).

    .venv/bin/python benchmarks/bench_reference_topk.py [--scheme int4_g128] [--ks 32,64,128,256]
        [--slices math,multilingual,code,long_context] [--max-tokens 2048] [--threads 1] [--device cpu]

Writes results/bench/reference_topk_<scheme>.json and prints a Markdown table. The relative
error of the mean KL must stay below 1% for the recommended default k.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from harness import quant
from harness.divergence import scoring as divergence
from harness.models import loading as models
from harness.config import REPO_DIR, compose, load_model_config
from harness.job.identity import eval_settings, tokenizer_dir
from harness.job.divergence_texts import divergence_texts
from harness.config import to_config
from harness.evaluation.slices import resolve

BYTES_PER_LOGPROB = 4  # float32, as score_reference stores them
BYTES_PER_ID = 4  # int32 ids


def compact(reference: divergence.ReferenceText, k: int) -> divergence.ReferenceText:
    """The top-k + tail reference score_reference(topk=k) would have stored for this text."""
    values, indices = reference.logp.topk(k, dim=-1)
    return divergence.ReferenceText(reference.input_ids, *reference.targets(), None,
                                    indices.int(), values)


@torch.no_grad()
def from_hidden_state(model: torch.nn.Module, reference: divergence.ReferenceText,
                      dtype: torch.dtype) -> divergence.ReferenceText:
    """The reference rebuilt from its final (post-norm) hidden state stored in ``dtype``: logits =
    lm_head(h), so hidden_size numbers per token determine the whole distribution (exact when the
    lm_head used at comparison time is the reference's own, unquantized)."""
    device = next(model.parameters()).device
    out = model(reference.input_ids.unsqueeze(0).to(device), output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states[-1][0, :-1].to(dtype)  # what would be stored
    head = model.get_output_embeddings()
    logp = torch.log_softmax(head(hidden.to(head.weight.dtype)).float(), dim=-1).cpu()
    return divergence.ReferenceText(reference.input_ids, *reference.targets(), logp, None, None)


HIDDEN_VARIANTS = {"hidden_fp32": torch.float32, "hidden_bf16": torch.bfloat16}


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    cache_dir = os.path.expanduser(args.cache_dir)
    model_cfg = load_model_config(args.model)
    model_cfg.device = args.device
    reference = models.load(model_cfg, cache_dir)
    quantized = models.load(model_cfg, cache_dir)
    cfg = to_config(compose([f"model={args.model}", f"quant={args.scheme}", f"slices=[{args.slices}]",
                             f"model.device={args.device}"]))
    quant.apply(quantized.model, quant.with_model_defaults(cfg.quant, True))
    settings = eval_settings(cfg, tokenizer_dir(reference))
    ks: list = [int(k) for k in args.ks.split(",")] + list(HIDDEN_VARIANTS)
    per_slice: dict[str, dict] = {}
    start = time.perf_counter()
    for slice_ in resolve(cfg.slices):
        texts = divergence_texts(slice_, settings)
        exact_kl, exact_rev, compact_kl = [], [], {k: [] for k in ks}
        compact_rev, tail_mass = {k: [] for k in ks}, {k: [] for k in ks}
        for text in texts:
            ref = divergence.score_reference(reference.model, reference.tokenizer, [text],
                                             max_tokens=args.max_tokens, topk=0)[0]
            logq = divergence._log_probs(quantized.model, ref.input_ids)
            forward, backward = divergence._kl_pair(ref, logq)
            exact_kl.append(forward.double().cpu())
            exact_rev.append(backward.double().cpu())
            for k in ks:
                small = compact(ref, k) if isinstance(k, int) else from_hidden_state(reference.model, ref,
                                                                                     HIDDEN_VARIANTS[k])
                forward_k, backward_k = divergence._kl_pair(small, logq)
                compact_kl[k].append(forward_k.double().cpu())
                compact_rev[k].append(backward_k.double().cpu())
                if small.topk_logp is not None:
                    tail_mass[k].append((1 - small.topk_logp.double().exp().sum(-1)).cpu())
            del ref, logq
        exact = torch.cat(exact_kl).clamp(min=0)
        exact_r = torch.cat(exact_rev).clamp(min=0)
        rows = {}
        for k in ks:
            approx = torch.cat(compact_kl[k]).clamp(min=0)
            approx_r = torch.cat(compact_rev[k]).clamp(min=0)
            visible = exact > 1e-4
            token_error = ((exact - approx) / exact)[visible] if visible.any() else torch.zeros(1)
            rows[k] = {
                "kl_mean_exact": float(exact.mean()), "kl_mean_topk": float(approx.mean()),
                "rel_error_mean_kl": float(1 - approx.mean() / exact.mean()),
                "kl_reverse_mean_exact": float(exact_r.mean()), "kl_reverse_mean_topk": float(approx_r.mean()),
                "rel_error_mean_kl_reverse": float(1 - approx_r.mean() / exact_r.mean()),
                "token_rel_error_p99": float(np.percentile(token_error.numpy(), 99)),
                "token_rel_error_max": float(token_error.max()),
                "tail_mass_mean": float(torch.cat(tail_mass[k]).mean()) if tail_mass[k] else 0.0,
                "lower_bound_violations": int((approx > exact + 1e-6).sum()),
            }
        per_slice[slice_.name] = {"n_texts": len(texts), "n_tokens": int(exact.numel()), "by_k": rows}
        print(f"{slice_.name}: {len(texts)} texts, {exact.numel()} tokens, {time.perf_counter() - start:.0f}s",
              flush=True)
    vocab = int(reference.model.config.vocab_size)
    return {"model": args.model, "scheme": args.scheme, "max_tokens": args.max_tokens, "vocab": vocab,
            "device": args.device, "bytes_per_token_exact": vocab * BYTES_PER_LOGPROB,
            "bytes_per_token_topk": {k: k * (BYTES_PER_LOGPROB + BYTES_PER_ID) for k in ks if isinstance(k, int)},
            "bytes_per_token_hidden": {name: int(reference.model.config.hidden_size) * dtype.itemsize
                                       for name, dtype in HIDDEN_VARIANTS.items()},
            "slices": per_slice, "seconds": time.perf_counter() - start}


def pooled(result: dict, k: int) -> tuple[float, float]:
    """Relative error of the mean KL over all tokens of all slices (forward, reverse)."""
    rows = [(s["n_tokens"], s["by_k"][k]) for s in result["slices"].values()]

    def mean(key: str) -> float:
        return sum(n * r[key] for n, r in rows) / sum(n for n, _ in rows)

    return (1 - mean("kl_mean_topk") / mean("kl_mean_exact"),
            1 - mean("kl_reverse_mean_topk") / mean("kl_reverse_mean_exact"))


def markdown(result: dict) -> str:
    ks = sorted(int(k) for k in result["bytes_per_token_topk"]) + list(result["bytes_per_token_hidden"])
    lines = [f"{result['model']} · {result['scheme']} · texts truncated to {result['max_tokens']} tokens · "
             f"exact reference {result['bytes_per_token_exact'] / 1024:.0f} KiB/token", "",
             "| slice | tokens | mean KL exact | " + " | ".join(f"rel. error {k if isinstance(k, str) else f'k={k}'}" for k in ks) + " |",
             "|---|---|---|" + "---|" * len(ks)]
    for name, data in result["slices"].items():
        errors = " | ".join(f"{100 * data['by_k'][k]['rel_error_mean_kl']:.3f}%" for k in ks)
        lines.append(f"| {name} | {data['n_tokens']} | {data['by_k'][ks[0]]['kl_mean_exact']:.5f} | {errors} |")
    lines.append("| **all** | | | " + " | ".join(f"**{100 * pooled(result, k)[0]:.3f}%**" for k in ks) + " |")
    lines.append("| all, KL(q‖r) | | | " + " | ".join(f"{100 * pooled(result, k)[1]:.3f}%" for k in ks) + " |")
    sizes = {**{f"k={k}": b for k, b in result["bytes_per_token_topk"].items()}, **result["bytes_per_token_hidden"]}
    lines += ["", "Bytes per token: " + ", ".join(f"{name}: {b} B" for name, b in sizes.items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--scheme", default="int4_g128")
    parser.add_argument("--ks", default="32,64,128,256")
    parser.add_argument("--slices", default="math,multilingual,code,long_context")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache-dir", default=os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness"))
    parser.add_argument("--out", default=str(REPO_DIR / "results" / "bench"))
    args = parser.parse_args()
    result = measure(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"reference_topk_{args.scheme}.json"
    path.write_text(json.dumps(result, indent=2))
    print(markdown(result))
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
