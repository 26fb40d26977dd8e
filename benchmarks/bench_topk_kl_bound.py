"""How far below the exact KL a server's top-k partition KL lies, on SmolLM2-135M.

A served candidate gives only its top-k log-probs per position, so the harness reports KL on the
top-k partition (each of the server's top-k tokens a cell, the rest lumped): a lower bound of the
exact KL(reference ‖ candidate) (harness.divergence.topk_bound). Here both full distributions are local
(the reference and the harness's own simulation of a scheme), so the exact KL and the bound of the
*same* distributions are both computed, on the served texts of each slice: the items' prompts as
evaluated (chat template) followed by the reference's own greedy reply, exactly the texts a served
run scores. The candidate's top-k is taken from its float32 log-probs, as a server returns them.

    .venv/bin/python benchmarks/bench_topk_kl_bound.py [--schemes int4_g128,fp8,int8] [--ks 1,5,20,50]
        [--slices math,structured] [--items 24] [--max-gen-toks 96] [--threads 1]

Writes benchmarks/results/topk_kl_bound.json and prints a Markdown table per scheme.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from harness import quant
from harness.config import REPO_DIR, compose, load_model_config
from harness.divergence import scoring as divergence
from harness.divergence.topk_bound import partition_kl
from harness.evaluation import evaluate
from harness.evaluation.slices import resolve
from harness.job.identity import ReferenceSpec, eval_settings, tokenizer_dir
from harness.job.divergence_texts import max_divergence_tokens, served_texts
from harness.config import to_config
from harness.models import loading as models

CHUNK = 256


def texts_of(reference: models.LoadedModel, args: argparse.Namespace) -> dict[str, list[tuple[torch.Tensor, int]]]:
    """Per slice: (token ids, prompt length) of each served text, the reference's replies generated here."""
    overrides = [f"model={args.model}", "quant=none", f"slices=[{args.slices}]", f"model.device={args.device}",
                 f"eval.max_gen_toks={args.max_gen_toks}",
                 *[f"slices.{name}.n_items={args.items}" for name in args.slices.split(",")]]
    cfg = to_config(compose(overrides))
    settings = eval_settings(cfg, tokenizer_dir(reference))
    lm = evaluate.make_lm(reference.model, reference.tokenizer, settings)
    out = {}
    for slice_ in resolve(cfg.slices):
        records, _ = evaluate.evaluate_slice(lm, slice_, settings)
        limit = max_divergence_tokens(slice_, ReferenceSpec.of(cfg))
        out[slice_.name] = [(divergence.tokenize(reference.tokenizer, text, limit),
                             divergence.prompt_length(text, limit)) for text in served_texts(slice_, records,
                                                                                             reference.tokenizer)]
    return out


