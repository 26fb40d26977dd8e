"""``python -m harness.export model=... quant=... out=DIR`` — ship what was evaluated.

Writes the harness's quantized model as a **compressed-tensors** checkpoint (the format
llm-compressor writes and vLLM serves), through the ``compressed-tensors`` library itself:
the library's :class:`~compressed_tensors.compressors.ModelCompressor` packs the weights and
writes ``quantization_config``; this module only says *what* grid each linear is on.

Representable schemes (anything else is refused with this list):

* integer weights, 4 or 8 bits, per output channel or per group, symmetric or asymmetric
  (``pack-quantized``): RTN, GPTQ, AWQ (its scales are already folded into the preceding norm
  or linear, which are written as ordinary weights), SmoothQuant-smoothed weights;
* FP8 E4M3 weights per tensor or per channel, with or without dynamic per-token FP8
  activations (``float-quantized``: "FP8_DYNAMIC" / W8A16 FP8).

The harness keeps dequantized weights, not codes, so the grid of each weight group is
recovered from the values (:func:`recover_int_grid`, :func:`recover_fp8_scale`): every
group's values are integer multiples of one scale (around one zero point), which is found
exactly for RTN's ``amax / qmax`` and, for GPTQ groups whose largest code is below ``qmax``,
by trying the smaller code ranges. Recovery is exact in float32; in bf16/fp16 the harness's
values are themselves rounded to the model dtype, so the exported weights match them to one
rounding step of that dtype. The export then decompresses its own output and checks it.

Sign conventions: the harness's symmetric INT grid uses codes ``-(2^(b-1)-1) .. 2^(b-1)-1``
(never ``-2^(b-1)``), a subset of compressed-tensors' signed range, so it is exact; the
asymmetric grid's unsigned codes ``0 .. 2^b-1`` with zero point ``z`` are stored as signed
codes ``q - 2^(b-1)`` with zero point ``z - 2^(b-1)``, the same values.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from harness import cli
from harness.config import QuantConfig, TensorQuantConfig

log = logging.getLogger(__name__)

REPRESENTABLE = ("int weights (4 or 8 bits; channel or group; symmetric or asymmetric), no activation "
                 "quantization: RTN, GPTQ, AWQ, SmoothQuant-smoothed",
                 "fp8_e4m3 weights (tensor or channel), optionally with fp8_e4m3 dynamic per-token activations")


class ExportError(cli.UsageError):
    """A scheme or model the compressed-tensors format cannot hold; the message lists what it can."""


def _unsupported(what: str) -> ExportError:
    return ExportError(f"cannot export {what} as compressed-tensors; representable: " + "; ".join(REPRESENTABLE))


# ------------------------------------------------------------------------------ grid recovery
def _groups(weight: Tensor, granularity: str, group_size: int | None) -> Tensor:
    """``weight`` [out, in] as [out, n_groups, group] (a ragged last group padded with zeros)."""
    w = weight.detach().to(torch.float32)
    if granularity == "channel":
        return w[:, None, :]
    if granularity == "tensor":
        return w.reshape(1, 1, -1)
    if granularity != "group" or not group_size:
        raise _unsupported(f"granularity={granularity!r}")
    out, cols = w.shape
    n_groups = math.ceil(cols / group_size)
    padded = torch.zeros(out, n_groups * group_size, dtype=w.dtype, device=w.device)
    padded[:, :cols] = w
    return padded.reshape(out, n_groups, group_size)


def _residual(values: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """Largest distance of ``values / scale - offset`` from an integer, per group."""
    q = values / scale - offset
    return (q - q.round()).abs().amax(-1, keepdim=True)


def recover_int_grid(weight: Tensor, bits: int, *, symmetric: bool, granularity: str,
                     group_size: int | None = None, tolerance: float = 1e-3) -> tuple[Tensor, Tensor]:
    """Scale and zero point (harness convention, float32, shape [out, n_groups]) of dequantized weights.

    Symmetric groups hold ``k · s`` with integer ``-qmax-1 <= k <= qmax``: ``s = amax / m`` for the
    largest code magnitude ``m``; RTN reaches ``m = qmax`` (``qmax + 1`` on the full-range grid);
    smaller ``m`` are tried for groups that reach neither. Asymmetric groups hold ``(k - z) · s`` with ``k`` in ``[0, 2^b - 1]``: ``s = (max - min) / m``
    and ``z = round(-min / s)`` for the code span ``m``. A group that fits no grid within
    ``tolerance`` (in code units) raises :class:`ExportError` naming the worst group.
    """
    groups = _groups(weight, granularity, group_size)
    qmax = 2 ** (bits - 1) - 1 if symmetric else 2 ** bits - 1
    if symmetric:
        top = groups.abs().amax(-1, keepdim=True)
        low = torch.zeros_like(top)
    else:
        low = groups.amin(-1, keepdim=True).clamp(max=0.0)
        top = groups.amax(-1, keepdim=True).clamp(min=0.0) - low
    scale = torch.where(top > 0, top / qmax, torch.ones_like(top))
    offset = torch.zeros_like(top) if symmetric else low / scale
    best = _residual(groups, scale, offset)
    # the top code first (RTN); a symmetric full-range grid (int_range=full) reaches -2^(b-1); then GPTQ's
    # groups whose largest code is smaller
    spans = ([qmax + 1] if symmetric else []) + list(range(qmax - 1, 0, -1))
    for span in spans:
        failing = best > tolerance
        if not bool(failing.any()):
            break
        trial = torch.where(top > 0, top / span, torch.ones_like(top))
        trial_offset = torch.zeros_like(top) if symmetric else low / trial
        residual = _residual(groups, trial, trial_offset)
        better = failing & (residual < best)
        scale = torch.where(better, trial, scale)
        best = torch.where(better, residual, best)
    if bool((best > tolerance).any()):
        worst = int(best.reshape(-1).argmax())
        raise ExportError(f"weights are not on a {bits}-bit {'symmetric' if symmetric else 'asymmetric'} integer "
                          f"grid (group {worst}: {float(best.max()):.3g} code units off); was the model quantized "
                          "with this scheme?")
    zero = torch.zeros_like(scale) if symmetric else torch.round(-low / scale)
    return scale[..., 0], zero[..., 0]


def recover_fp8_scale(weight: Tensor, granularity: str) -> Tensor:
    """Per-channel or per-tensor scale of FP8 E4M3 fake-quantized weights: ``amax / 448``.

    Fake quantization maps each channel's largest magnitude onto 448 exactly, so the scale it used
    is the dequantized amax over 448 (float32, shape [out, 1] or [1])."""
    if granularity not in ("channel", "tensor"):
        raise _unsupported(f"fp8 weights with granularity={granularity!r}")
    groups = _groups(weight, granularity, None)
    amax = groups.abs().amax(-1)
    scale = torch.where(amax > 0, amax / torch.finfo(torch.float8_e4m3fn).max, torch.ones_like(amax))
    return scale if granularity == "channel" else scale.reshape(1)


# ------------------------------------------------------------------------------ scheme mapping
def quantization_args(scheme: QuantConfig) -> dict[str, Any]:
    """compressed-tensors ``QuantizationScheme`` fields for ``scheme``, or :class:`ExportError`."""
    from compressed_tensors.quantization import QuantizationArgs

    weights: TensorQuantConfig | None = scheme.weights
    if weights is None:
        raise _unsupported(f"scheme {scheme.name!r} (no weight quantization)")
    if scheme.kv_cache is not None:
        raise _unsupported(f"scheme {scheme.name!r} with KV-cache quantization")
    fields: dict[str, Any] = {}
    if weights.format == "int":
        if weights.bits not in (4, 8) or weights.granularity not in ("channel", "group"):
            raise _unsupported(f"int{weights.bits} weights per {weights.granularity}")
        fields["weights"] = QuantizationArgs(num_bits=weights.bits, type="int", symmetric=weights.symmetric,
                                             strategy=weights.granularity,
                                             group_size=weights.group_size if weights.granularity == "group" else None)
        if scheme.activations is not None:
            raise _unsupported(f"scheme {scheme.name!r}: int weights with activation quantization "
                               "(int W8A8 is not exported yet)")
    elif weights.format == "fp8_e4m3":
        if weights.granularity not in ("channel", "tensor"):
            raise _unsupported(f"fp8 weights per {weights.granularity}")
        fields["weights"] = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=weights.granularity)
        acts = scheme.activations
        if acts is not None:
            if not (acts.format == "fp8_e4m3" and acts.dynamic and acts.granularity == "token"):
                raise _unsupported(f"activations {acts.format} per {acts.granularity} "
                                   f"({'dynamic' if acts.dynamic else 'static'})")
            fields["input_activations"] = QuantizationArgs(num_bits=8, type="float", symmetric=True,
                                                           strategy="token", dynamic=True)
    else:
        raise _unsupported(f"{weights.format} weights")
    return fields


# ------------------------------------------------------------------------------ the export
@dataclass
class ExportResult:
    directory: Path
    format: str
    quantized: list[str]
    kept: list[str]
    max_abs_weight_error: float  # exported (decompressed) vs the harness's weights
    quantization_config: dict[str, Any] = field(default_factory=dict)


def _plain_copy(model: nn.Module) -> nn.Module:
    """A fresh instance of the model's class holding its current (quantized, folded) weights."""
    state = {k: v for k, v in model.state_dict().items()}
    fresh = type(model)(model.config).to(dtype=next(model.parameters()).dtype)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise ExportError(f"cannot rebuild {type(model).__name__} for export: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    if getattr(model.config, "tie_word_embeddings", False):
        fresh.tie_weights()
    return fresh.eval()


def export(model: nn.Module, tokenizer: Any, scheme: QuantConfig, out: str | Path, *,
           targets: dict[str, nn.Linear], kept: list[str]) -> ExportResult:
    """Write ``model`` (already quantized in place by the harness as ``scheme``) to ``out``.

    ``targets`` / ``kept``: the linears the scheme quantized and those it left in high precision
    (``harness.quant.base.target_linears``). Raises :class:`ExportError` before writing anything
    when the scheme is not representable.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config

    fields = quantization_args(scheme)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"out={out} exists and is not empty; choose a new directory")
    weights_spec = scheme.weights
    assert weights_spec is not None
    harness_weights = {name: module.weight.detach() for name, module in targets.items()}
    exported = _plain_copy(model)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **fields)},
                                ignore=sorted(kept), quantization_status="frozen")
    apply_quantization_config(exported, config, show_progress=False)
    modules = dict(exported.named_modules())
    half = 2 ** (weights_spec.bits - 1)
    for name, weight in harness_weights.items():
        module = modules[name]
        if weights_spec.format == "int":
            scale, zero = recover_int_grid(weight, weights_spec.bits, symmetric=weights_spec.symmetric,
                                           granularity=weights_spec.granularity, group_size=weights_spec.group_size)
            zero_point = torch.zeros_like(zero) if weights_spec.symmetric else zero - half
        else:
            scale = recover_fp8_scale(weight, weights_spec.granularity)
            zero_point = torch.zeros_like(scale)
        module.weight.data.copy_(weight)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape)
                                                .to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(exported)
    compressor.compress_model(exported)
    out.mkdir(parents=True, exist_ok=True)
    exported.save_pretrained(out)
    compressor.update_config(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    error = verify(out, harness_weights, model)
    log.info("exported %d quantized linears (%s) to %s; max |Δw| vs the harness %.3g", len(targets),
             qconfig.get("format"), out, error)
    return ExportResult(out, str(qconfig.get("format")), sorted(targets), sorted(kept), error, qconfig)


def verify(directory: Path, harness_weights: dict[str, Tensor], model: nn.Module) -> float:
    """Decompress the export with compressed-tensors itself and compare its weights with the harness's.

    The library's own path: a fresh model gets the written ``quantization_config``, is compressed
    to obtain the packed parameter shapes, loads the safetensors and decompresses. (transformers'
    loader is not used here: it cannot load asymmetric pack-quantized checkpoints in
    transformers 5.24 + compressed-tensors 0.20, llm-compressor issue #1618.)
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from safetensors.torch import load_file

    qconfig = json.loads((directory / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate({k: v for k, v in qconfig.items()
                                                if k in QuantizationConfig.model_fields})
    config.quantization_status = QuantizationStatus.FROZEN
    fresh = _plain_copy(model)
    apply_quantization_config(fresh, config, show_progress=False)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(fresh)
    state: dict[str, Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(shard))
    fresh.load_state_dict(state, strict=False)
    compressor.decompress_model(fresh)
    modules = dict(fresh.named_modules())
    worst = 0.0
    for name, weight in harness_weights.items():
        got = modules[name].weight.detach().to(torch.float32)
        worst = max(worst, float((got - weight.to(torch.float32)).abs().max()))
    return worst


# ------------------------------------------------------------------------------ CLI
@dataclass
class ExportOptions:
    out: str = field(default="", metadata={"help": "output directory (new or empty), required"})


TOOL = cli.Tool(prog="python -m harness.export", options=ExportOptions, run_config=True,
                summary="Quantize the model as the run config says and write it as a compressed-tensors "
                        "checkpoint (loadable by transformers + compressed-tensors and vLLM).")


def _body(parsed: cli.Parsed[ExportOptions]) -> int:
    from harness import quant
    from harness.quant.base import target_linears

    options = parsed.options
    assert options is not None
    if not options.out:
        raise cli.UsageError("out= is required, e.g. out=exports/smollm2_int4_g128")
    cfg = parsed.run
    scheme = quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups)
    quantization_args(scheme)  # refuse an unrepresentable scheme before loading anything
    if Path(options.out).exists() and any(Path(options.out).iterdir()):
        raise cli.UsageError(f"out={options.out} exists and is not empty; choose a new directory")
    from harness.report_quant import prepare

    prepared = prepare(cfg)
    quant.apply(prepared.loaded.model, prepared.scheme, prepared.context)
    targets, kept = target_linears(prepared.loaded.model, prepared.scheme)
    result = export(prepared.loaded.model, prepared.loaded.tokenizer, prepared.scheme, options.out,
                    targets=targets, kept=kept)
    print(f"wrote {result.directory} ({result.format}; {len(result.quantized)} quantized linears, "
          f"{len(result.kept)} kept); max |Δw| vs the harness's weights {result.max_abs_weight_error:.3g}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
