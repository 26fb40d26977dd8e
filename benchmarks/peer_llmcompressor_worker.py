"""The llm-compressor side of the peer tier: runs in .venv-peer and never imports the harness.

llm-compressor 0.14 pins compressed-tensors==0.19.0 and transformers<=5.17, the harness needs
compressed-tensors>=0.20, so the two sides live in two venvs (see scripts/peer_venv.sh) and
exchange files only: the harness saves the model as an HF checkpoint (and the calibration
token ids as safetensors); this worker quantizes it with llm-compressor and writes, per
quantized linear, the dequantized weight and its scale as safetensors, plus a JSON of
timings and versions.

    .venv-peer/bin/python benchmarks/peer_llmcompressor_worker.py --model DIR --method rtn \
        --group-size 64 --out OUT_PREFIX [--tokens FILE --damp 0.01 --block-size 128]

The scheme is compressed-tensors' W4A16 preset (symmetric int4, one scale per group) with
the given group size, every Linear but lm_head, as llm-compressor's examples quantize.
Dequantized weights come from compressed-tensors' own ``fake_quantize`` with the module's
stored ``weight_scale`` / ``weight_zero_point`` — what a compressed-tensors checkpoint of this
model decompresses to.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _scheme(group_size: int):
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights.group_size = group_size
    return scheme


def _recipe(method: str, group_size: int, damp: float, block_size: int):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    groups = {"group_0": _scheme(group_size)}
    if method == "rtn":
        return QuantizationModifier(config_groups=groups, ignore=["lm_head"])
    # actorder=None: columns in their natural order, as the harness's gptq_w4g128 (act_order: false).
    return GPTQModifier(config_groups=groups, ignore=["lm_head"], dampening_frac=damp, block_size=block_size,
                        actorder=None)


def _dataset(tokens_path: Path):
    from datasets import Dataset
    from safetensors.torch import load_file

    ids = load_file(str(tokens_path))["input_ids"]
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * ids.shape[1]] * ids.shape[0]}), ids


def run(args: argparse.Namespace) -> dict:
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from llmcompressor import oneshot
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    kwargs: dict = {}
    if args.method == "gptq":
        if args.tokens is None:
            raise SystemExit("--method gptq needs --tokens FILE (calibration input_ids as safetensors)")
        dataset, ids = _dataset(args.tokens)
        kwargs = dict(dataset=dataset, num_calibration_samples=int(ids.shape[0]), max_seq_length=int(ids.shape[1]),
                      batch_size=args.batch_size, shuffle_calibration_samples=False)
    recipe = _recipe(args.method, args.group_size, args.damp, args.block_size)
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    oneshot(model=model, recipe=recipe, **kwargs)
    seconds, cpu_seconds = time.perf_counter() - start, _cpu_seconds() - cpu_start

    weights, scales, observers = {}, {}, set()
    already_dequantized = True
    with torch.no_grad():
        for name, module in model.named_modules():
            if not hasattr(module, "weight_scale"):
                continue
            qargs = module.quantization_scheme.weights
            observers.add(str(qargs.observer))
            deq = fake_quantize(module.weight, module.weight_scale, module.weight_zero_point, qargs)
            already_dequantized &= bool(torch.equal(deq, module.weight))
            weights[name] = deq.detach().float().contiguous()
            scales[name] = module.weight_scale.detach().float().contiguous()
    if not weights:
        raise SystemExit("llm-compressor quantized no module (no weight_scale found)")
    save_file(weights, f"{args.out}.weights.safetensors")
    save_file(scales, f"{args.out}.scales.safetensors")
    from importlib.metadata import version

    info = {
        "method": args.method, "group_size": args.group_size, "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu_seconds, 2), "threads": args.threads, "layers": len(weights),
        "observers": sorted(observers), "weights_stored_dequantized": already_dequantized,
        "scheme": _scheme(args.group_size).weights.model_dump(mode="json"),
        "versions": {p: version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch")},
        "load_average_at_end": os.getloadavg(),
    }
    if args.method == "gptq":
        info.update(damp=args.damp, block_size=args.block_size, actorder=None, samples=int(ids.shape[0]),
                    seq_len=int(ids.shape[1]), batch_size=args.batch_size)
    Path(f"{args.out}.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="HF checkpoint directory (saved by the harness)")
    parser.add_argument("--method", choices=("rtn", "gptq"), required=True)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.weights.safetensors, .scales..., .json")
    parser.add_argument("--tokens", type=Path, help="calibration input_ids [samples, seq_len] (gptq)")
    parser.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening fraction of mean diag(H)")
    parser.add_argument("--block-size", type=int, default=128, help="GPTQ lazy-update block (columns)")
    parser.add_argument("--batch-size", type=int, default=8, help="calibration batch size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    if not args.model.is_dir():
        raise SystemExit(f"--model {args.model}: not a directory; pass an HF checkpoint saved with save_pretrained")
    info = run(args)
    print(json.dumps({k: info[k] for k in ("method", "seconds", "cpu_seconds", "layers", "observers")}))


if __name__ == "__main__":
    sys.exit(main())
