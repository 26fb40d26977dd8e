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

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from harness import cli
from harness.config import QuantConfig, TensorQuantConfig
from harness.export_grids import (REPRESENTABLE, ExportError, _unsupported, recover_fp8_scale, recover_int_grid,
                                  recover_nvfp4)

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ scheme mapping
def _nvfp4_fields(scheme: QuantConfig) -> dict[str, Any]:
    """compressed-tensors' own NVFP4A16 / NVFP4 presets (``tensor_group`` strategy, group 16)."""
    from compressed_tensors.quantization.quant_scheme import NVFP4, NVFP4A16

    acts = scheme.activations
    if acts is None:
        return dict(NVFP4A16)
    if not (acts.format == "nvfp4" and acts.dynamic):
        raise _unsupported(f"nvfp4 weights with {acts.format} activations "
                           f"({'dynamic' if acts.dynamic else 'static'})")
    return dict(NVFP4)


def quantization_args(scheme: QuantConfig) -> dict[str, Any]:
    """compressed-tensors ``QuantizationScheme`` fields for ``scheme``'s linears, or :class:`ExportError`.

    Empty for a KV-cache-only scheme (``kv8``). Also checks the KV cache (:func:`kv_cache_args`),
    so one call refuses every unrepresentable part before anything is loaded.
    """
    from compressed_tensors.quantization import QuantizationArgs

    kv = kv_cache_args(scheme)
    weights: TensorQuantConfig | None = scheme.weights
    if weights is None:
        if kv is None:
            raise _unsupported(f"scheme {scheme.name!r} (no weight quantization)")
        if scheme.activations is not None:
            raise _unsupported(f"scheme {scheme.name!r}: activation quantization without weight quantization")
        return {}
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
    elif weights.format == "nvfp4":
        fields = _nvfp4_fields(scheme)
    else:
        raise _unsupported(f"{weights.format} weights")
    return fields


def kv_cache_args(scheme: QuantConfig) -> Any:
    """compressed-tensors ``kv_cache_scheme`` (a ``QuantizationArgs``) for ``scheme``, None without a KV cache.

    Only what vLLM's ``kv_cache_dtype=fp8`` with checkpoint scales serves: FP8 E4M3 keys *and*
    values, one static (calibrated) scale per layer each, no full-precision residual window.
    """
    from compressed_tensors.quantization import QuantizationArgs

    kv = scheme.kv_cache
    if kv is None:
        return None
    specs = {role: getattr(kv, role) for role in ("keys", "values")}
    for role, spec in specs.items():
        if spec is None:
            raise _unsupported(f"a KV cache that quantizes only the {'values' if role == 'keys' else 'keys'}")
        if not (spec.format == "fp8_e4m3" and spec.granularity == "tensor" and not spec.dynamic):
            raise _unsupported(f"KV-cache {role} as {spec.format} per {spec.granularity} "
                               f"({'dynamic' if spec.dynamic else 'static'})")
    if kv.residual_length:
        raise _unsupported(f"a KV cache with a full-precision residual window (residual_length={kv.residual_length})")
    return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)


# ------------------------------------------------------------------------------ the export
@dataclass
class ExportResult:
    directory: Path
    format: str
    quantized: list[str]
    kept: list[str]
    max_abs_weight_error: float  # exported (decompressed) vs the harness's weights
    quantization_config: dict[str, Any] = field(default_factory=dict)
    # the written codes and scales decoded in float32 vs the harness's weights (differs from the above for
    # nvfp4 only: compressed-tensors 0.20 decompresses NVFP4 to bfloat16)
    max_abs_stored_error: float = 0.0
    max_abs_kv_scale_error: float | None = None  # written k_scale / v_scale vs the harness's calibrated ones
    input_global_scales: dict[str, float] = field(default_factory=dict)  # nvfp4 activations: 448·6 / calibrated amax


