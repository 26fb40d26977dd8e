"""Where GPTQ's and AWQ's time goes on SmolLM2-135M: cProfile of a reduced run.

    .venv/bin/python benchmarks/profile_gptq_awq.py [--samples 16] [--blocks 4] [--method gptq]

Loads SmolLM2-135M, keeps the first ``--blocks`` decoder blocks, draws ``--samples`` × 512
offline calibration tokens and runs the method under cProfile; prints wall and CPU time and
the functions with the largest cumulative time (torch ops show up by their Python name).
"""
from __future__ import annotations

import argparse
import cProfile
import copy
import os
import pstats
import resource
import time

import torch
from omegaconf import OmegaConf

from harness.models import loading as models
from harness.infra.cache import Cache
from harness.config import CalibrationConfig, compose, load_model_config
from harness.quant import awq, gptq
from harness.quant import QuantReport, method_settings, with_model_defaults
from harness.quant.calibration import CalibrationContext

SCHEMES = {"gptq": "gptq_w4g128", "awq": "awq_w4g128"}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--method", choices=sorted(SCHEMES), action="append")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--cache-dir", default=os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness"))
    args = parser.parse_args()
    model_cfg = load_model_config("smollm2_135m")
    loaded = models.load(model_cfg, os.path.expanduser(args.cache_dir))
    reference = loaded.model
    if args.blocks:
        reference.model.layers = reference.model.layers[:args.blocks]
        reference.config.num_hidden_layers = args.blocks
    calibration = CalibrationConfig(num_samples=args.samples, seq_len=args.seq_len)
    for method in args.method or ["gptq", "awq"]:
        spec = with_model_defaults(OmegaConf.to_object(compose([f"quant={SCHEMES[method]}"]).quant),
                                   model_cfg.ragged_groups)
        context = CalibrationContext(model_key=loaded.key, tokenizer=loaded.tokenizer, config=calibration,
                                     device=torch.device("cpu"), cache=Cache(os.path.expanduser(args.cache_dir)),
                                     scheme=spec)
        tokens = context.tokens()
        model = copy.deepcopy(reference)
        report = QuantReport(scheme=SCHEMES[method], method=method)
        profiler = cProfile.Profile()
        start, cpu = time.perf_counter(), cpu_seconds()
        profiler.enable()
        if method == "gptq":
            gptq.quantize_gptq(model, spec, tokens, "cpu", report, batch_size=8)
        else:
            awq.quantize_awq(model, spec, tokens, "cpu", report, batch_size=8,
                             search_samples=method_settings(spec).search_samples)
        profiler.disable()
        print(f"\n== {method}: {args.samples} x {args.seq_len} tokens, {len(reference.model.layers)} blocks, "
              f"torch threads {torch.get_num_threads()}: wall {time.perf_counter() - start:.1f} s, "
              f"CPU {cpu_seconds() - cpu:.1f} s, load {os.getloadavg()}")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
