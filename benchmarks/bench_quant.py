"""Quantization cost on SmolLM2-135M: time to quantize, forward-pass overhead, memory, and KL per scheme.

    .venv/bin/python benchmarks/bench_quant.py [--repeats 7] [--batch 4 --seq 128] [--out benchmarks/results/quant.json]

1. Quantize time: each scheme applied to a fresh copy of the loaded model (``harness.quant.apply``,
   calibration included for SmoothQuant), with the process's peak RSS sampled meanwhile.
2. Forward time: the unquantized model and one weight-only, W8A8 and W4A4 model per format run the
   same input in ONE process, interleaved (ref, A, B, ..., ref, A, B, ...) after a warm-up pass;
   the median per model is divided by the reference's median. Simulated quantization stores the
   weights in float32 (already on the grid), so a weight-only model runs exactly the reference's
   matmuls; W8A8/W4A4 add the per-call input quantization.
3. Memory: parameter bytes of the simulated model (unchanged + scale buffers) and of the deployed
   format (bits per weight incl. scales), the peak RSS while quantizing.
4. KL(ref‖quant) on the math slice's divergence texts, to set the cost beside the damage.

Writes ``benchmarks/results/quant.json`` and prints a Markdown table for the README.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import quant
from harness.divergence import scoring as divergence
from harness.models import loading as models  # noqa: E402
from harness.infra.cache import Cache  # noqa: E402
from harness.config import compose  # noqa: E402
from harness.quant.calibration import CalibrationContext  # noqa: E402
from harness.planning.sensitivity import reference_texts  # noqa: E402

QUANTIZE = ["int8", "int4", "int4_g128", "fp8_w8a16", "fp8", "fp8_block", "nvfp4", "mxfp4", "mxfp8",
            "int8_w8a8", "int8_w8a8_sq"]
FORWARD = ["int4_g128", "fp8_w8a16", "fp8", "int8_w8a8", "int8_w8a8_sq", "mxfp8", "nvfp4", "mxfp4"]
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * PAGE
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS:
    """Samples the resident set size every few milliseconds while the block runs."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self.start = interval, 0, 0
        self._stop = threading.Event()

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def scheme(name: str):
    cfg = OmegaConf.to_object(compose(["model=smollm2_135m", f"quant={name}", "slices=[math]"]))
    return quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups)


def kind_of(spec) -> str:
    """weight-only, W8A8 or W4A4, from the activation spec."""
    if spec.activations is None:
        return "weight-only"
    four = spec.activations.format in ("nvfp4", "mxfp4") or (spec.activations.format == "int"
                                                               and spec.activations.bits <= 4)
    return "W4A4" if four else "W8A8"


def module_bytes(model: torch.nn.Module) -> int:
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


@torch.no_grad()
def kl_against(model: torch.nn.Module, reference: list[divergence.ReferenceText]) -> dict[str, float]:
    frame = divergence.compare_to_reference(model, reference, "math")
    return {"kl_mean": float(frame["kl"].mean()), "top1_agree": float((frame["top1_ref"] == frame["top1_quant"]).mean())}