def _plain_copy(model: nn.Module) -> nn.Module:
    """A fresh instance of the model's class holding its current (quantized, folded) weights.

    Its config is a copy with the harness's KV-cache attention wrapper (if installed) replaced by
    the attention it wraps, so nothing of the harness's simulation is written."""
    from harness.quant.kv import WRAPPER_PREFIX

    config = copy.deepcopy(model.config)
    attention = getattr(config, "_attn_implementation", None)
    if attention and attention.startswith(WRAPPER_PREFIX):
        config._attn_implementation = attention[len(WRAPPER_PREFIX):]
    state = {k: v for k, v in model.state_dict().items()}
    fresh = type(model)(config).to(dtype=next(model.parameters()).dtype)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise ExportError(f"cannot rebuild {type(model).__name__} for export: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    return fresh.eval()


@torch.no_grad()
def calibrate_input_amax(model: nn.Module, targets: dict[str, nn.Linear], batches: list[Tensor]) -> dict[str, Tensor]:
    """Largest finite |input| of each target linear over ``batches``, through the harness's quantized model.

    compressed-tensors' NVFP4 activations have dynamic block scales but a *static* per-tensor
    global scale (``input_global_scale``, llm-compressor's ``static_minmax`` observer); the harness
    computes that global scale per call from the call's own amax. The inputs are observed as the
    exported model will see them: weights and upstream activations quantized."""
    if not batches:
        raise ExportError("nvfp4 activations need calibration batches for input_global_scale; "
                          "raise quant.calibration.num_samples")
    amax: dict[str, Tensor] = {}

    def observe(name: str):
        def hook(_module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
            x = inputs[0].detach().float()
            value = torch.where(torch.isfinite(x), x.abs(), 0.0).amax()
            amax[name] = value if name not in amax else torch.maximum(amax[name], value)
        return hook

    hooks = [module.register_forward_pre_hook(observe(name)) for name, module in targets.items()]
    try:
        device = next(model.parameters()).device
        for batch in batches:
            model(input_ids=batch.to(device), use_cache=False)
    finally:
        for handle in hooks:
            handle.remove()
    return {name: value.cpu() for name, value in amax.items()}


def _global_scale(amax: Tensor) -> Tensor:
    """compressed-tensors' ``generate_gparam``: 448·6 / amax in float32 (1 for amax 0), shape [1]."""
    gs = torch.where(amax > 0, 448.0 * 6.0 / amax.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0).to(torch.float32).reshape(1)


def _set(module: nn.Module, name: str, value: Tensor) -> None:
    param = getattr(module, name)
    param.data.copy_(value.reshape(param.shape).to(param.dtype))


def _write_weight_qparams(module: nn.Module, weight: Tensor, spec: TensorQuantConfig) -> None:
    """Recover the grid of the harness's ``weight`` and store it as compressed-tensors' qparams."""
    if spec.format == "int":
        scale, zero = recover_int_grid(weight, spec.bits, symmetric=spec.symmetric,
                                       granularity=spec.granularity, group_size=spec.group_size)
        zero_point = torch.zeros_like(zero) if spec.symmetric else zero - 2 ** (spec.bits - 1)
    elif spec.format == "nvfp4":
        scale, global_scale, error = recover_nvfp4(weight)
        # float32: exact or refused; bf16/fp16 hide the global scale's last bits: one rounding step of the dtype
        allowed = 0.0 if weight.dtype == torch.float32 else torch.finfo(weight.dtype).eps * float(weight.abs().max())
        if error > allowed:
            raise ExportError(f"weights are not on an NVFP4 grid ({error:.3g} off at best); was the model "
                              "quantized with this scheme?")
        _set(module, "weight_global_scale", global_scale)
        zero_point = None
    else:
        scale = recover_fp8_scale(weight, spec.granularity)
        zero_point = torch.zeros_like(scale)
    module.weight.data.copy_(weight)
    _set(module, "weight_scale", scale)
    if zero_point is not None and hasattr(module, "weight_zero_point"):
        _set(module, "weight_zero_point", zero_point)


def _kv_scales(model: nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
    """The harness's calibrated (key, value) scales per attention module name (amax / 448 each)."""
    from harness.quant.kv import kv_layer_states

    scales = {}
    for name, state in kv_layer_states(model).items():
        if state.key_scale is None or state.value_scale is None:
            raise ExportError(f"{name}: the KV cache was never calibrated; quantize with the scheme first")
        scales[name] = (state.key_scale.detach().float().cpu(), state.value_scale.detach().float().cpu())
    if not scales:
        raise ExportError("the scheme has a KV cache but the model has no calibrated KV-cache states "
                          "(was harness.quant.apply run?)")
    return scales


def export(model: nn.Module, tokenizer: Any, scheme: QuantConfig, out: str | Path, *,
           targets: dict[str, nn.Linear], kept: list[str], calibration: list[Tensor] | None = None) -> ExportResult:
    """Write ``model`` (already quantized in place by the harness as ``scheme``) to ``out``.

    ``targets`` / ``kept``: the linears the scheme quantized and those it left in high precision
    (``harness.quant.base.target_linears``). ``calibration``: token batches for the static
    ``input_global_scale`` of NVFP4 activations (needed only then). Raises :class:`ExportError`
    before writing anything when the scheme is not representable.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config

    fields = quantization_args(scheme)
    kv_args = kv_cache_args(scheme)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"out={out} exists and is not empty; choose a new directory")
    kv_scales = _kv_scales(model) if kv_args is not None else {}
    input_amax: dict[str, Tensor] = {}
    if scheme.activations is not None and scheme.activations.format == "nvfp4":
        input_amax = calibrate_input_amax(model, targets, calibration or [])
    harness_weights = {name: module.weight.detach() for name, module in targets.items()} if fields else {}
    exported = _plain_copy(model)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], **fields)} if fields else {}
    config = QuantizationConfig(config_groups=groups, ignore=sorted(kept) if fields else [],
                                kv_cache_scheme=kv_args, quantization_status="frozen")
    apply_quantization_config(exported, config, show_progress=False)
    modules = dict(exported.named_modules())
    for name, weight in harness_weights.items():
        assert scheme.weights is not None
        _write_weight_qparams(modules[name], weight, scheme.weights)
        if name in input_amax:
            _set(modules[name], "input_global_scale", _global_scale(input_amax[name]))
    for name, (key_scale, value_scale) in kv_scales.items():
        # llm-compressor's names, read by vLLM (kv_cache_dtype=fp8): <attention>.k_scale / .v_scale, shape [1].
        # Registered here: compressed-tensors 0.20 does not recognise transformers 5.24's attention (its
        # forward takes `cache=`, not `past_key_values=`), so apply_quantization_config adds no k_scale.
        modules[name].register_parameter("k_scale", nn.Parameter(key_scale.reshape(1), requires_grad=False))
        modules[name].register_parameter("v_scale", nn.Parameter(value_scale.reshape(1), requires_grad=False))
    compressor = ModelCompressor.from_pretrained_model(exported)
    if compressor is None or compressor.quantization_config is None:  # KV cache only: no linear is quantized
        compressor = ModelCompressor(quantization_config=QuantizationConfig(
            config_groups={}, kv_cache_scheme=kv_args, quantization_status="compressed", format="dense"))
    if kv_args is not None:
        compressor.quantization_config.kv_cache_scheme = kv_args
    compressor.compress_model(exported)
    out.mkdir(parents=True, exist_ok=True)
    exported.save_pretrained(out)
    compressor.update_config(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    error, kv_error = verify(out, harness_weights, model, kv_scales)
    stored = stored_error(out, harness_weights) if qconfig.get("format") == "nvfp4-pack-quantized" else error
    log.info("exported %d quantized linears (%s) to %s; max |Δw| vs the harness %.3g", len(harness_weights),
             qconfig.get("format"), out, error)
    return ExportResult(out, str(qconfig.get("format")), sorted(harness_weights), sorted(kept), error, qconfig,
                        stored, kv_error, {name: float(_global_scale(a)) for name, a in input_amax.items()})


def load_compressed(directory: Path, model: nn.Module) -> nn.Module:
    """The export as compressed-tensors itself loads it: decompressed, with its quantized forward.

    A fresh copy of ``model``'s architecture gets the written ``quantization_config`` (status
    frozen: activation and KV-cache quantization run in its forward), is compressed to obtain the
    packed parameter shapes, loads the safetensors and decompresses. Tensors the library does not
    expect (a misnamed ``k_scale``, say) raise :class:`ExportError`. (transformers' loader is not
    used here: it cannot load asymmetric pack-quantized checkpoints in transformers 5.24 +
    compressed-tensors 0.20, llm-compressor issue #1618, and in float32 it fails on NVFP4.)
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
    attention = {name for name, module in fresh.named_modules() if hasattr(module, "k_proj")}
    kv = {key for key in state if key.rsplit(".", 1)[-1] in ("k_scale", "v_scale") and key.rsplit(".", 1)[0] in attention}
    unexpected = [key for key in fresh.load_state_dict({k: v for k, v in state.items() if k not in kv},
                                                       strict=False).unexpected_keys]
    unexpected += [key for key in state if key.rsplit(".", 1)[-1] in ("k_scale", "v_scale") and key not in kv]
    if unexpected:
        raise ExportError(f"the export holds tensors compressed-tensors does not expect: {unexpected[:5]}")
    compressor.decompress_model(fresh)
    fresh.kv_scales = {key: state[key] for key in kv}  # what vLLM reads; compressed-tensors 0.20 cannot attach them
    from compressed_tensors.offload.dispatch import remove_dispatch

    remove_dispatch(fresh)  # plain CPU modules again (decompression dispatches them)
    dtype = next(model.parameters()).dtype
    for module in fresh.modules():  # NVFP4 decompresses to bfloat16 whatever the model's dtype: run it in dtype
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.is_floating_point() and weight.dtype != dtype:
            module.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
    return fresh


def verify(directory: Path, harness_weights: dict[str, Tensor], model: nn.Module,
           kv_scales: dict[str, tuple[Tensor, Tensor]] | None = None) -> tuple[float, float | None]:
    """Decompress the export with compressed-tensors (:func:`load_compressed`) and compare with the harness.

    Returns the largest |Δw| over the quantized linears and the largest |Δ| of the loaded
    ``k_scale``/``v_scale`` against the harness's calibrated scales (None without a KV cache).
    """
    loaded = load_compressed(directory, model)
    modules = dict(loaded.named_modules())
    worst = 0.0
    for name, weight in harness_weights.items():
        got = modules[name].weight.detach().to(torch.float32)
        worst = max(worst, float((got - weight.to(torch.float32)).abs().max()))
    kv_worst = None
    for name, (key_scale, value_scale) in (kv_scales or {}).items():
        for attr, want in (("k_scale", key_scale), ("v_scale", value_scale)):
            got = loaded.kv_scales[f"{name}.{attr}"].to(torch.float32)
            kv_worst = max(kv_worst or 0.0, float((got.reshape(-1) - want.reshape(-1)).abs().max()))
    return worst, kv_worst


def stored_error(directory: Path, harness_weights: dict[str, Tensor]) -> float:
    """Largest |Δw| of the written NVFP4 codes and scales decoded in float32 (``e2m1 · s_b / gs``).

    compressed-tensors 0.20's decompressor unpacks NVFP4 to bfloat16 and dequantizes into bfloat16
    (``unpack_fp4_from_uint8``'s default dtype), which rounds each weight by up to 2^-8 of its
    value; the same library functions with ``dtype=float32`` show what the checkpoint holds."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(shard))
    worst = 0.0
    for name, weight in harness_weights.items():
        packed = state[f"{name}.weight_packed"]
        codes = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        step = state[f"{name}.weight_scale"].to(torch.float32) / state[f"{name}.weight_global_scale"].to(torch.float32)
        decoded = (codes.reshape(codes.shape[0], -1, 16) * step[..., None]).reshape(codes.shape)
        worst = max(worst, float((decoded - weight.to(torch.float32)).abs().max()))
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
    calibration = (prepared.context.calibration_batches()
                   if prepared.scheme.activations is not None and prepared.scheme.activations.format == "nvfp4"
                   else None)
    result = export(prepared.loaded.model, prepared.loaded.tokenizer, prepared.scheme, options.out,
                    targets=targets, kept=kept, calibration=calibration)
    print(f"wrote {result.directory} ({result.format}; {len(result.quantized)} quantized linears, "
          f"{len(result.kept)} kept); max |Δw| vs the harness's weights {result.max_abs_weight_error:.3g}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
