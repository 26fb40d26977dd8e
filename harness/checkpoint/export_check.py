"""Reading an export back with compressed-tensors itself, and comparing it with the harness's model.

:func:`load_compressed` is the library's own load path (what transformers does, minus its
version-specific failures); :func:`verify` compares the decompressed weights and the written
KV-cache scales with the harness's; :func:`stored_error` decodes NVFP4 in float32, which the
library's decompressor (bfloat16) cannot show.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from harness.checkpoint.export_grids import ExportError


def _plain_copy(model: nn.Module) -> nn.Module:
    """A fresh instance of the model's class holding its current (quantized, folded) weights.

    Its config is a copy with the harness's KV-cache attention wrapper (if installed) replaced by
    the attention it wraps, so nothing of the harness's simulation is written."""
    from harness.quant.experts import UnfusedExperts
    from harness.quant.kv import WRAPPER_PREFIX

    config = copy.deepcopy(model.config)
    attention = getattr(config, "_attn_implementation", None)
    if attention and attention.startswith(WRAPPER_PREFIX):
        config._attn_implementation = attention[len(WRAPPER_PREFIX):]
    # experts an activation-quantized scheme left unfused are per-expert Linears here; the copy is fused, and
    # its fused parameters are written from them (_fuse_into)
    unfused = [f"{name}." for name, module in model.named_modules() if isinstance(module, UnfusedExperts)]
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(tuple(unfused))}
    fresh = type(model)(config).to(dtype=next(model.parameters()).dtype)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith(tuple(unfused))]  # the fused experts: _fuse_into
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise ExportError(f"cannot rebuild {type(model).__name__} for export: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    _fuse_into(fresh, model)
    return fresh.eval()


@torch.no_grad()
def _fuse_into(fresh: nn.Module, model: nn.Module) -> None:
    """Write each per-expert Linear of ``model``'s unfused experts into ``fresh``'s fused parameters."""
    from harness.quant.experts import FusedExperts, UnfusedExperts

    for name, module in model.named_modules():
        if not isinstance(module, UnfusedExperts):
            continue
        info = module.fused
        target = FusedExperts(name, fresh.get_submodule(name), info.num_experts, info.transposed, info.concatenated,
                              info.has_gate)
        for expert, linears in enumerate(module):
            for proj in info.projections():
                linear = getattr(linears, proj)
                matrix = target.matrix(expert, proj)
                matrix.copy_(linear.weight.detach().to(device=matrix.device, dtype=matrix.dtype))
                bias = target.bias(expert, proj)
                if bias is not None and linear.bias is not None:
                    bias.copy_(linear.bias.detach().to(device=bias.device, dtype=bias.dtype))


def load_compressed(directory: Path, model: nn.Module) -> nn.Module:
    """The export as compressed-tensors itself loads it: decompressed, with its quantized forward.

    A fresh copy of ``model``'s architecture gets the written ``quantization_config`` (status
    frozen: activation and KV-cache quantization run in its forward), is compressed to obtain the
    packed parameter shapes, loads the safetensors and decompresses. Tensors the library does not
    expect (a misnamed ``k_scale``, say) raise :class:`ExportError`. (transformers' loader is not
    used here: it cannot load asymmetric pack-quantized checkpoints in transformers 5.24 +
    compressed-tensors 0.20, llm-compressor issue #1618, and in float32 it fails on NVFP4.)

    Mixture-of-experts experts are read as the checkpoint stores them, one Linear per expert matrix
    under its checkpoint name (:mod:`harness.checkpoint.expert_layout`), decompressed by the library
    like any Linear and written back into the fused parameters: the returned model is fused, as
    transformers builds it (its experts then run without activation quantization).
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from safetensors.torch import load_file

    from harness.checkpoint.expert_layout import checkpoint_names, expert_modules, restore_fused, to_checkpoint_layout

    qconfig = json.loads((directory / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate({k: v for k, v in qconfig.items()
                                                if k in QuantizationConfig.model_fields})
    config.quantization_status = QuantizationStatus.FROZEN
    fresh = _plain_copy(model)
    experts = {name: info for name, info in expert_modules(fresh).items() if info.mapped}  # others stay fused
    layout = to_checkpoint_layout(fresh, experts) if experts else None
    if layout is not None:  # the config's ignore list holds checkpoint names; compressed-tensors matches module names
        modules = [name for name, module in fresh.named_modules() if isinstance(module, nn.Linear)]
        saved = checkpoint_names(fresh, [f"{name}.weight" for name in modules])
        local = {saved[f"{name}.weight"].removesuffix(".weight"): name for name in modules}
        config.ignore = [local.get(entry, entry) for entry in config.ignore or []]
    apply_quantization_config(fresh, config, show_progress=False)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(fresh)
    state: dict[str, Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(shard))
    if layout is not None:  # checkpoint names (Mixtral's block_sparse_moe) back to the model's module names
        keys = list(fresh.state_dict())
        back = {saved_key: key for key, saved_key in checkpoint_names(fresh, keys).items()}
        state = {back.get(key, key): value for key, value in state.items()}
    # k_scale / v_scale belong to an attention module (one with k_proj), anywhere else they are misnamed
    attention = {name for name, module in fresh.named_modules() if hasattr(module, "k_proj")}
    scales = {key for key in state if key.rsplit(".", 1)[-1] in ("k_scale", "v_scale")}
    kv = {key for key in scales if key.rsplit(".", 1)[0] in attention}
    unexpected = list(fresh.load_state_dict({k: v for k, v in state.items() if k not in scales},
                                            strict=False).unexpected_keys)
    unexpected += sorted(scales - kv)
    if unexpected:
        raise ExportError(f"the export holds tensors compressed-tensors does not expect: {unexpected[:5]}")
    compressor.decompress_model(fresh)
    fresh.kv_scales = {key: state[key] for key in kv}  # what vLLM reads; compressed-tensors 0.20 cannot attach them
    from compressed_tensors.offload.dispatch import remove_dispatch

    remove_dispatch(fresh)  # plain CPU modules again (decompression dispatches them)
    if layout is not None:
        restore_fused(layout)
    dtype = next(model.parameters()).dtype
    for module in fresh.modules():  # NVFP4 decompresses to bfloat16 whatever the model's dtype: run it in dtype
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.is_floating_point() and weight.dtype != dtype:
            module.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
    return fresh


def loaded_weight(loaded: nn.Module, name: str) -> Tensor:
    """The weight of ``name`` in a loaded (fused) model: a Linear's, or an expert matrix ``<experts>.<e>.<proj>``
    cut from the fused parameters."""
    from harness.quant.experts import find_fused_experts

    try:
        return loaded.get_submodule(name).weight.detach()
    except AttributeError:
        prefix, expert, proj = name.rsplit(".", 2)
        fused = find_fused_experts(loaded)[prefix]
        return fused.matrix(int(expert), proj).detach()


def verify(directory: Path, harness_weights: dict[str, Tensor], model: nn.Module,
           kv_scales: dict[str, tuple[Tensor, Tensor]] | None = None) -> tuple[float, float | None]:
    """Decompress the export with compressed-tensors (:func:`load_compressed`) and compare with the harness.

    Returns the largest |Δw| over the quantized linears and expert matrices (harness names) and the
    largest |Δ| of the loaded ``k_scale``/``v_scale`` against the harness's calibrated scales (None
    without a KV cache).
    """
    loaded = load_compressed(directory, model)
    worst = 0.0
    for name, weight in harness_weights.items():
        got = loaded_weight(loaded, name).to(torch.float32)
        worst = max(worst, float((got - weight.to(torch.float32)).abs().max()))
    kv_worst = None
    for name, (key_scale, value_scale) in (kv_scales or {}).items():
        for attr, want in (("k_scale", key_scale), ("v_scale", value_scale)):
            got = loaded.kv_scales[f"{name}.{attr}"].to(torch.float32)
            kv_worst = max(kv_worst or 0.0, float((got.reshape(-1) - want.reshape(-1)).abs().max()))
    return worst, kv_worst


def stored_error(directory: Path, harness_weights: dict[str, Tensor], names: dict[str, str] | None = None) -> float:
    """Largest |Δw| of the written NVFP4 codes and scales decoded in float32 (``e2m1 · s_b / gs``).

    compressed-tensors 0.20's decompressor unpacks NVFP4 to bfloat16 and dequantizes into bfloat16
    (``unpack_fp4_from_uint8``'s default dtype), which rounds each weight by up to 2^-8 of its
    value; the same library functions with ``dtype=float32`` show what the checkpoint holds. ``names``: harness
    name → checkpoint module name where they differ (expert matrices)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(shard))
    worst = 0.0
    for name, weight in harness_weights.items():
        name = (names or {}).get(name, name)
        packed = state[f"{name}.weight_packed"]
        codes = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        step = state[f"{name}.weight_scale"].to(torch.float32) / state[f"{name}.weight_global_scale"].to(torch.float32)
        decoded = (codes.reshape(codes.shape[0], -1, 16) * step[..., None]).reshape(codes.shape)
        worst = max(worst, float((decoded - weight.to(torch.float32)).abs().max()))
    return worst
