"""GPTQ and AWQ against round-to-nearest on SmolLM2-135M: the acceptance numbers of issue 4.

Each calibrated method is compared with RTN on its own grid (GPTQ: ``int4_g128``, symmetric;
AWQ: ``int4_g128_asym``), on 128 × 512 offline calibration tokens:

- calibration + quantization wall time and the process's peak resident memory during it;
- per-layer output error ``|(W_q - W) x|²`` on held-out inputs ``x`` (the reference model's own
  inputs of every linear, on calibration-corpus windows disjoint from the calibration windows;
  AWQ's weights are taken in the original coordinates, ``diag(s_out) · Q · diag(1/s_in)``):
  the share of linears where the method beats RTN;
- mean KL(ref‖quant) per token on the math slice's gold texts and on held-out prose;
- an extrapolation of the per-block rate to Llama-3.1-8B on one GPU: an ESTIMATE from
  stated assumptions, not a measurement.

    .venv/bin/python benchmarks/bench_gptq_awq.py [--samples 128] [--seq-len 512] [--blocks N]

Writes benchmarks/results/gptq_awq.json and prints a table. Calibration is run directly (the
calibrated-weight cache is bypassed) so that the times are real.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import resource
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from harness.divergence import scoring as divergence
from harness.models import loading as models
from harness.infra.cache import Cache
from harness.config import REPO_DIR, CalibrationConfig, SliceConfig, compose, load_model_config
from harness.quant import awq, gptq
from harness.quant import QuantReport, target_linears, with_model_defaults
from harness.quant.calibration import CalibrationContext, offline_corpus
from harness.quant.rtn import quantize_weights_rtn
from harness.evaluation.slices import resolve

SCHEMES = {"rtn_sym": "int4_g128", "rtn_asym": "int4_g128_asym", "gptq": "gptq_w4g128", "awq": "awq_w4g128"}
BASELINE = {"gptq": "rtn_sym", "awq": "rtn_asym"}


class PeakRSS:
    """Samples this process's resident set size (VmRSS) while a block of code runs."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    @staticmethod
    def current() -> int:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.start = self.current()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


def scheme(name: str, ragged: bool) -> Any:
    return with_model_defaults(OmegaConf.to_object(compose([f"quant={name}"]).quant), ragged)


