"""``python -m harness.export model=... quant=... out=DIR`` — ship what was evaluated.

Writes the harness's quantized model as a **compressed-tensors** checkpoint (the format
llm-compressor writes and vLLM serves), through the ``compressed-tensors`` library itself:
the library's :class:`~compressed_tensors.compressors.ModelCompressor` packs the weights and
writes ``quantization_config``; this module only says *what* grid each linear is on.

Which methods' weights it can write is each method's registration's (``register_method(...,
exports=("compressed-tensors",))``, :mod:`harness.quant.methods`): a method that declares it leaves every
target weight on ``quant.weights``' grid and folds any other change into ordinary weights. The built-in
methods (rtn, gptq, awq, smoothquant) declare it; a method that does not is refused before anything loads.

Representable schemes (anything else is refused with this list, :data:`REPRESENTABLE`):

* integer weights, 4 or 8 bits, per output channel or per group, symmetric or asymmetric
  (``pack-quantized``): RTN, GPTQ, AWQ (its scales are already folded into the preceding norm
  or linear, which are written as ordinary weights), SmoothQuant-smoothed weights; groups must
  divide every linear's input size (:func:`check_whole_groups` refuses a ragged last group before
  quantizing: compressed-tensors cannot store it, vLLM cannot serve it);
* INT8 W8A8: symmetric int8 channel weights with dynamic per-token int8 activations
  (``int-quantized``, compressed-tensors' W8A8 preset; ``int8_w8a8``, ``int8_w8a8_sq``);
* FP8 E4M3 weights per tensor or per channel, with or without dynamic per-token FP8
  activations (``float-quantized``: "FP8_DYNAMIC" / W8A16 FP8);
* NVFP4 weights (``nvfp4-pack-quantized``, compressed-tensors' NVFP4A16 preset: E2M1 codes, an
  E4M3 scale per 16, one FP32 ``weight_global_scale``), optionally with NVFP4 activations (the
  NVFP4 preset: dynamic block scales, a static ``input_global_scale`` per linear);
* any of these, or unquantized weights (``kv8``), with an FP8 E4M3 KV cache of static per-layer
  scales: ``kv_cache_scheme`` in the config and ``<attention>.k_scale`` / ``.v_scale`` tensors
  (shape [1], float32, amax/448: the harness's calibrated scales as they are), where vLLM's
  ``kv_cache_dtype=fp8`` reads them. KIVI-style int KV caches, dynamic or per-head scales and
  full-precision residual windows have no compressed-tensors form and are refused.

Mixture-of-experts models (transformers 5's fused ``gate_up_proj`` / ``down_proj`` experts) are written
as checkpoints on the hub are: one tensor set per expert matrix, ``<layer>.mlp.experts.<e>.gate_proj``
(``up_proj``, ``down_proj``; Mixtral's ``block_sparse_moe.experts.<e>.w1`` / ``w3`` / ``w2``), the names
transformers fuses on load and vLLM's ``FusedMoE`` loaders and llm-compressor use
(``harness.checkpoint.expert_layout``). Each expert matrix is packed exactly as a Linear of its shape
would be; the routers stay dense and are listed in ``ignore``.

The harness keeps dequantized weights, not codes, so the grid of each weight group is
recovered from the values (``harness.checkpoint.export_grids``): every group's values are integer
multiples of one scale (around one zero point), which is found exactly for RTN's
``amax / qmax`` and, for GPTQ groups whose largest code is below ``qmax``, by trying the smaller
code ranges. Recovery is exact in float32; in bf16/fp16 the harness's values are themselves
rounded to the model dtype, so the exported weights match them to one rounding step of that
dtype. The export then decompresses its own output and checks it.

Sign conventions: the harness's symmetric INT grid uses codes ``-(2^(b-1)-1) .. 2^(b-1)-1``
(never ``-2^(b-1)``), a subset of compressed-tensors' signed range, so it is exact; the
asymmetric grid's unsigned codes ``0 .. 2^b-1`` with zero point ``z`` are stored as signed
codes ``q - 2^(b-1)`` with zero point ``z - 2^(b-1)``, the same values.

NVFP4 conventions are compressed-tensors' own (the harness implements them): ``gs = 448·6 /
amax`` per tensor, block scales ``e4m3(gs · amax_b / 6)`` stored as E4M3, values
``e2m1 · s_b / gs``. ``gs`` is recovered to the float32 bit from the dequantized weights, so the
stored checkpoint decodes (in float32) to the harness's weights exactly. Two library limits
(compressed-tensors 0.20.1, transformers 5.24): NVFP4 decompresses into *bfloat16* whatever the
model's dtype (a float32 model sees each weight rounded by up to 2^-8 of itself; transformers'
lazy path then fails, float != BFloat16, unless loaded with ``dequantize=True``, which drops the
activation quantization), so NVFP4 round trips are bit-exact in bfloat16 and 2^-8-relative in
float32; and the KV-cache scheme is not attached to transformers 5.24's attention (its forward
takes ``cache=``), so on a CPU the loaded model runs its KV cache unquantized — the scales are
checked as tensors, and ``harness.checkpoint.candidate`` refuses such a checkpoint rather than mis-measure it.

NVFP4 activations: the harness computes the global scale per call from the call's own amax;
compressed-tensors (and vLLM) use one calibrated ``input_global_scale = 448·6 / amax`` over the
calibration batches (llm-compressor's ``static_minmax``). Calibrated on the very batch evaluated
the two are identical (tested); on other inputs the block scales differ by that amax ratio
(before E4M3 rounding), and an input above the calibrated amax saturates at the E4M3 maximum.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from harness import cli
from harness.checkpoint.export_check import (
    _plain_copy,
    load_compressed,
    stored_error,
    verify,
)
from harness.checkpoint.export_grids import (
    REPRESENTABLE,
    ExportError,
    _unsupported,
    recover_fp8_scale,
    recover_int_grid,
    recover_nvfp4,
)
from harness.config import QuantConfig, TensorQuantConfig
from harness.errors import UsageError
from harness.quant import COMPRESSED_TENSORS, get_method

if TYPE_CHECKING:
    from harness.checkpoint.expert_layout import ExpertModule

__all__ = ["REPRESENTABLE", "ExportError", "ExportResult", "check_method", "check_whole_groups", "export",
           "kv_cache_args", "load_compressed", "quantization_args", "recover_fp8_scale", "recover_int_grid",
           "recover_nvfp4", "stored_error", "verify"]

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


def check_method(scheme: QuantConfig) -> None:
    """Refuse a method whose registration does not map its weights to compressed-tensors (its ``exports``)."""
    spec = get_method(scheme.method)
    if COMPRESSED_TENSORS not in spec.exports:
        declared = ", ".join(sorted(spec.exports)) or "none"
        raise ExportError(f"cannot export quant.method={spec.name} as {COMPRESSED_TENSORS}: its registration "
                          f"declares the checkpoint formats {declared} (a method whose weights lie on quant.weights' "
                          f"grid registers with exports=({COMPRESSED_TENSORS!r},))")


def quantization_args(scheme: QuantConfig) -> dict[str, Any]:
    """compressed-tensors ``QuantizationScheme`` fields for ``scheme``'s linears, or :class:`ExportError`.

    Empty for a KV-cache-only scheme (``kv8``). Also checks the method (:func:`check_method`) and the KV
    cache (:func:`kv_cache_args`), so one call refuses every unrepresentable part before anything is loaded.
    """
    from compressed_tensors.quantization import QuantizationArgs

    check_method(scheme)
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
        acts = scheme.activations
        if acts is not None:
            # INT8 W8A8 (compressed-tensors' W8A8 preset, "int-quantized"): what vLLM serves with its int8
            # kernels (CUTLASS on GPUs, oneDNN on CPUs), smoothed (SmoothQuant folds into the norms) or not
            w8a8 = (weights.bits == 8 and weights.granularity == "channel" and weights.symmetric
                    and acts.format == "int" and acts.bits == 8 and acts.symmetric and acts.dynamic
                    and acts.granularity == "token")
            if not w8a8:
                raise _unsupported(f"scheme {scheme.name!r}: int{weights.bits} weights per {weights.granularity} "
                                   f"with {acts.format}{acts.bits if acts.format == 'int' else ''} activations per "
                                   f"{acts.granularity} ({'dynamic' if acts.dynamic else 'static'}); int W8A8 is "
                                   "exported as symmetric int8 channel weights with dynamic per-token int8 inputs")
            fields["input_activations"] = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token",
                                                           dynamic=True)
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


def check_whole_groups(targets: dict[str, nn.Linear], scheme: QuantConfig,
                       experts: dict[str, tuple[int, int]] | None = None) -> None:
    """Refuse, in one line and before quantizing, group sizes that leave a shorter last group.

    The harness evaluates ragged groups (``ragged_groups``: a last group of ``in % group_size``
    columns, as the GPTQ reference does), but compressed-tensors refuses to store them (``tensor
    column shape must be divisible by the given group_size``) and vLLM's grouped kernels need whole
    groups, so no file both would read exists. The fix names the group sizes that divide every layer.
    ``experts``: (out, in) of the fused expert matrices the scheme quantizes (``expert_shapes``).
    """
    weights = scheme.weights
    if weights is None or weights.granularity != "group" or not (targets or experts):
        return
    sizes = {name: module.in_features for name, module in targets.items()}
    sizes.update({name: shape[1] for name, shape in (experts or {}).items()})
    ragged = {name: size for name, size in sizes.items() if size % weights.group_size}
    if not ragged:
        return
    common = math.gcd(*sizes.values())
    fits = [g for g in (256, 128, 64, 32, 16) if common % g == 0 and g < weights.group_size]
    example = sorted(ragged)[0]
    fix = (f"quant.weights.group_size={fits[0]} (divides every input size{', as do ' + str(fits[1:]) if fits[1:] else ''})"
           if fits else "a group size that divides every input size")
    raise ExportError(f"quant.weights.group_size={weights.group_size} leaves a shorter last group in {len(ragged)} of "
                      f"{len(sizes)} linears (input sizes {sorted(set(ragged.values()))}, e.g. {example}: "
                      f"{ragged[example]} columns); compressed-tensors cannot store it and vLLM cannot serve it. "
                      f"Fix: {fix}, or evaluate the ragged scheme without exporting it")


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
    # bits per weight as written (harness.quant.report.bits_per_weight: quantized linears as stored — scales in the
    # model's dtype —, kept ones at 16): what a run of this checkpoint as a candidate reports
    bits_per_weight: float | None = None
    # mixture of experts: each quantized expert matrix's harness name → its module name in the checkpoint
    # (``….mlp.experts.3.gate_proj``; ``….block_sparse_moe.experts.3.w1`` for Mixtral), and the routers kept
    expert_names: dict[str, str] = field(default_factory=dict)


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


@dataclass
class _Weights:
    """What an export writes quantized, by harness name, and where each expert matrix goes in the checkpoint."""

    quantized: dict[str, Tensor]  # the harness's weights of every quantized linear and expert matrix
    experts: dict[str, ExpertModule]  # the experts modules that have a per-expert checkpoint layout
    expert_weights: dict[str, Tensor]  # every matrix of those experts, quantized or not
    every_expert_matrix: set[str]  # every expert matrix of the model, laid out per expert or not
    selected: dict[str, Tensor]  # the expert matrices the scheme quantizes
    layout: dict[str, str]  # expert matrix -> its module name in the per-expert layout


def _select_weights(model: nn.Module, scheme: QuantConfig, targets: dict[str, nn.Linear],
                    fields: dict[str, Any]) -> _Weights:
    """The weights ``scheme`` quantized in ``model``, or :class:`ExportError` for experts no checkpoint layout
    holds and for groups compressed-tensors cannot store (:func:`check_whole_groups`)."""
    from harness.checkpoint.expert_layout import expert_modules, expert_selection, harness_expert_weights
    from harness.quant.experts import name_matches

    every_expert = expert_modules(model) if fields else {}
    all_weights = harness_expert_weights(model, every_expert)
    selected = {name: weight for name, weight in all_weights.items()
                if name_matches(name, list(scheme.targets)) and not name_matches(name, list(scheme.keep))}
    unmapped = sorted({type(info.fused.module).__name__ for name, info in every_expert.items() if not info.mapped
                       and any(n.startswith(name + ".") for n in selected)})
    if unmapped:
        raise ExportError(f"cannot export the quantized experts of {', '.join(unmapped)} "
                          f"({getattr(model.config, 'model_type', '?')}): transformers has no per-expert checkpoint "
                          "layout for this family, so it could not load them back; keep the experts "
                          "(quant.keep=['*experts*']) to export the rest")
    experts = {name: info for name, info in every_expert.items() if info.mapped}  # unmapped ones stay fused, dense
    expert_weights = {name: w for name, w in all_weights.items() if name.rsplit(".", 2)[0] in experts}
    dense_targets = {name: module for name, module in targets.items() if name not in all_weights}
    check_whole_groups(dense_targets, scheme, {name: tuple(w.shape) for name, w in selected.items()})
    _, _, partial = expert_selection(experts, list(scheme.targets), list(scheme.keep))
    if partial:
        log.warning("experts of %s are partly quantized: the others are written dense and named in ignore", partial)
    quantized = {name: module.weight.detach() for name, module in dense_targets.items()} if fields else {}
    quantized.update(selected)
    layout = {name: experts[name.rsplit(".", 2)[0]].layout_name(name) for name in expert_weights}
    return _Weights(quantized, experts, expert_weights, set(all_weights), selected, layout)


def _quantized_copy(model: nn.Module, scheme: QuantConfig, weights: _Weights, kept: list[str], fields: dict[str, Any],
                    kv_args: Any, kv_scales: dict[str, tuple[Tensor, Tensor]],
                    input_amax: dict[str, Tensor]) -> tuple[nn.Module, list[str]]:
    """A plain copy of ``model`` in the checkpoint's layout with compressed-tensors' quantization attached, each
    quantized weight's recovered grid and the k/v scales set; and the module names it leaves unquantized."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config

    from harness.checkpoint.expert_layout import to_checkpoint_layout

    exported = _plain_copy(model)
    if weights.experts:
        to_checkpoint_layout(exported, weights.experts, weights.expert_weights)
    dense_kept = [name for name in kept if name not in weights.every_expert_matrix]
    ignored = sorted(dense_kept) + sorted(weights.layout[name] for name in weights.expert_weights
                                          if name not in weights.selected)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], **fields)} if fields else {}
    config = QuantizationConfig(config_groups=groups, ignore=ignored if fields else [],
                                kv_cache_scheme=kv_args, quantization_status="frozen")
    apply_quantization_config(exported, config, show_progress=False)
    modules = dict(exported.named_modules())
    for name, weight in weights.quantized.items():
        assert scheme.weights is not None
        module = modules[weights.layout.get(name, name)]
        _write_weight_qparams(module, weight, scheme.weights)
        if name in input_amax:
            _set(module, "input_global_scale", _global_scale(input_amax[name]))
    for name, (key_scale, value_scale) in kv_scales.items():
        # llm-compressor's names, read by vLLM (kv_cache_dtype=fp8): <attention>.k_scale / .v_scale, shape [1].
        # Registered here: compressed-tensors 0.20 does not recognise transformers 5.24's attention (its
        # forward takes `cache=`, not `past_key_values=`), so apply_quantization_config adds no k_scale.
        modules[name].register_parameter("k_scale", nn.Parameter(key_scale.reshape(1), requires_grad=False))
        modules[name].register_parameter("v_scale", nn.Parameter(value_scale.reshape(1), requires_grad=False))
    return exported, ignored


