"""AWQ's search settings against quality: time and KL for several (grid, search_samples) pairs.

    .venv/bin/python benchmarks/bench_awq_search.py --samples 32 --settings 20:8,20:8c,20:8:8,20:4c,20:4

AWQ's cost beyond its one full-precision statistics pass is the α search, ``grid`` ×
(foldable groups per block) × one run of each group's inspected module on
``search_samples`` × ``seq_len`` tokens, and the clip search on tokens sampled from the same
search sequences. This runs AWQ (``awq_w4g128``) on SmolLM2-135M once per setting with the
same calibration tokens (once with the search on other sequences, as a noise yardstick; a
``c`` suffix searches coarse to fine), plus round-to-nearest on the same grid as the
no-search floor, and reports for each: wall and CPU seconds with the phase split
(statistics / search / clip and round), the load average, the mean KL(ref‖quant) per token on held-out windows of the
calibration corpus (disjoint from the calibration windows), its paired difference from the
first setting with a standard error over windows, and how many α choices agree with it.
Writes benchmarks/results/awq_search.json.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import resource
import time
from pathlib import Path

import numpy as np
import torch

from harness.divergence import scoring as divergence
from harness.models import loading as models
from harness.config import REPO_DIR, CalibrationConfig, load_model_config
from harness.quant import awq
from harness.quant import QuantReport, target_linears
from harness.quant.calibration import calibration_tokens
from harness.quant.format_table import fake_quantize


def _bench_gptq_awq():
    """benchmarks/bench_gptq_awq.py (not a package): its held-out windows and scheme loader."""
    spec = importlib.util.spec_from_file_location("_bench_gptq_awq", REPO_DIR / "benchmarks" / "bench_gptq_awq.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def per_window_kl(model: torch.nn.Module, references: list) -> np.ndarray:
    frame = divergence.compare_to_reference(model, references, "held_out")
    return frame.groupby("text")["kl"].mean().to_numpy()


def _unimodal(losses: list[float]) -> bool:
    """Strictly falls to its minimum and strictly rises after it."""
    best = losses.index(min(losses))
    return (all(a > b for a, b in zip(losses[:best], losses[1:best + 1]))
            and all(a < b for a, b in zip(losses[best:], losses[best + 1:])))


def _full_choice(losses: list[float]) -> int:
    return losses.index(min(losses))


def _coarse_choice(losses: list[float]) -> int:
    steps = awq.coarse_to_fine_steps(len(losses), lambda step: losses[step])
    return min(steps, key=lambda step: (losses[step], step))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=32, help="calibration sequences (statistics)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--settings", default="20:8,20:8:8,20:4,20:2,10:8",
                        help="grid:search_samples[:offset][c], first = base; an offset rolls the calibration sequences "
                             "so the search uses others (same statistics): a noise yardstick; c: coarse-to-fine")
    parser.add_argument("--held-out", type=int, default=16, help="held-out windows for KL")
    parser.add_argument("--kl-tokens", type=int, default=256, help="tokens scored per held-out window")
    parser.add_argument("--blocks", type=int, default=0, help="keep only the first N blocks (0: all)")
    parser.add_argument("--cache-dir", default=os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness"))
    parser.add_argument("--out", type=Path, default=REPO_DIR / "benchmarks" / "results" / "awq_search.json")
    args = parser.parse_args()
    helpers = _bench_gptq_awq()
    model_cfg = load_model_config("smollm2_135m")
    loaded = models.load(model_cfg, os.path.expanduser(args.cache_dir))
    reference = loaded.model
    if args.blocks:
        reference.model.layers = reference.model.layers[:args.blocks]
        reference.config.num_hidden_layers = args.blocks
    calibration = CalibrationConfig(num_samples=args.samples, seq_len=args.seq_len)
    tokens = calibration_tokens(loaded.tokenizer, calibration)
    held_out = helpers.held_out_windows(loaded.tokenizer, calibration, tokens, args.held_out)
    references = divergence.score_reference(reference, loaded.tokenizer,
                                            [loaded.tokenizer.decode(w) for w in held_out], max_tokens=args.kl_tokens)
    base_spec = helpers.scheme("awq_w4g128", model_cfg.ragged_groups)
    names = list(target_linears(reference, base_spec)[0])
    results: dict = {"samples": args.samples, "seq_len": args.seq_len, "blocks": len(reference.model.layers),
                     "torch_threads": torch.get_num_threads(), "held_out_windows": len(held_out),
                     "kl_tokens_per_window": args.kl_tokens, "settings": []}

    rtn = copy.deepcopy(reference)
    modules = dict(rtn.named_modules())
    with torch.no_grad():
        for name in names:
            modules[name].weight.data = fake_quantize(modules[name].weight.data, base_spec.weights)
    rtn_kl = per_window_kl(rtn, references)
    results["rtn_kl"] = float(rtn_kl.mean())
    print(f"RTN (same grid): KL {rtn_kl.mean():.5f}", flush=True)
    del rtn

    base_kl, base_ratios = None, None
    for text in args.settings.split(","):
        coarse_to_fine = text.endswith("c")
        grid, search_samples, offset = (int(v) for v in (text.rstrip("c") + ":0").split(":")[:3])
        spec = copy.deepcopy(base_spec)
        spec.settings.update(grid=grid, search_samples=search_samples, coarse_to_fine=coarse_to_fine)
        model = copy.deepcopy(reference)
        report = QuantReport(scheme="awq_w4g128", method="awq")
        load = os.getloadavg()[0]
        start, cpu = time.perf_counter(), cpu_seconds()
        outcome = awq.quantize_awq(model, spec, torch.roll(tokens, -offset, dims=0), "cpu", report, batch_size=8,
                                   search_samples=search_samples)
        entry = {"grid": grid, "search_samples": search_samples, "search_offset": offset,
                 "coarse_to_fine": coarse_to_fine, "wall_s": round(time.perf_counter() - start, 1),
                 "cpu_s": round(cpu_seconds() - cpu, 1), "load_1min_before": round(load, 2),
                 "load_1min_after": round(os.getloadavg()[0], 2),
                 "phase_wall_s": {k: round(v, 1) for k, v in outcome.seconds.items()},
                 "phase_cpu_s": {k: round(v, 1) for k, v in outcome.cpu_seconds.items()}}
        kl = per_window_kl(model, references)
        entry["kl"] = float(kl.mean())
        entry["kl_over_rtn"] = float(kl.mean() / rtn_kl.mean())
        # A loss curve with one local minimum over the grid: a coarse-to-fine search would find the same α.
        if not coarse_to_fine:
            curves = list(outcome.losses.values())
            entry["unimodal_loss_curves"] = f"{sum(_unimodal(v) for v in curves)}/{len(curves)}"
            # Replayed on the recorded full-grid losses: the α a coarse-to-fine search would have chosen.
            agree = sum(_coarse_choice(v) == _full_choice(v) for v in curves)
            entry["coarse_to_fine_would_agree"] = f"{agree}/{len(curves)}"
        if base_kl is None:
            base_kl, base_ratios = kl, outcome.ratios
        else:
            diff = kl - base_kl
            entry["kl_minus_base"] = float(diff.mean())
            entry["kl_minus_base_se"] = float(diff.std(ddof=1) / np.sqrt(len(diff)))
            entry["alpha_agree"] = f"{sum(outcome.ratios[k] == v for k, v in base_ratios.items())}/{len(base_ratios)}"
        results["settings"].append(entry)
        print(json.dumps(entry), flush=True)
        del model
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