@torch.no_grad()
def time_forwards(named: dict[str, torch.nn.Module], ids: torch.Tensor,
                  repeats: int) -> dict[str, dict[str, list[float]]]:
    """Wall and CPU seconds per forward, models interleaved. CPU time (all of this process's threads)
    is what to compare on a shared machine: it does not count the time other processes hold the cores."""
    times = {name: {"wall": [], "cpu": []} for name in named}
    for model in named.values():
        model(ids, use_cache=False)  # warm-up
    for _ in range(repeats):
        for name, model in named.items():
            wall, cpu = time.perf_counter(), time.process_time()
            model(ids, use_cache=False)
            times[name]["cpu"].append(time.process_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - wall)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--texts", type=int, default=16, help="math divergence texts for the KL column")
    parser.add_argument("--schemes", default=",".join(QUANTIZE))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "quant.json")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = OmegaConf.to_object(compose(["model=smollm2_135m", "slices=[math]"]))
    start = time.perf_counter()
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    load_s = time.perf_counter() - start
    reference_model = loaded.model
    reference = reference_texts(loaded, cfg, args.texts)
    calibration = Cache(cfg.paths.cache_dir)
    ids = loaded.tokenizer("\n\n".join(t for t in [divergence.__doc__ or "", quant.__doc__ or ""] * 20),
                           return_tensors="pt")["input_ids"][0]
    ids = ids[: args.batch * args.seq].reshape(args.batch, args.seq)

    results: dict[str, dict] = {}
    kept_models: dict[str, torch.nn.Module] = {"reference": reference_model}
    base_bytes = module_bytes(reference_model)
    for name in args.schemes.split(","):
        spec = scheme(name)
        model = copy.deepcopy(reference_model)
        context = CalibrationContext(model_key=loaded.key, tokenizer=loaded.tokenizer, config=spec.calibration,
                                     device=torch.device(cfg.model.device), cache=calibration, scheme=spec)
        if spec.method == "smoothquant" or (spec.activations is not None and not spec.activations.dynamic):
            context.tokens()  # tokenizing the calibration corpus is data loading, not quantization
        with PeakRSS() as rss:
            t0, c0 = time.perf_counter(), time.process_time()
            report = quant.apply(model, spec, context)
            seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        summary = report.summary()
        row = {"method": spec.method, "kind": kind_of(spec), "quantize_s": seconds, "quantize_cpu_s": cpu_seconds,
               "layers": len(report.layers), "bits_per_weight": summary["bits_per_weight"],
               "weight_gb_deployed": summary["weight_gb"], "weight_gb_bf16": report.total_params * 2 / 1e9,
               "param_bytes_before": base_bytes, "param_bytes_after": module_bytes(model),
               "rss_quantize_peak_delta_mb": (rss.peak - rss.start) / 2**20, "sqnr_db_mean": summary["sqnr_db_mean"]}
        try:
            row.update(kl_against(model, reference))
        except Exception as exc:  # a scheme that cannot run on this model is reported, not hidden
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        results[name] = row
        print(f"{name}: quantized in {seconds:.2f}s, KL {row.get('kl_mean', float('nan')):.5f}", flush=True)
        if name in FORWARD and "error" not in row:
            kept_models[name] = model
        else:
            del model

    times = time_forwards(kept_models, ids, args.repeats)
    ref = {kind: statistics.median(times["reference"][kind]) for kind in ("wall", "cpu")}
    for name, values in times.items():
        if name == "reference":
            continue
        for kind in ("wall", "cpu"):
            median = statistics.median(values[kind])
            results[name][f"forward_{kind}_ms_median"] = median * 1e3
            results[name][f"forward_ratio_{kind}"] = median / ref[kind]

    out = {
        "model": cfg.model.name, "load_s": load_s, "input_shape": list(ids.shape), "repeats": args.repeats,
        "reference_forward_wall_ms_median": ref["wall"] * 1e3, "reference_forward_cpu_ms_median": ref["cpu"] * 1e3,
        "divergence_texts": len(reference), "peak_rss_mb": rss_bytes() / 2**20,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]},
        "schemes": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(markdown(out))


def markdown(out: dict) -> str:
    machine = out["machine"]
    lines = [f"SmolLM2-135M, {machine['threads']} torch thread(s) on {machine['cpus']} shared CPUs (load avg "
             f"{machine['loadavg_1m']:.1f}); forward {out['input_shape'][0]}x{out['input_shape'][1]} tokens, median of "
             f"{out['repeats']} interleaved repeats; reference {out['reference_forward_cpu_ms_median']:.0f} ms CPU "
             f"({out['reference_forward_wall_ms_median']:.0f} ms wall). Forward × ref: CPU time (wall in brackets).", "",
             "| scheme | kind | quantize s (CPU s) | bits/weight | weights GB (bf16) | forward × ref | KL(ref‖quant) | "
             "top-1 agree | RSS peak Δ MB |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in out["schemes"].items():
        ratio = (f"{row['forward_ratio_cpu']:.2f} ({row['forward_ratio_wall']:.2f})"
                 if "forward_ratio_cpu" in row else "–")
        kl = f"{row['kl_mean']:.4f}" if "kl_mean" in row else row.get("error", "–")[:40]
        agree = f"{row['top1_agree']:.3f}" if "top1_agree" in row else "–"
        lines.append(f"| {name} | {row['kind']} | {row['quantize_s']:.2f} ({row['quantize_cpu_s']:.2f}) | "
                     f"{row['bits_per_weight']:.3f} | {row['weight_gb_deployed']:.3f} ({row['weight_gb_bf16']:.3f}) | "
                     f"{ratio} | {kl} | {agree} | {row['rss_quantize_peak_delta_mb']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