def _save_compressed(exported: nn.Module, out: Path, kv_args: Any) -> None:
    """Compress ``exported`` with compressed-tensors and write it, with its ``quantization_config``, to ``out``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

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


def _name_experts_in_checkpoint(model: nn.Module, exported: nn.Module, out: Path, weights: _Weights,
                                ignored: list[str]) -> dict[str, str]:
    """Module names as saved (what vLLM matches) of the ignored modules, the routers and the expert matrices;
    rewrites ``ignore`` in ``out``'s config with them. Empty without per-expert layouts."""
    from harness.checkpoint.expert_layout import checkpoint_names
    from harness.quant.experts import find_routers

    if not weights.experts:
        return {}
    routers = sorted(find_routers(model))
    saved = {key.removesuffix(".weight"): value.removesuffix(".weight") for key, value in checkpoint_names(
        exported, [f"{name}.weight" for name in ignored + routers + sorted(set(weights.layout.values()))]).items()}
    _rewrite_ignore(out, sorted({saved[name] for name in ignored + routers}))
    return saved


def export(model: nn.Module, tokenizer: Any, scheme: QuantConfig, out: str | Path, *,
           targets: dict[str, nn.Linear], kept: list[str], calibration: list[Tensor] | None = None) -> ExportResult:
    """Write ``model`` (already quantized in place by the harness as ``scheme``) to ``out``.

    ``targets`` / ``kept``: the linears the scheme quantized and those it left in high precision
    (``harness.quant.targets.target_linears``). ``calibration``: token batches for the static
    ``input_global_scale`` of NVFP4 activations (needed only then). Raises :class:`ExportError`
    before writing anything when the scheme is not representable.

    Mixture-of-experts experts (fused 3-D parameters, or the per-expert Linears an activation-quantized
    scheme leaves) are written one tensor set per expert matrix, under the names transformers, vLLM and
    llm-compressor read (:mod:`harness.checkpoint.expert_layout`); the routers are written dense and named in
    ``ignore`` (llm-compressor's convention, so no engine quantizes them on load).
    """
    fields = quantization_args(scheme)
    weights = _select_weights(model, scheme, targets, fields)
    kv_args = kv_cache_args(scheme)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"out={out} exists and is not empty; choose a new directory")
    kv_scales = _kv_scales(model) if kv_args is not None else {}
    input_amax: dict[str, Tensor] = {}
    if scheme.activations is not None and scheme.activations.format == "nvfp4":
        input_amax = calibrate_input_amax(model, targets, calibration or [])
    exported, ignored = _quantized_copy(model, scheme, weights, kept, fields, kv_args, kv_scales, input_amax)
    _save_compressed(exported, out, kv_args)
    saved = _name_experts_in_checkpoint(model, exported, out, weights, ignored)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    error, kv_error = verify(out, weights.quantized, model, kv_scales)
    expert_names = {name: saved[weights.layout[name]] for name in weights.selected}
    stored = (stored_error(out, weights.quantized, expert_names) if qconfig.get("format") == "nvfp4-pack-quantized"
              else error)
    log.info("exported %d quantized linears and expert matrices (%s) to %s; max |Δw| vs the harness %.3g",
             len(weights.quantized), qconfig.get("format"), out, error)
    kept = sorted(kept) if fields else sorted(set(kept) | set(targets))  # KV cache only: every linear kept
    unquantized_experts = weights.every_expert_matrix - set(weights.selected)
    return ExportResult(out, str(qconfig.get("format")), sorted(weights.quantized), kept, error, qconfig,
                        stored, kv_error, {name: float(_global_scale(a)) for name, a in input_amax.items()},
                        written_bits_per_weight(out, model, sorted(set(kept) | unquantized_experts)), expert_names)