def held_out_windows(tokenizer: Any, config: CalibrationConfig, calibration: torch.Tensor, count: int) -> torch.Tensor:
    """Windows of the calibration corpus that overlap no calibration window."""
    ids = tokenizer(offline_corpus(), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    length = config.seq_len
    rng = random.Random(f"calibration/{config.seed}")  # the starts calibration_tokens draws
    starts = [rng.randrange(0, len(ids) - length) for _ in range(config.num_samples)]
    assert torch.equal(torch.stack([ids[s:s + length] for s in starts]), calibration), \
        "calibration_tokens changed how it samples windows; update held_out_windows"
    covered = torch.zeros(len(ids), dtype=torch.bool)
    for start in starts:
        covered[start:start + length] = True
    free = [s for s in range(0, len(ids) - length, length) if not covered[s:s + length].any()]
    if len(free) < count:
        raise SystemExit(f"only {len(free)} held-out windows of {length} tokens are free; lower --held-out")
    random.Random("held-out").shuffle(free)
    return torch.stack([ids[s:s + length] for s in sorted(free[:count])])


@torch.no_grad()
def layer_errors(reference: torch.nn.Module, names: list[str], effective: dict[str, dict[str, torch.Tensor]],
                 tokens: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per linear: Σ|(W_eff - W) x|² for each method, with x the reference model's inputs."""
    modules = dict(reference.named_modules())
    errors = {name: {m: 0.0 for m in effective} | {"energy": 0.0} for name in names}

    def hook(name: str) -> Callable:
        def measure(_module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            y = output.reshape(-1, output.shape[-1])
            errors[name]["energy"] += float(y.pow(2).sum())
            for method, weights in effective.items():
                errors[name][method] += float((x @ weights[name].T - y).pow(2).sum())
        return measure

    handles = [modules[name].register_forward_hook(hook(name)) for name in names]
    try:
        for batch in tokens.split(4):
            reference(batch, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return errors


def mean_kl(model: torch.nn.Module, references: dict[str, list]) -> dict[str, float]:
    out = {}
    for name, refs in references.items():
        frame = divergence.compare_to_reference(model, refs, name)
        out[name] = float(frame["kl"].mean())
        out[f"{name}_tokens"] = int(len(frame))
    return out


def gptq_estimate(block_seconds: float, solve_seconds: float, hessian_seconds: float) -> dict[str, Any]:
    """Llama-3.1-8B GPTQ/AWQ on one H100-class GPU: first-principles ESTIMATE with stated assumptions."""
    tokens, hidden, inter, layers, kv = 128 * 512, 4096, 14336, 32, 1024
    params_block = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter
    columns_block = 6 * hidden + inter  # q, k, v, o, gate, up have 4096 inputs; down 14336
    assumptions = {"bf16_matmul_tflops": 300.0, "fp32_hessian_tflops": 50.0,
                   "seconds_per_gptq_column": 120e-6, "awq_search_samples": awq.DEFAULT_SEARCH_SAMPLES}
    forward = 2 * params_block * tokens / (assumptions["bf16_matmul_tflops"] * 1e12)
    hessian = 2 * (3 * hidden ** 2 + inter ** 2) * tokens / (assumptions["fp32_hessian_tflops"] * 1e12)
    solve = columns_block * assumptions["seconds_per_gptq_column"]  # ~12 small kernels per column, launch-bound
    search = 20 * 2 * params_block * assumptions["awq_search_samples"] * 512 / (assumptions["bf16_matmul_tflops"] * 1e12)
    gptq_block, awq_block = forward + hessian + solve, forward + search + 0.3  # 0.3 s: clip search and rounding
    return {
        "ESTIMATE": "not measured: Llama-3.1-8B on one H100-class GPU, 128 x 512 calibration tokens",
        "assumptions": assumptions,
        "gptq_seconds_per_block": round(gptq_block, 2), "gptq_minutes_total": round(gptq_block * layers / 60, 1),
        "awq_seconds_per_block": round(awq_block, 2), "awq_minutes_total": round(awq_block * layers / 60, 1),
        "smollm2_cpu_gptq_split_s_per_block": {"total": round(block_seconds, 2), "solve": round(solve_seconds, 2),
                                              "hessian": round(hessian_seconds, 2)},
    }


def _cpu_seconds() -> float:
    """CPU time of this process, all threads: independent of how busy the machine's other jobs keep it."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_method(method: str, model: torch.nn.Module, spec: Any, tokens: torch.Tensor,
                 report: QuantReport, search_samples: int) -> tuple[dict, Any]:
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    with PeakRSS() as rss:
        if method == "gptq":
            outcome = gptq.quantize_gptq(model, spec, tokens, "cpu", report, batch_size=8)
        elif method == "awq":
            outcome = awq.quantize_awq(model, spec, tokens, "cpu", report, batch_size=8, search_samples=search_samples)
        else:
            outcome = quantize_weights_rtn(model, spec, report)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 1), "cpu_seconds": round(_cpu_seconds() - cpu_start, 1),
            "peak_rss_gb": round(rss.peak / 1e9, 2),
            "rss_growth_gb": round((rss.peak - rss.start) / 1e9, 2)}, outcome


def run(args: argparse.Namespace) -> dict:
    model_cfg = load_model_config("smollm2_135m")
    loaded = models.load(model_cfg, args.cache_dir)
    reference = loaded.model
    if args.blocks:
        reference.model.layers = reference.model.layers[:args.blocks]
        reference.config.num_hidden_layers = args.blocks
    specs = {m: scheme(name, model_cfg.ragged_groups) for m, name in SCHEMES.items()}
    calibration = CalibrationConfig(num_samples=args.samples, seq_len=args.seq_len)
    context = CalibrationContext(model_key=loaded.key, tokenizer=loaded.tokenizer, config=calibration,
                                 device=torch.device("cpu"), cache=Cache(args.cache_dir), scheme=specs["gptq"])
    tokens = context.tokens()
    held_out = held_out_windows(loaded.tokenizer, calibration, tokens, args.held_out)
    math = resolve({"math": SliceConfig(tasks=["harness_math_gen"], size="quick", divergence_texts=48)})[0]
    texts = {"math": math.divergence_texts(**math.metadata(1234)),
             "held_out_prose": [loaded.tokenizer.decode(w) for w in held_out[:8]]}
    references = {k: divergence.score_reference(reference, loaded.tokenizer, v, max_tokens=args.seq_len)
                  for k, v in texts.items()}

    timings: dict[str, float] = {"solve": 0.0, "hessian": 0.0}
    solve, add_batch = gptq.gptq_quantize_weight, gptq.HessianAccumulator.add_batch

    def timed(key: str, fn: Callable) -> Callable:
        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timings[key] += time.perf_counter() - start
        return wrapper

    gptq.gptq_quantize_weight = timed("solve", solve)
    gptq.HessianAccumulator.add_batch = timed("hessian", add_batch)
    results: dict[str, Any] = {"methods": {}}
    effective: dict[str, dict[str, torch.Tensor]] = {}
    names = list(target_linears(reference, specs["gptq"])[0])
    for method in ("rtn_sym", "rtn_asym", "gptq", "awq"):
        model = copy.deepcopy(reference)
        report = QuantReport(scheme=SCHEMES[method], method=method)
        print(f"quantizing: {method} ...", flush=True)
        stats, outcome = timed_method(method, model, specs[method], tokens, report, args.search_samples)
        modules = dict(model.named_modules())
        weights = {}
        for name in names:
            w = modules[name].weight.detach().float()
            if method == "awq":
                w = w / outcome.input_scales.get(name, torch.ones(1))
                w = w * outcome.output_scales.get(name, torch.ones(1)).unsqueeze(-1)
            weights[name] = w
        effective[method] = weights
        stats["kl"] = mean_kl(model, references)
        if method == "awq":
            stats["alpha"] = {k: v for k, v in outcome.ratios.items()}
        results["methods"][method] = stats
        del model
    gptq.gptq_quantize_weight, gptq.HessianAccumulator.add_batch = solve, add_batch

    errors = layer_errors(reference, names, effective, held_out)
    blocks = len(reference.model.layers)
    summary = {}
    for method, baseline in BASELINE.items():
        wins = [n for n in names if errors[n][method] < errors[n][baseline]]
        ratio = [errors[n][method] / max(errors[n][baseline], 1e-30) for n in names]
        kl, kl_base = results["methods"][method]["kl"], results["methods"][baseline]["kl"]
        summary[method] = {
            "baseline": baseline, "layers": len(names), "layers_beating_rtn": len(wins),
            "share_beating_rtn": round(len(wins) / len(names), 4),
            "median_error_ratio_vs_rtn": round(float(torch.tensor(ratio).median()), 4),
            "layers_not_beating_rtn": [n for n in names if n not in wins],
            "kl_ratio_vs_rtn": {k: round(kl[k] / kl_base[k], 4) for k in texts},
            "seconds": results["methods"][method]["seconds"],
            "seconds_per_block": round(results["methods"][method]["seconds"] / blocks, 2),
        }
    results.update({
        "model": "smollm2_135m", "blocks": blocks, "calibration": {"samples": args.samples, "seq_len": args.seq_len,
                                                                    "hash": context.calibration_hash},
        "held_out_windows": args.held_out, "awq_search_samples": args.search_samples,
        "summary": summary, "per_layer_errors": errors,
        "estimate_llama31_8b_gpu": gptq_estimate(summary["gptq"]["seconds_per_block"], timings["solve"] / blocks,
                                                 timings["hessian"] / blocks),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "load_average_at_end": os.getloadavg(),
                    "max_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)},
    })
    return results


def print_table(results: dict) -> None:
    print("\n| method | wall (s) | CPU (s) | peak RSS (GB) | KL math | KL held-out prose | layers beating RTN | KL / RTN |")
    print("|---|---|---|---|---|---|---|---|")
    for method, stats in results["methods"].items():
        share = results["summary"].get(method, {})
        beat = f"{share['layers_beating_rtn']}/{share['layers']} vs {share['baseline']}" if share else "-"
        ratio = ", ".join(f"{v:.2f}" for v in share["kl_ratio_vs_rtn"].values()) if share else "-"
        print(f"| {method} | {stats['seconds']} | {stats['cpu_seconds']} | {stats['peak_rss_gb']} | {stats['kl']['math']:.5f} | "
              f"{stats['kl']['held_out_prose']:.5f} | {beat} | {ratio} |")
    estimate = results["estimate_llama31_8b_gpu"]
    print(f"\nESTIMATE (not measured), Llama-3.1-8B on one GPU: GPTQ ~{estimate['gptq_minutes_total']} min, "
          f"AWQ ~{estimate['awq_minutes_total']} min; load average at end {results['machine']['load_average_at_end']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--held-out", type=int, default=8, help="held-out windows for the per-layer errors")
    parser.add_argument("--search-samples", type=int, default=awq.DEFAULT_SEARCH_SAMPLES)
    parser.add_argument("--blocks", type=int, default=0, help="keep only the first N blocks (quick trial)")
    parser.add_argument("--cache-dir", default=os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness"))
    parser.add_argument("--out", type=Path, default=REPO_DIR / "benchmarks" / "results" / "gptq_awq.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("transformers").setLevel(logging.WARNING)
    args.cache_dir = os.path.expanduser(args.cache_dir)
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print_table(results)
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
