"""One entry point from a tensor spec (config) to the pure format functions.

``fake_quantize(x, spec)`` maps a :class:`TensorQuantConfig` onto ``harness.quant.formats``;
``validate_spec`` refuses combinations that make no sense before any model is touched,
and ``storage_bits`` gives the bits per element a spec costs, scales included.
"""
from __future__ import annotations

import torch
from torch import Tensor

from harness.config import TensorQuantConfig
from harness.quant import formats

INT_GRANULARITIES = {"tensor", "channel", "group", "token"}
FP8_FORMATS = {"fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}
FP8_GRANULARITIES = {"tensor", "channel", "token", "group", "block"}
BLOCK_FORMATS = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32}
FORMATS = {"int", *FP8_FORMATS, *BLOCK_FORMATS}


class SchemeError(ValueError):
    """A quantization scheme that makes no sense; the message says why and what to use."""


def validate_spec(spec: TensorQuantConfig, role: str) -> None:
    """Refuse nonsensical specs at config time. ``role`` is weights | activations | keys | values."""
    where = f"quant.{role}"
    if spec.format not in FORMATS:
        raise SchemeError(f"{where}.format={spec.format!r}: expected one of {sorted(FORMATS)}")
    if spec.format == "int":
        if not 2 <= spec.bits <= 8:
            raise SchemeError(f"{where}.bits={spec.bits}: integer formats support 2..8 bits")
        if spec.granularity not in INT_GRANULARITIES | ({"head"} if role in ("keys", "values") else set()):
            raise SchemeError(f"{where}.granularity={spec.granularity!r}: int supports {sorted(INT_GRANULARITIES)}")
    else:
        if not spec.symmetric:
            raise SchemeError(f"{where}: asymmetric {spec.format} makes no sense (floating-point grids are "
                              "symmetric around 0 and have no zero point); set symmetric: true or use format: int")
    if spec.format in FP8_FORMATS and spec.granularity not in FP8_GRANULARITIES | {"head"}:
        raise SchemeError(f"{where}.granularity={spec.granularity!r}: fp8 supports {sorted(FP8_GRANULARITIES)}")
    if spec.format in BLOCK_FORMATS and spec.granularity not in ("group", "block"):
        raise SchemeError(f"{where}: {spec.format} has fixed blocks of {BLOCK_FORMATS[spec.format]} along the "
                          f"input dimension; set granularity: group (got {spec.granularity!r})")
    if spec.format in BLOCK_FORMATS and spec.group_size != BLOCK_FORMATS[spec.format]:
        raise SchemeError(f"{where}: {spec.format} blocks are {BLOCK_FORMATS[spec.format]} elements "
                          f"(group_size={spec.group_size} given)")
    if spec.format in BLOCK_FORMATS and not spec.dynamic:
        raise SchemeError(f"{where}: {spec.format} computes its block scales from each block; a static "
                          "(calibrated) scale is not supported — set dynamic: true")
    if spec.granularity == "group" and spec.group_size <= 0:
        raise SchemeError(f"{where}.group_size={spec.group_size} must be positive")
    if role == "weights" and spec.granularity == "token":
        raise SchemeError(f"{where}.granularity=token is for activations; weights use channel/group/tensor/block")
    if role == "activations" and spec.granularity in ("channel", "block"):
        raise SchemeError(f"{where}.granularity={spec.granularity!r}: activations are quantized per token, "
                          "per group along the hidden dimension, or per tensor")


def input_multiple(spec: TensorQuantConfig) -> int:
    """The input size a weight's last dimension must be a multiple of (1 if none)."""
    if spec.format in BLOCK_FORMATS:
        return BLOCK_FORMATS[spec.format]
    if spec.granularity == "group" and not spec.ragged_groups:
        return spec.group_size
    return 1


def _ragged(x: Tensor, spec: TensorQuantConfig) -> bool:
    return ((spec.format == "int" or spec.format in FP8_FORMATS) and spec.granularity == "group"
            and bool(spec.ragged_groups) and x.shape[-1] % spec.group_size != 0)


def _fake_quantize_ragged(x: Tensor, spec: TensorQuantConfig) -> Tensor:
    """Groups of group_size along the last dim, the last group shorter (its own scale)."""
    full = x.shape[-1] - x.shape[-1] % spec.group_size
    if spec.format == "int":
        def quantize(part: Tensor, granularity: str) -> Tensor:
            return formats.int_quantize(part, spec.bits, symmetric=spec.symmetric, granularity=granularity,
                                        group_size=spec.group_size if granularity == "group" else None)
    else:
        def quantize(part: Tensor, granularity: str) -> Tensor:
            return formats.fp8_quantize(part, FP8_FORMATS[spec.format], granularity=granularity,
                                        group_size=spec.group_size)
    head = quantize(x[..., :full], "group") if full else x[..., :0]
    tail = quantize(x[..., full:], "channel" if spec.format == "int" else "token")
    return torch.cat([head, tail], dim=-1)


def fake_quantize(x: Tensor, spec: TensorQuantConfig, *, scale: Tensor | None = None) -> Tensor:
    """Quantize then dequantize ``x`` as ``spec`` says (same shape and dtype)."""
    if _ragged(x, spec):
        return _fake_quantize_ragged(x, spec)
    if spec.format == "int" and scale is not None:  # static (calibrated) symmetric scale
        return formats.int_fake_quant(x, scale, torch.zeros_like(scale), spec.bits, symmetric=True)
    if spec.format == "int":
        granularity = "token" if spec.granularity == "head" else spec.granularity
        return formats.int_quantize(x, spec.bits, symmetric=spec.symmetric, granularity=granularity,
                                    group_size=spec.group_size if granularity == "group" else None)
    if spec.format in FP8_FORMATS:
        granularity = "token" if spec.granularity == "head" else spec.granularity
        return formats.fp8_quantize(x, FP8_FORMATS[spec.format], granularity=granularity,
                                    group_size=spec.group_size, block_shape=tuple(spec.block_shape), scale=scale)
    if spec.format == "nvfp4":
        return formats.nvfp4_quantize(x)
    if spec.format == "mxfp4":
        return formats.mx_quantize(x, "fp4_e2m1", block_size=32)
    if spec.format == "mxfp8":
        return formats.mx_quantize(x, "fp8_e4m3", block_size=32)
    raise SchemeError(f"unknown format {spec.format!r}")


def storage_bits(spec: TensorQuantConfig, out_features: int, in_features: int) -> float:
    """Bits per weight of a [out, in] matrix stored in this format, scales included."""
    if spec.format == "int" and spec.granularity == "group" and in_features % spec.group_size:
        groups = -(-in_features // spec.group_size)  # ragged: ceil(in / g) scales (and zeros) per row
        per_group = spec.scale_bits + (0 if spec.symmetric else spec.bits)
        return spec.bits + groups * per_group / in_features
    return formats.bits_per_element(
        spec.format, bits=spec.bits, granularity=spec.granularity, group_size=spec.group_size,
        symmetric=spec.symmetric, in_features=in_features, out_features=out_features,
        scale_bits=spec.scale_bits, block_shape=tuple(spec.block_shape))