def _rewrite_ignore(directory: Path, ignore: list[str]) -> None:
    """Set ``quantization_config.ignore`` in ``directory``'s config.json (checkpoint names: what vLLM matches)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["ignore"] = ignore
    path.write_text(json.dumps(config, indent=2) + "\n")


def written_bits_per_weight(directory: Path, model: nn.Module, kept: list[str]) -> float:
    """Bits per weight of the checkpoint in ``directory`` (its safetensors headers), as runs count them.

    ``kept``: harness names of the linears and expert matrices left in high precision. Expert matrices count
    as the Linears they are stored as; routers that are not Linears count at 16 bits, as the coverage
    account counts them (``harness.quant.coverage``)."""
    from harness.checkpoint.candidate import checkpoint_shapes, measured_bits_per_weight
    from harness.quant import bits_per_weight, linear_census
    from harness.quant.experts import find_routers

    shapes, names = checkpoint_shapes(model)
    _, head, _ = linear_census(model, kept)
    kept_saved = {names.get(name, name) for name in kept}
    head_saved = names.get(head, head) if head is not None else None
    stored = measured_bits_per_weight(directory, shapes, kept_saved)
    quantized = sum(out * inp for name, (out, inp) in shapes.items() if name not in kept_saved and name != head_saved)
    kept_params = sum(out * inp for name, (out, inp) in shapes.items() if name in kept_saved and name != head_saved)
    kept_params += sum(model.get_submodule(name).weight.numel() for name in find_routers(model)
                       if not isinstance(model.get_submodule(name), nn.Linear))
    return bits_per_weight([(quantized, stored)] if stored is not None and quantized else [], kept_params)


# ------------------------------------------------------------------------------ CLI
@dataclass
class ExportOptions:
    out: str = field(default="", metadata={"help": "output directory (new or empty), required"})


TOOL = cli.Tool(prog="python -m harness.export", options=ExportOptions, run_config=True,
                summary="Quantize the model as the run config says and write it as a compressed-tensors "
                        "checkpoint (loadable by transformers + compressed-tensors and vLLM).")


def _body(parsed: cli.Parsed[ExportOptions]) -> int:
    from harness import quant
    from harness.quant.experts import expert_shapes

    options = parsed.options
    assert options is not None
    if not options.out:
        raise UsageError("out= is required, e.g. out=exports/smollm2_int4_g128")
    cfg = parsed.run
    scheme = quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups)
    quant.validate_scheme(scheme)  # imports its plugins, whose registrations say what their methods export
    quantization_args(scheme)  # refuse an unrepresentable scheme before loading anything
    if Path(options.out).exists() and any(Path(options.out).iterdir()):
        raise UsageError(f"out={options.out} exists and is not empty; choose a new directory")
    from harness.sizing.report_quant import prepare

    prepared = prepare(cfg)
    check_whole_groups(quant.target_linears(prepared.loaded.model, prepared.scheme)[0], prepared.scheme,  # before work
                       expert_shapes(prepared.loaded.model, prepared.scheme))
    quant.apply(prepared.loaded.model, prepared.scheme, prepared.context)
    targets, kept = quant.target_linears(prepared.loaded.model, prepared.scheme)
    calibration = (prepared.context.calibration_batches()
                   if prepared.scheme.activations is not None and prepared.scheme.activations.format == "nvfp4"
                   else None)
    result = export(prepared.loaded.model, prepared.loaded.tokenizer, prepared.scheme, options.out,
                    targets=targets, kept=kept, calibration=calibration)
    experts = len(result.expert_names)
    print(f"wrote {result.directory} ({result.format}; {len(result.quantized) - experts} quantized linears"
          + (f" and {experts} expert matrices, one tensor set per expert" if experts else "") + ", "
          f"{len(result.kept)} kept; {result.bits_per_weight:.4f} bits/weight as written); "
          f"max |Δw| vs the harness's weights {result.max_abs_weight_error:.3g} "
          f"(decompressed by compressed-tensors), {result.max_abs_stored_error:.3g} (stored values)"
          + ("" if result.max_abs_kv_scale_error is None
             else f"; k/v scales max |Δ| {result.max_abs_kv_scale_error:.3g}"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.export``: this module's compressed-tensors export, or with ``format=gguf`` the reference
    as a GGUF for llama.cpp (:mod:`harness.checkpoint.export_gguf`, its own options)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if "format=gguf" in args:
        from harness.checkpoint.export_gguf import main as gguf_main

        return gguf_main(args)
    return cli.main(TOOL, _body, args)


if __name__ == "__main__":
    raise SystemExit(main())
