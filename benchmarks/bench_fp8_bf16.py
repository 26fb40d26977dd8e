"""W8A8 / W4A4 schemes in float32 and in bf16 on SmolLM2-135M, against a real FP8 GEMM (issue 23).

For each scheme and each model dtype: the harness's mean KL(reference || quantized) over the math
slice's divergence texts and over prose windows, the reference being the unquantized model in the
same dtype. For ``fp8`` (per-channel E4M3 weights, dynamic per-token E4M3 activations) it also
builds the deployed computation independently of ``harness.quant``: every target linear replaced
by ``torch._scaled_mm`` on E4M3 codes with fp32 row-wise scales (the FP8 GEMM vLLM runs, here on
the CPU), and reports its KL and KL(real || harness). ``--perturb-seeds`` measures how sensitive
the float32 fp8 KL is to a perturbation the size of one bf16 rounding (each quantized weight times
1 + U(-2^-9, 2^-9)): the spread says how much of a dtype gap a few texts can show by chance.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_fp8_bf16.py [--schemes fp8,int8_w8a8]
        [--dtypes float32,bfloat16] [--prose-windows 2] [--prose-tokens 128] [--perturb-seeds 0]
        [--threads 1] [--out benchmarks/results/fp8_bf16.json]

bf16 is ~5x slower than float32 on a CPU: the text counts are small on purpose (math: the slice's
16 divergence texts, 236 scored tokens; prose: two 128-token windows of the offline prose source).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import time
from pathlib import Path

import torch
from torch import nn

from harness import quant
from harness.divergence import scoring as divergence
from harness.models import loading as models
from harness.infra.cache import Cache
from harness.config import REPO_DIR, compose
from harness.job.identity import eval_settings, tokenizer_dir
from harness.job.divergence_texts import divergence_texts
from harness.config import to_config
from harness.quant.calibration import CalibrationContext, offline_corpus
from harness.evaluation.slices import resolve

SCHEMES = ["fp8", "fp8_block", "fp8_static", "int8_w8a8", "nvfp4", "mxfp8", "fp8_w8a16"]
E4M3 = torch.float8_e4m3fn


def rowwise_e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes of each row of ``t`` and its fp32 scale amax/448 (what vLLM's FP8_DYNAMIC stores)."""
    t = t.float()
    scale = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (t / scale).clamp(-448.0, 448.0).to(E4M3), scale