def exact_kl(logp: torch.Tensor, logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p‖q) and KL(q‖p) per row over the whole vocabulary, float64."""
    logp, logq = torch.log_softmax(logp.double(), -1), torch.log_softmax(logq.double(), -1)
    return (logp.exp() * (logp - logq)).sum(-1), (logq.exp() * (logq - logp)).sum(-1)


@torch.no_grad()
def measure_scheme(reference: models.LoadedModel, scheme: str, texts: dict, ks: list[int],
                   args: argparse.Namespace) -> dict:
    model_cfg = load_model_config(args.model)
    model_cfg.device = args.device
    candidate = models.load(model_cfg, os.path.expanduser(args.cache_dir))
    cfg = to_config(compose([f"model={args.model}", f"quant={scheme}", f"model.device={args.device}"]))
    quant.apply(candidate.model, quant.with_model_defaults(cfg.quant, True))
    per_slice = {}
    for name, items in texts.items():
        exact, exact_rev, reply = [], [], []
        bound = {k: [] for k in ks}
        bound_rev = {k: [] for k in ks}
        for ids, prompt_tokens in items:
            logp_all = divergence._log_probs(reference.model, ids).float().cpu()
            logq_all = divergence._log_probs(candidate.model, ids).float().cpu()  # float32, as a server sends
            positions = torch.arange(1, len(ids))
            reply.append(positions >= prompt_tokens)
            for a in range(0, len(positions), CHUNK):
                logp, logq = logp_all[a:a + CHUNK], logq_all[a:a + CHUNK]
                forward, backward = exact_kl(logp, logq)
                exact.append(forward)
                exact_rev.append(backward)
                for k in ks:
                    values, top = logq.topk(k, dim=-1)
                    kl, kl_rev = partition_kl(logp, top, values.double())
                    bound[k].append(kl)
                    bound_rev[k].append(kl_rev)
        exact_t = torch.cat(exact).clamp(min=0)
        exact_r = torch.cat(exact_rev).clamp(min=0)
        is_reply = torch.cat(reply)
        rows = {}
        for k in ks:
            low = torch.cat(bound[k])
            low_r = torch.cat(bound_rev[k])
            visible = exact_t > 1e-6
            ratio = (low[visible] / exact_t[visible]).numpy()
            rows[k] = {
                "kl_mean_exact": float(exact_t.mean()), "kl_mean_bound": float(low.mean()),
                "bound_over_exact": float(low.mean() / exact_t.mean()),
                "kl_mean_exact_reply": float(exact_t[is_reply].mean()),
                "kl_mean_bound_reply": float(low[is_reply].mean()),
                "bound_over_exact_reply": float(low[is_reply].mean() / exact_t[is_reply].mean()),
                "kl_reverse_mean_exact": float(exact_r.mean()), "kl_reverse_mean_bound": float(low_r.mean()),
                "bound_over_exact_reverse": float(low_r.mean() / exact_r.mean()),
                "token_ratio_p10": float(np.percentile(ratio, 10)), "token_ratio_p50": float(np.percentile(ratio, 50)),
                "tokens_below_half": float(np.mean(ratio < 0.5)),
                "max_bound_minus_exact": float((low - exact_t).max()),
            }
        per_slice[name] = {"n_texts": len(items), "n_tokens": int(exact_t.numel()),
                           "n_reply_tokens": int(is_reply.sum()), "by_k": rows}
        print(f"  {scheme} {name}: {len(items)} texts, {exact_t.numel()} tokens", flush=True)
    return per_slice


def pooled(slices: dict, k: int, suffix: str = "") -> float:
    """Bound over exact of the token-weighted mean KL over all slices."""
    weight = "n_reply_tokens" if suffix == "_reply" else "n_tokens"
    exact = sum(s[weight] * s["by_k"][k][f"kl_mean_exact{suffix}"] for s in slices.values())
    low = sum(s[weight] * s["by_k"][k][f"kl_mean_bound{suffix}"] for s in slices.values())
    return low / exact


def markdown(result: dict) -> str:
    ks = result["ks"]
    lines = []
    for scheme, slices in result["schemes"].items():
        lines += [f"### {scheme}", "",
                  "| slice | tokens (reply) | exact KL, reply | "
                  + " | ".join(f"k={k}: bound / exact, reply" for k in ks) + " |", "|---|---|---|" + "---|" * len(ks)]
        for name, data in slices.items():
            cells = " | ".join(f"{data['by_k'][k]['bound_over_exact_reply']:.3f}" for k in ks)
            lines.append(f"| {name} | {data['n_tokens']} ({data['n_reply_tokens']}) | "
                         f"{data['by_k'][ks[0]]['kl_mean_exact_reply']:.4f} | {cells} |")
        pooled_reply = " | ".join(f"**{pooled(slices, k, '_reply'):.3f}**" for k in ks)
        lines.append(f"| **all, reply** | | | {pooled_reply} |")
        lines.append("| all, every position | | | " + " | ".join(f"{pooled(slices, k):.3f}" for k in ks) + " |")
        lines.append("")
    return "\n".join(lines)


def machine() -> dict:
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"nproc": os.cpu_count(), "uptime": load, "platform": platform.platform(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--schemes", default="int4_g128,fp8,int8")
    parser.add_argument("--ks", default="1,5,20,50")
    parser.add_argument("--slices", default="math,structured")
    parser.add_argument("--items", type=int, default=24, help="items per slice (each gives one served text)")
    parser.add_argument("--max-gen-toks", type=int, default=96, help="cap on the reference's replies")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache-dir", default=os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness"))
    parser.add_argument("--out", default=str(REPO_DIR / "benchmarks" / "results" / "topk_kl_bound.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before = machine()
    start = time.perf_counter()
    model_cfg = load_model_config(args.model)
    model_cfg.device = args.device
    reference = models.load(model_cfg, os.path.expanduser(args.cache_dir))
    texts = texts_of(reference, args)
    ks = [int(k) for k in args.ks.split(",")]
    schemes = {scheme: measure_scheme(reference, scheme, texts, ks, args) for scheme in args.schemes.split(",")}
    result = {"model": args.model, "slices": args.slices.split(","), "items_per_slice": args.items,
              "max_gen_toks": args.max_gen_toks, "threads": args.threads, "ks": ks,
              "vocab": int(reference.model.config.vocab_size), "schemes": schemes,
              "pooled_reply": {s: {k: pooled(v, k, "_reply") for k in ks} for s, v in schemes.items()},
              "pooled_all": {s: {k: pooled(v, k) for k in ks} for s, v in schemes.items()},
              "machine_before": before, "machine_after": machine(), "seconds": time.perf_counter() - start}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(markdown(result))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
