"""GPTQ/AWQ speed before and after a change, in one run, with the results compared.

    .venv/bin/python benchmarks/bench_gptq_awq_speed.py --baseline main [--samples 32] [--blocks 0]
    .venv/bin/python benchmarks/bench_gptq_awq_speed.py --baseline none --samples 128   # timing only

Runs each method twice on SmolLM2-135M with the same calibration tokens: once with the
module as it is at git revision ``--baseline`` (loaded from ``git show``; the rest of the
harness is the working tree's) and once with the working tree's. Reports wall and CPU time
of each, the load average, and how far the results differ: the largest ``|Δw| / max|w|``
over the quantized linears and the mean KL(baseline‖new) per token on held-out windows.
``--baseline none`` runs only the working tree's modules (the full-size timing). Each run also
records its phase split: GPTQ's calibration forward / Hessians / solves, AWQ's statistics pass /
α search / clip and round (wall and CPU). Writes benchmarks/results/gptq_awq_speed.json.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
from omegaconf import OmegaConf

from harness.models import loading as models
from harness.infra.cache import Cache
from harness.config import REPO_DIR, CalibrationConfig, compose, load_model_config
from harness.quant import awq, gptq
from harness.quant import QuantReport, method_settings, target_linears, with_model_defaults
from harness.quant.calibration import CalibrationContext

SCHEMES = {"gptq": "gptq_w4g128", "awq": "awq_w4g128"}


def baseline_module(method: str, revision: str) -> ModuleType:
    """``harness/quant/<method>.py`` as of ``revision``, imported under a private name."""
    source = subprocess.run(["git", "-C", str(REPO_DIR), "show", f"{revision}:harness/quant/{method}.py"],
                            check=True, capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader(f"_baseline_{method}", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__dict__["__file__"] = f"{revision}:harness/quant/{method}.py"
    sys.modules[spec.name] = module  # dataclasses look their module up here
    # register_method refuses a second "gptq": run the old source with a no-op registry.
    from harness.quant import methods
    register = methods.register_method
    methods.register_method = lambda *a, **k: (lambda fn: fn)
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    finally:
        methods.register_method = register
    return module


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def quantize(module: ModuleType, method: str, reference: torch.nn.Module, spec, tokens) -> tuple[dict, torch.nn.Module]:
    model = copy.deepcopy(reference)
    report = QuantReport(scheme=SCHEMES[method], method=method)
    start, cpu, load = time.perf_counter(), cpu_seconds(), os.getloadavg()[0]
    phases: dict = {}
    if method == "gptq":
        module.quantize_gptq(model, spec, tokens, "cpu", report, batch_size=8)
        times = getattr(module, "LAST_TIMES", None)
        if times is not None:
            phases = {"forward": times.forward, "hessian": times.hessian, "solve": times.solve}
    else:
        outcome = module.quantize_awq(model, spec, tokens, "cpu", report, batch_size=8,
                                      search_samples=method_settings(spec).search_samples)
        phases = {f"{k}_wall": v for k, v in getattr(outcome, "seconds", {}).items()}
        phases |= {f"{k}_cpu": v for k, v in getattr(outcome, "cpu_seconds", {}).items()}
    return {"wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(cpu_seconds() - cpu, 1),
            "load_1min_before": load, "load_1min_after": os.getloadavg()[0],
            "phases_s": {k: round(v, 1) for k, v in phases.items()}}, model


@torch.no_grad()
def compare(before: torch.nn.Module, after: torch.nn.Module, names: list[str], held_out: torch.Tensor) -> dict:
    a, b = dict(before.named_modules()), dict(after.named_modules())
    rel = max(float((a[n].weight - b[n].weight).abs().max() / a[n].weight.abs().max()) for n in names)
    identical = sum(bool(torch.equal(a[n].weight, b[n].weight)) for n in names)
    kl, count = 0.0, 0
    for batch in held_out.split(4):
        p = torch.log_softmax(before(batch).logits.double(), -1)
        q = torch.log_softmax(after(batch).logits.double(), -1)
        kl += float((p.exp() * (p - q)).sum())
        count += batch.numel()
    return {"max_rel_weight_diff": rel, "identical_linears": identical, "linears": len(names),
            "mean_kl_before_after": kl / count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="main", help="git revision of the 'before' module (none: time only "
                        "the working tree's)")
    parser.add_argument("--method", choices=sorted(SCHEMES), action="append")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=0, help="keep only the first N blocks (0: all)")
    parser.add_argument("--set", action="append", default=[], metavar="OVERRIDE",
                        help="scheme override, e.g. awq:quant.settings.search_samples=4 (a <method>: prefix "
                             "applies it to that method only)")
    parser.add_argument("--cache-dir", default=os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness"))
    parser.add_argument("--out", type=Path, default=REPO_DIR / "benchmarks" / "results" / "gptq_awq_speed.json")
    args = parser.parse_args()
    cache_dir = os.path.expanduser(args.cache_dir)
    model_cfg = load_model_config("smollm2_135m")
    loaded = models.load(model_cfg, cache_dir)
    reference = loaded.model
    if args.blocks:
        reference.model.layers = reference.model.layers[:args.blocks]
        reference.config.num_hidden_layers = args.blocks
    calibration = CalibrationConfig(num_samples=args.samples, seq_len=args.seq_len)
    results: dict = {"samples": args.samples, "seq_len": args.seq_len, "blocks": len(reference.model.layers),
                     "torch_threads": torch.get_num_threads(), "baseline": args.baseline, "overrides": args.set,
                     "methods": {}}
    current = {"gptq": gptq, "awq": awq}
    for method in args.method or ["gptq", "awq"]:
        overrides = [o.removeprefix(f"{method}:") for o in args.set
                     if not o.startswith(tuple(f"{m}:" for m in SCHEMES)) or o.startswith(f"{method}:")]
        spec = with_model_defaults(OmegaConf.to_object(compose([f"quant={SCHEMES[method]}", *overrides]).quant),
                                   model_cfg.ragged_groups)
        context = CalibrationContext(model_key=loaded.key, tokenizer=loaded.tokenizer, config=calibration,
                                     device=torch.device("cpu"), cache=Cache(cache_dir), scheme=spec)
        tokens = context.tokens()
        held_out = torch.roll(tokens[:8, :256], shifts=1, dims=0) if len(tokens) > 1 else tokens[:, :256]
        names = list(target_linears(reference, spec)[0])
        if args.baseline == "none":
            after, _ = quantize(current[method], method, reference, spec, tokens)
            print(f"{method}: {after}", flush=True)
            results["methods"][method] = {"after": after}
            continue
        before, model_before = quantize(baseline_module(method, args.baseline), method, reference, spec, tokens)
        print(f"{method} before: {before}", flush=True)
        after, model_after = quantize(current[method], method, reference, spec, tokens)
        print(f"{method} after: {after}", flush=True)
        entry = {"before": before, "after": after, "wall_ratio": round(after["wall_s"] / before["wall_s"], 3),
                 "cpu_ratio": round(after["cpu_s"] / before["cpu_s"], 3)}
        entry.update(compare(model_before, model_after, names, held_out))
        results["methods"][method] = entry
        print(json.dumps({method: entry}, indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