class ScaledMMLinear(nn.Module):
    """A linear computed as the deployed FP8 W8A8 kernel does: ``torch._scaled_mm`` on E4M3 codes."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.codes, self.scale = rowwise_e4m3(linear.weight.data)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        codes, scale = rowwise_e4m3(flat)
        out = torch._scaled_mm(codes, self.codes.t(), scale_a=scale, scale_b=self.scale.t().contiguous(),
                               out_dtype=x.dtype).reshape(*x.shape[:-1], -1)
        return out if self.bias is None else out + self.bias


def scaled_mm_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose linears, lm_head excepted, run through :class:`ScaledMMLinear`."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(parent, name, ScaledMMLinear(child))
    return model


@torch.no_grad()
def log_probs(model: nn.Module, texts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.log_softmax(model(ids.unsqueeze(0), use_cache=False).logits[0, :-1].float(), -1) for ids in texts]


def kl_per_text(reference: list[torch.Tensor], other: list[torch.Tensor]) -> list[float]:
    return [float((p.exp() * (p - q)).sum(-1).mean()) for p, q in zip(reference, other)]


def mean_kl(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """Mean over scored tokens (as the harness's kl_mean), not over texts."""
    return float(torch.cat([(p.exp() * (p - q)).sum(-1) for p, q in zip(reference, other)]).mean())


def text_sets(loaded: models.LoadedModel, cfg, args: argparse.Namespace) -> dict[str, list[torch.Tensor]]:
    slice_ = resolve(cfg.slices)[0]
    math = divergence_texts(slice_, eval_settings(cfg, tokenizer_dir(loaded)))
    ids = loaded.tokenizer(offline_corpus(), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    rng = random.Random("bench_fp8_bf16/prose")
    starts = sorted(rng.randrange(0, len(ids) - args.prose_tokens) for _ in range(args.prose_windows))
    return {"math": [divergence.tokenize(loaded.tokenizer, t, 1024) for t in math],
            "prose": [ids[s:s + args.prose_tokens] for s in starts]}


def quantized(model: nn.Module, loaded: models.LoadedModel, name: str, cache: Cache) -> nn.Module:
    cfg = to_config(compose(["model=smollm2_135m", f"quant={name}"]))
    scheme = quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups)
    copy_ = copy.deepcopy(model)
    context = CalibrationContext(model_key=f"bench_fp8_bf16-{loaded.key}", tokenizer=loaded.tokenizer,
                                 config=scheme.calibration, device=torch.device("cpu"), cache=cache, scheme=scheme)
    quant.apply(copy_, scheme, context)
    return copy_


@torch.no_grad()
def perturbed(model: nn.Module, seed: int) -> nn.Module:
    """``model`` with every activation-quantized weight times 1 + U(-2^-9, 2^-9) (one bf16 rounding's size)."""
    from harness.quant.linear import ActQuantLinear
    model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, ActQuantLinear):
            noise = (torch.rand(module.weight.shape, generator=generator) * 2 - 1) * 2.0 ** -9
            module.weight.mul_(1 + noise)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prose-windows", type=int, default=2)
    parser.add_argument("--prose-tokens", type=int, default=128)
    parser.add_argument("--perturb-seeds", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(REPO_DIR / "benchmarks" / "results" / "fp8_bf16.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cache_dir = os.environ.get("HARNESS_CACHE_DIR", str(Path.home() / ".cache" / "quant-harness"))
    cache = Cache(Path(cache_dir))
    results: dict = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                     "threads": args.threads, "load_before": os.getloadavg(), "rows": []}
    start = time.perf_counter()
    for dtype in args.dtypes.split(","):
        cfg = to_config(compose(["model=smollm2_135m", "slices=[math]", f"model.dtype={dtype}"]))
        loaded = models.load(cfg.model, cache_dir)
        texts = text_sets(loaded, cfg, args)
        reference = {k: log_probs(loaded.model, v) for k, v in texts.items()}
        results.setdefault("tokens", {k: sum(len(t) - 1 for t in v) for k, v in texts.items()})
        for name in args.schemes.split(","):
            t0 = time.perf_counter()
            model = quantized(loaded.model, loaded, name, cache)
            row = {"scheme": name, "dtype": dtype}
            for key, ids in texts.items():
                got = log_probs(model, ids)
                row[key] = mean_kl(reference[key], got)
                row[f"{key}_per_text"] = kl_per_text(reference[key], got)
                if name == "fp8":
                    real = log_probs(scaled_mm_model(loaded.model), ids)
                    row[f"{key}_scaled_mm"] = mean_kl(reference[key], real)
                    row[f"{key}_kl_real_vs_harness"] = mean_kl(real, got)
                if name == "fp8" and key == "math" and dtype == "float32" and args.perturb_seeds:
                    row["math_perturbed"] = [mean_kl(reference[key], log_probs(perturbed(model, s), ids))
                                             for s in range(args.perturb_seeds)]
            row["seconds"] = time.perf_counter() - t0
            results["rows"].append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                              if not k.endswith("per_text")}), flush=True)
            del model
    results["seconds"] = time.perf_counter() - start
    results["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    by = {(r["scheme"], r["dtype"]): r for r in results["rows"]}
    print("\n| scheme | math fp32 | math bf16 | prose fp32 | prose bf16 |\n|---|---:|---:|---:|---:|")
    for name in args.schemes.split(","):
        cells = [by.get((name, d), {}).get(k) for k in ("math", "prose") for d in ("float32", "bfloat16")]
        print(f"| `{name}` | " + " | ".join("" if c is None else f"{c:.4f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
