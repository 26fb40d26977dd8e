"""Reading a compressed-tensors mixture-of-experts checkpoint's expert tensors with compressed-tensors itself.

transformers 5 loads per-expert checkpoints into its fused experts through a conversion that
decompresses each expert (``CompressedTensorsDequantize``) and stacks them; that conversion reads
only some of what compressed-tensors stores (``weight_packed`` + ``weight_scale``, or an FP8
``weight`` + ``weight_scale``). :func:`expert_matrices` decompresses each expert matrix with the
library's own per-module decompressor (``BaseCompressor.decompress(state, scheme)``, the call
transformers uses for a dense Linear), from every tensor the checkpoint holds for it (zero points,
global scales, int8 weights included), streaming the safetensors one tensor at a time.
:func:`check_loaded_experts` compares the model transformers built with it and, where they differ,
writes the library's values and says so (:class:`ExpertLoad`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from harness.checkpoint.expert_layout import expert_checkpoint_names

__all__ = ["ExpertLoad", "check_loaded_experts", "expert_matrices", "experts_scheme", "stored_name"]

# what compressed-tensors may store beside one quantized module, by local name
LEAVES = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_global_scale", "weight_shape",
          "weight_g_idx")


def experts_scheme(quantization_config: dict[str, Any]) -> tuple[Any, str]:
    """(QuantizationScheme, format) of the config group that quantizes the experts: the one whose ``re:`` targets
    name experts, else the first with a class-name target (``Linear``: experts are Linears in the checkpoint's
    layout), else the first."""
    from compressed_tensors.quantization import QuantizationScheme

    groups = [QuantizationScheme.model_validate(g) for g in (quantization_config.get("config_groups") or {}).values()]
    if not groups:
        raise ValueError("the checkpoint's quantization_config has no config group")
    chosen = next((g for g in groups if any(t.startswith("re:") and "experts" in t for t in g.targets)), None)
    chosen = chosen or next((g for g in groups if any(not t.startswith("re:") for t in g.targets)), groups[0])
    fmt = chosen.format or quantization_config.get("format") or "dense"
    return chosen, str(getattr(fmt, "value", fmt))


def _tensor_index(directory: Path) -> dict[str, Path]:
    index: dict[str, Path] = {}
    for shard in sorted(Path(directory).glob("*.safetensors")):
        from safetensors import safe_open

        with safe_open(str(shard), framework="pt") as handle:
            index.update({key: shard for key in handle.keys()})
    return index


def stored_name(harness_name: str, saved: str, tensors: Any) -> str:
    """The module name a checkpoint stores expert matrix ``harness_name`` under: transformers' name (``saved``),
    else the generic projection name in the same place (llm-compressor 0.14 on transformers 5.17 writes
    Mixtral's experts as ``block_sparse_moe.experts.<e>.gate_proj``, not the ``w1`` transformers and vLLM
    read). ``tensors``: the checkpoint's tensor names (any container)."""
    if any(f"{saved}.{leaf}" in tensors for leaf in ("weight", "weight_packed")):
        return saved
    generic = f"{saved.rpartition('.')[0]}.{harness_name.rpartition('.')[2]}"
    return generic if any(f"{generic}.{leaf}" in tensors for leaf in ("weight", "weight_packed")) else saved


def expert_matrices(model: nn.Module, directory: Path) -> Iterator[tuple[str, Tensor]]:
    """(harness name ``<experts>.<e>.<proj>``, its [out, in] matrix) for every expert matrix of ``model``'s
    architecture, decompressed from the checkpoint in ``directory`` by compressed-tensors (a dense ``weight``
    as stored). A matrix the checkpoint lacks raises KeyError naming it."""
    from compressed_tensors.compressors import BaseCompressor
    from safetensors import safe_open

    qconfig = json.loads((Path(directory) / "config.json").read_text()).get("quantization_config") or {}
    scheme, fmt = experts_scheme(qconfig) if qconfig.get("config_groups") else (None, "dense")
    compressor = BaseCompressor.get_value_from_registry(fmt)
    index = _tensor_index(directory)
    handles: dict[Path, Any] = {}
    try:
        for name, saved in expert_checkpoint_names(model).items():
            saved = stored_name(name, saved, index)
            local = {}
            for leaf in LEAVES:
                shard = index.get(f"{saved}.{leaf}")
                if shard is None:
                    continue
                if shard not in handles:
                    handles[shard] = safe_open(str(shard), framework="pt").__enter__()
                local[leaf] = handles[shard].get_tensor(f"{saved}.{leaf}")
            if "weight" not in local and "weight_packed" not in local:
                raise KeyError(f"{saved} (expert matrix {name}) is not in the checkpoint")
            quantized = scheme is not None and ("weight_packed" in local or "weight_scale" in local)
            yield name, compressor.decompress(local, scheme)["weight"] if quantized else local["weight"]
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)


@dataclass
class ExpertLoad:
    """How the experts transformers loaded compare with compressed-tensors' own decompression."""

    matrices: int = 0
    rewritten: list[str] = field(default_factory=list)  # matrices transformers loaded otherwise (now the library's)
    max_abs_difference: float = 0.0  # before rewriting


@torch.no_grad()
def check_loaded_experts(model: nn.Module, directory: Path) -> ExpertLoad:
    """Compare each fused expert matrix of ``model`` (as transformers loaded it) with compressed-tensors'
    decompression of the checkpoint's tensors; write the library's values where they differ.

    transformers 5.25's expert conversion ignores what it does not expect: int8 ``weight`` (INT8 W8A8,
    ``int-quantized``) is not read at all (the experts keep their random initialisation), and zero points
    (asymmetric) and NVFP4 global scales are dropped, so its experts would not be the checkpoint's.
    """
    from harness.quant.experts import find_fused_experts

    fused = find_fused_experts(model)
    if not fused:
        return ExpertLoad()
    result = ExpertLoad()
    for name, weight in expert_matrices(model, directory):
        prefix, expert, proj = name.rsplit(".", 2)
        target = fused[prefix].matrix(int(expert), proj)
        want = weight.to(device=target.device, dtype=target.dtype)
        result.matrices += 1
        if not torch.equal(target, want):
            diff = (target.float() - want.float()).abs()
            result.max_abs_difference = max(result.max_abs_difference, float(torch.nan_to_num(diff, nan=float("inf"))
                                                                               .max()))
            result.rewritten.append(name)
            target.copy_(want)
    return result

