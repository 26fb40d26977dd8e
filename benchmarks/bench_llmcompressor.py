"""The harness against llm-compressor on SmolLM2-135M, W4A16 group 64: RTN and GPTQ side by side.

Issue 11 item 3. The same model (the harness's dequantized SmolLM2, saved as an HF checkpoint)
and the same calibration token windows go to both tools; llm-compressor runs in .venv-peer
(``bash scripts/peer_venv.sh``) through benchmarks/peer_llmcompressor_worker.py, the harness in
this process. Group 64 because SmolLM2's hidden size 576 is no multiple of 128. Printed and saved:

- wall and CPU time of each tool's quantization (the worker times ``oneshot`` alone, without its
  interpreter start and model load; the harness times ``quantize_gptq`` / RTN alone);
- RTN weight equality: each tool's dequantized weights against its own documented grid
  (harness ``amax/7``, codes -7..7; compressed-tensors ``amax/7.5``, codes -8..7) and the share of
  weights on which the two tools differ;
- per-layer output error ``Σ|(W_q - W) x|²`` on held-out inputs (the reference model's inputs of
  every linear on calibration-corpus windows disjoint from the calibration windows), relative to
  the layer's output energy;
- mean KL(ref‖quant) per token and top-1 agreement with the unquantized model on held-out text.

    .venv/bin/python benchmarks/bench_llmcompressor.py [--samples 128] [--seq-len 512] [--overlap] [--ablation]

``--overlap`` runs the llm-compressor worker while the harness quantizes (wall times then
share the CPU; the CPU times stay comparable). ``--ablation`` adds the harness's GPTQ on
compressed-tensors' grid (``harness_gptq_ctgrid``), separating the grid from the algorithm.
Writes benchmarks/results/llmcompressor.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gptq_awq import held_out_windows, layer_errors  # noqa: E402  (sibling benchmark's helpers)

from harness.divergence import scoring as divergence
from harness.models import loading as models  # noqa: E402
from harness.infra.cache import Cache  # noqa: E402
from harness.config import REPO_DIR, CalibrationConfig, compose, load_model_config  # noqa: E402
from harness.quant import gptq  # noqa: E402
from harness.quant import QuantReport, method_settings, target_linears, with_model_defaults  # noqa: E402
from harness.quant.calibration import CalibrationContext  # noqa: E402
from harness.quant.rtn import quantize_weights_rtn  # noqa: E402

PEER_PYTHON = Path(os.environ.get("HARNESS_PEER_VENV", REPO_DIR / ".venv-peer")) / "bin" / "python"
WORKER = Path(__file__).resolve().parent / "peer_llmcompressor_worker.py"
GROUP = 64


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def symmetric_grid(w: torch.Tensor, group: int, divisor: float, qmin: int, qmax: int) -> torch.Tensor:
    """Group RTN from its formula: s = amax / divisor per group, w_q = clamp(round(w / s), qmin, qmax) · s."""
    g = w.float().reshape(w.shape[0], -1, group)
    scale = g.abs().amax(dim=-1, keepdim=True) / divisor
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.clamp(torch.round(g / scale), qmin, qmax) * scale).reshape(w.shape)


def scheme(name: str, overrides: list[str], ragged: bool) -> Any:
    return with_model_defaults(OmegaConf.to_object(compose([f"quant={name}", *overrides]).quant), ragged)


def start_peer(model_dir: Path, method: str, out: Path, tokens: Path | None,
               args: argparse.Namespace) -> subprocess.Popen:
    command = [str(PEER_PYTHON), str(WORKER), "--model", str(model_dir), "--method", method, "--group-size",
               str(GROUP), "--out", str(out), "--threads", str(args.threads), "--damp", "0.01", "--block-size", "128"]
    if tokens is not None:
        command += ["--tokens", str(tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    log = open(f"{out}.log", "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def finish_peer(process: subprocess.Popen, out: Path) -> dict:
    from safetensors.torch import load_file

    if process.wait() != 0:
        tail = Path(f"{out}.log").read_text()[-3000:]
        raise SystemExit(f"llm-compressor worker failed (log {out}.log):\n{tail}")
    info = json.loads(Path(f"{out}.json").read_text())
    return {"info": info, "weights": load_file(f"{out}.weights.safetensors")}


def timed(fn: Any) -> tuple[dict, Any]:
    start, cpu = time.perf_counter(), _cpu_seconds()
    outcome = fn()
    return {"seconds": round(time.perf_counter() - start, 1), "cpu_seconds": round(_cpu_seconds() - cpu, 1)}, outcome


def with_weights(reference: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = copy.deepcopy(reference)
    for name, w in weights.items():
        model.get_submodule(name).weight.data.copy_(w)
    return model


def agreement(model: torch.nn.Module, refs: list) -> dict[str, float]:
    frame = divergence.compare_to_reference(model, refs, "held_out")
    top1 = float((frame["top1_ref"] == frame["top1_quant"]).mean())
    return {"kl_mean": float(frame["kl"].mean()), "top1_agreement": top1,
            "tokens": int(len(frame))}


def run(args: argparse.Namespace, work: Path) -> dict:
    if not PEER_PYTHON.exists():
        raise SystemExit(f"{PEER_PYTHON} missing: create the peer venv with `bash scripts/peer_venv.sh`")
    torch.set_num_threads(args.threads)
    model_cfg = load_model_config("smollm2_135m")
    loaded = models.load(model_cfg, args.cache_dir)
    reference = loaded.model
    model_dir = work / "smollm2"
    reference.save_pretrained(model_dir)
    loaded.tokenizer.save_pretrained(model_dir)
    rtn_spec = scheme("int4_g64", [], model_cfg.ragged_groups)
    gptq_spec = scheme("gptq_w4g128", [f"quant.weights.group_size={GROUP}", "quant.name=gptq_w4g64"],
                       model_cfg.ragged_groups)
    calibration = CalibrationConfig(num_samples=args.samples, seq_len=args.seq_len)
    context = CalibrationContext(model_key=loaded.key, tokenizer=loaded.tokenizer, config=calibration,
                                 device=torch.device("cpu"), cache=Cache(args.cache_dir), scheme=gptq_spec)
    tokens = context.tokens()
    from safetensors.torch import save_file
    save_file({"input_ids": tokens.contiguous()}, str(work / "tokens.safetensors"))
    held_out = held_out_windows(loaded.tokenizer, calibration, tokens, args.held_out)
    refs = divergence.score_reference(reference, loaded.tokenizer, [loaded.tokenizer.decode(w) for w in held_out],
                                      max_tokens=args.seq_len)
    names = list(target_linears(reference, gptq_spec)[0])
    results: dict[str, Any] = {"tools": {}}

    print("llm-compressor RTN ...", flush=True)
    peer_rtn = finish_peer(start_peer(model_dir, "rtn", work / "peer_rtn", None, args), work / "peer_rtn")
    peer_gptq_proc = start_peer(model_dir, "gptq", work / "peer_gptq", work / "tokens.safetensors", args)
    if not args.overlap:
        print("llm-compressor GPTQ ...", flush=True)
        peer_gptq = finish_peer(peer_gptq_proc, work / "peer_gptq")
    print("harness RTN ...", flush=True)
    model = copy.deepcopy(reference)
    stats, _ = timed(lambda: quantize_weights_rtn(model, rtn_spec, QuantReport(scheme="int4_g64", method="rtn")))
    ours = {"rtn": ({n: model.get_submodule(n).weight.detach().clone() for n in names}, stats)}
    print("harness GPTQ ...", flush=True)
    model = copy.deepcopy(reference)
    report = QuantReport(scheme="gptq_w4g64", method="gptq")
    stats, _ = timed(lambda: gptq.quantize_gptq(model, gptq_spec, tokens, "cpu", report, batch_size=8))
    ours["gptq"] = ({n: model.get_submodule(n).weight.detach().clone() for n in names}, stats)
    if args.ablation:
        print("harness GPTQ on compressed-tensors' grid (ablation) ...", flush=True)
        model = copy.deepcopy(reference)
        ct_spec = scheme("gptq_w4g128", [f"quant.weights.group_size={GROUP}", "quant.weights.int_range=full",
                                         "quant.name=gptq_w4g64_ctgrid"], model_cfg.ragged_groups)
        stats, _ = timed(lambda: gptq.quantize_gptq(model, ct_spec, tokens, "cpu",
                                                    QuantReport(scheme="gptq_w4g64_ctgrid", method="gptq"),
                                                    batch_size=8))
        ours["gptq_ctgrid"] = ({n: model.get_submodule(n).weight.detach().clone() for n in names}, stats)
    del model
    if args.overlap:
        print("waiting for llm-compressor GPTQ ...", flush=True)
        peer_gptq = finish_peer(peer_gptq_proc, work / "peer_gptq")
    peers = {"rtn": peer_rtn, "gptq": peer_gptq}
    if args.ablation:
        peers["gptq_ctgrid"] = None  # the ablation has no llm-compressor counterpart
    if set(peer_rtn["weights"]) != set(names):
        raise SystemExit(f"the tools quantized different layers: {sorted(set(peer_rtn['weights']) ^ set(names))}")

    # RTN equality, each tool against its documented grid.
    mismatch_peer = mismatch_ours = differ = total = 0
    for name in names:
        w = reference.get_submodule(name).weight.detach().float()
        mismatch_peer += int((peer_rtn["weights"][name] != symmetric_grid(w, GROUP, 7.5, -8, 7)).sum())
        mismatch_ours += int((ours["rtn"][0][name].float() != symmetric_grid(w, GROUP, 7.0, -7, 7)).sum())
        differ += int((peer_rtn["weights"][name] != ours["rtn"][0][name].float()).sum())
        total += w.numel()
    results["rtn_equality"] = {"weights": total, "llmcompressor_off_its_formula": mismatch_peer,
                               "harness_off_its_formula": mismatch_ours,
                               "share_differing_between_tools": differ / total}

    effective = {}
    for method in [m for m in ("rtn", "gptq", "gptq_ctgrid") if m in ours]:
        pairs = [("harness", ours[method][0])]
        if peers[method]:
            pairs.append(("llmcompressor", peers[method]["weights"]))
        for tool, weights in pairs:
            key = f"{tool}_{method}"
            effective[key] = {n: weights[n].float() for n in names}
            quantized = with_weights(reference, effective[key])
            print(f"scoring {key} ...", flush=True)
            timing = (ours[method][1] if tool == "harness" else
                      {k: peers[method]["info"][k] for k in ("seconds", "cpu_seconds")})
            results["tools"][key] = {**timing, **agreement(quantized, refs)}
            del quantized
    print("per-layer errors ...", flush=True)
    errors = layer_errors(reference, names, effective, held_out)
    relative = {n: {k: v / max(errors[n]["energy"], 1e-30) for k, v in errors[n].items() if k != "energy"}
                for n in names}
    for key in effective:
        values = torch.tensor([relative[n][key] for n in names])
        results["tools"][key].update(layer_rel_error_median=float(values.median()),
                                     layer_rel_error_mean=float(values.mean()))
    wins = sum(relative[n]["harness_gptq"] < relative[n]["llmcompressor_gptq"] for n in names)
    if args.ablation:
        results["gptq_ctgrid_layers_where_harness_error_is_lower"] = sum(
            relative[n]["harness_gptq_ctgrid"] < relative[n]["llmcompressor_gptq"] for n in names)
    results.update({
        "model": "smollm2_135m", "group_size": GROUP, "layers": len(names),
        "gptq_layers_where_harness_error_is_lower": wins,
        "calibration": {"samples": args.samples, "seq_len": args.seq_len, "hash": context.calibration_hash},
        "held_out": {"windows": args.held_out, "seq_len": args.seq_len}, "overlap": args.overlap,
        "ablation_gptq_ctgrid": "harness GPTQ with quant.weights.int_range=full (compressed-tensors' grid)" if args.ablation else None,
        "peer": {k: peer_gptq["info"].get(k) for k in ("versions", "observers", "damp", "block_size", "actorder",
                                                        "batch_size", "weights_stored_dequantized")},
        "harness_gptq": {"damp_percent": method_settings(gptq_spec).damp_percent,
                         "block_size": method_settings(gptq_spec).block_size,
                         "act_order": method_settings(gptq_spec).act_order, "batch_size": 8},
        "per_layer_relative_error": relative,
        "machine": {"cpus": os.cpu_count(), "torch_threads": args.threads, "load_average_at_end": os.getloadavg()},
    })
    return results


def print_table(results: dict) -> None:
    print("\n| tool / method | wall (s) | CPU (s) | mean KL | top-1 agreement | layer rel. error (median) |")
    print("|---|---|---|---|---|---|")
    for key, s in results["tools"].items():
        print(f"| {key} | {s['seconds']} | {s['cpu_seconds']} | {s['kl_mean']:.5f} | {s['top1_agreement']:.4f} | "
              f"{s['layer_rel_error_median']:.3e} |")
    eq = results["rtn_equality"]
    print(f"\nRTN: llm-compressor off its formula on {eq['llmcompressor_off_its_formula']} of {eq['weights']} weights, "
          f"harness off its own on {eq['harness_off_its_formula']}; the tools differ on "
          f"{eq['share_differing_between_tools']:.1%} of weights (amax/7.5, -8..7 vs amax/7, -7..7)")
    print(f"GPTQ: harness's layer error lower on {results['gptq_layers_where_harness_error_is_lower']}/"
          f"{results['layers']} layers; calibration {results['calibration']['samples']} x "
          f"{results['calibration']['seq_len']}; load average at end {results['machine']['load_average_at_end']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=128, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    parser.add_argument("--held-out", type=int, default=8, help="held-out windows for KL, top-1 and layer errors")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for each tool")
    parser.add_argument("--overlap", action="store_true", help="run llm-compressor's GPTQ while the harness's runs")
    parser.add_argument("--ablation", action="store_true",
                        help="also run the harness's GPTQ on compressed-tensors' grid (amax/7.5, codes -8..7)")
    parser.add_argument("--cache-dir", default=os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness"))
    parser.add_argument("--out", type=Path, default=REPO_DIR / "benchmarks" / "results" / "llmcompressor.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("transformers").setLevel(logging.WARNING)
    args.cache_dir = os.path.expanduser(args.cache_dir)
    with tempfile.TemporaryDirectory(prefix="peer-llmc-") as work:
        results = run(args, Path(work))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print_table(results)
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
