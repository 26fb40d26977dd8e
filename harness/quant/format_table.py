"""The number-format table, and the one entry point from a tensor spec (config) to it.

Each number format (``int``, ``fp8_e4m3``, ``fp8_e5m2``, ``nvfp4``, ``mxfp4``, ``mxfp8``, or one a
plugin registers with :func:`register_format`) is one :class:`NumberFormat` entry: its grid's
largest magnitude, the granularities it supports, its fixed block size, how it quantizes,
how it rounds onto a given (calibrated) scale, and what it costs in storage. Everything that
depends on the format reads the entry: ``fake_quantize`` (weights and activations),
``validate_spec``, storage accounting (``storage_bits`` for a weight matrix, ``kv_bits`` for a
cached key or value, and so the ledger), the short label of reports (``label``), static activation
scales (``harness.quant.apply``) and the KV cache (``harness.quant.kv``). No code outside this table
branches on a format's name to answer these. The rounding math itself lives in
``harness.quant.format_math``.

Two kinds of entry: *scaled* formats (a scale, and for asymmetric int a zero point, per slice;
elements on a fixed grid) give ``round`` and ``qparams``, so they support static scales and the
KV cache; *block* formats (NVFP4, MX) compute their scales from each fixed block and give only
``quantize``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

from harness.config import TensorQuantConfig
from harness.errors import UserError
from harness.quant import format_math

__all__ = ["FORMATS", "NumberFormat", "SchemeError", "bits_per_element", "block_format", "fake_quantize", "fp8_format",
           "get_format", "input_multiple", "int_format", "kv_bits", "label", "register_format", "scale_overhead",
           "storage_bits", "unregister_format", "validate_spec"]

# (x, spec, granularity, include_zero) -> x on the grid; scales from x's own slices at ``granularity``.
# include_zero: asymmetric grids widen min/max to include 0 (False: KIVI's plain min/max, the KV cache's).
QuantizeFn = Callable[[Tensor, TensorQuantConfig, str, bool], Tensor]
# (x, spec, scale, zero or None) -> x on the grid of the given broadcastable scale; zero None: symmetric.
RoundFn = Callable[[Tensor, TensorQuantConfig, Tensor, "Tensor | None"], Tensor]
# (x, spec, dims, include_zero) -> (scale, zero or None) reduced over dims (kept), from finite values only.
QParamsFn = Callable[[Tensor, TensorQuantConfig, "tuple[int, ...]", bool], "tuple[Tensor, Tensor | None]"]
# (spec, out_features, in_features) -> storage bits per element, scales included. Either feature may be None
# (unknown): per-tensor scales then count as negligible. None as an entry's function: the generic accounting
# (:func:`default_storage_bits`) from the entry's element bits and scale layout.
StorageFn = Callable[[TensorQuantConfig, "int | None", "int | None"], float]
# spec -> the short name reports and coverage tables print (``int4 group128``, ``nvfp4``).
LabelFn = Callable[[TensorQuantConfig], str]


class SchemeError(UserError, ValueError):
    """A quantization scheme that makes no sense; the message says why and what to use."""


@dataclass(frozen=True)
class NumberFormat:
    """One number format: everything the harness asks about it."""

    name: str  # the value of quant.*.format
    max: Callable[[TensorQuantConfig], float]  # largest magnitude of the element grid (static scale = amax / max)
    element_bits: Callable[[TensorQuantConfig], float]  # bits of one element, scales excluded
    granularities: frozenset[str]  # of weights / activations (the KV cache adds "head" for scaled formats)
    quantize: QuantizeFn
    storage_bits: StorageFn | None = None  # None: default_storage_bits (element bits + the scales' share)
    round: RoundFn | None = None  # None: no static (calibrated) scales and no KV cache
    qparams: QParamsFn | None = None  # needed with round
    block_size: int | None = None  # elements along the last dim that share one scale, fixed by the format
    symmetric_only: bool = True  # False: asymmetric (zero point) grids are allowed
    bits_range: tuple[int, int] | None = None  # allowed quant.*.bits; None: the format fixes its width
    block_scale_bits: float = 8.0  # block formats: bits of each block's scale (E4M3 for NVFP4, E8M0 for MX)
    tensor_scale_bits: float = 0.0  # bits of one extra scale per tensor (NVFP4's fp32 global scale)
    default_scale_bits: int = 16  # scaled formats: bits of a scale when bits_per_element is given none
    label: LabelFn | None = None  # None: the name, then the granularity unless the format fixes its blocks

    @property
    def scaled(self) -> bool:
        """Rounds onto a given scale: supports static scales and the KV cache."""
        return self.round is not None and self.qparams is not None

    def describe(self, spec: TensorQuantConfig) -> str:
        """The short name of ``spec`` in reports: the entry's own label, or ``<name> <granularity>``."""
        if self.label is not None:
            return self.label(spec)
        if self.block_size is not None:
            return self.name
        grain = f"group{spec.group_size}" if spec.granularity == "group" else spec.granularity
        return f"{self.name} {grain}"

    def bits(self, spec: TensorQuantConfig, out_features: int | None, in_features: int | None) -> float:
        """Storage bits per element of an [out, in] matrix (either may be None), scales included."""
        if self.storage_bits is not None:
            return self.storage_bits(spec, out_features, in_features)
        return default_storage_bits(self, spec, out_features, in_features)


FORMATS: dict[str, NumberFormat] = {}


def register_format(fmt: NumberFormat) -> NumberFormat:
    """Add ``fmt`` to the table (a plugin module calls this on import; see quant.plugins)."""
    previous = FORMATS.get(fmt.name)
    if previous is not None and previous.quantize.__module__ != fmt.quantize.__module__:  # a reload may re-register
        raise ValueError(f"number format {fmt.name!r} is already registered by {previous.quantize.__module__}")
    if (fmt.round is None) != (fmt.qparams is None):
        raise ValueError(f"number format {fmt.name!r}: give both round and qparams (a scaled format) or neither")
    FORMATS[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove a format (tests that register a toy one)."""
    FORMATS.pop(name, None)


def get_format(name: str) -> NumberFormat:
    if name not in FORMATS:
        raise SchemeError(f"unknown format {name!r}; registered: {sorted(FORMATS)}")
    return FORMATS[name]


# ------------------------------------------------------------------------------ storage accounting
def scale_overhead(granularity: str, per_scale: float, *, group_size: int | None = None,
                   in_features: int | None = None, out_features: int | None = None,
                   block_shape: tuple[int, int] = (128, 128)) -> float:
    """Bits per element that the scales (``per_scale`` bits each, zero point included) add at ``granularity``.

    ``tensor``: one scale per matrix (0 unless both features are known); ``channel`` / ``token``: one
    per row of ``in_features``; ``group``: one per ``group_size`` inputs, ceil(in / g) per row when the
    last group is short (ragged groups); ``block``: one per 2-D tile, partial edge tiles counted when
    both features are known.
    """
    numel = in_features * out_features if in_features and out_features else None
    if granularity == "tensor":
        return per_scale / numel if numel else 0.0
    if granularity in ("channel", "token"):
        if not in_features:
            raise ValueError(f"granularity={granularity!r} needs in_features (elements per scale)")
        return per_scale / in_features
    if granularity == "group":
        if not group_size:
            raise ValueError("granularity='group' needs group_size, e.g. group_size=128")
        if in_features and in_features % group_size:
            return math.ceil(in_features / group_size) * per_scale / in_features
        return per_scale / group_size
    if granularity == "block":
        rows, cols = block_shape
        if numel:
            return per_scale * math.ceil(out_features / rows) * math.ceil(in_features / cols) / numel
        return per_scale / (rows * cols)
    raise ValueError(f"unknown granularity {granularity!r}; use tensor, channel, token, group or block")


def default_storage_bits(fmt: NumberFormat, spec: TensorQuantConfig, out_features: int | None,
                         in_features: int | None) -> float:
    """An entry's storage from its own facts: element bits plus the share of its scales.

    A block format: one ``block_scale_bits`` scale per fixed block, plus ``tensor_scale_bits`` per
    matrix (NVFP4 = 4 + 8/16 + 32/numel; MXFP4 = 4 + 8/32). A scaled format: ``spec.scale_bits`` per
    scale, and an asymmetric grid's zero point as wide as an element, at the spec's granularity.
    """
    elements = float(fmt.element_bits(spec))
    if fmt.block_size is not None:
        numel = in_features * out_features if in_features and out_features else None
        return elements + fmt.block_scale_bits / fmt.block_size + (fmt.tensor_scale_bits / numel if numel else 0.0)
    per_scale = spec.scale_bits + (0.0 if spec.symmetric else elements)
    return elements + scale_overhead(spec.granularity, per_scale, group_size=spec.group_size, in_features=in_features,
                                     out_features=out_features, block_shape=tuple(spec.block_shape))


# ------------------------------------------------------------------------------------ entry makers
def full_range(spec: TensorQuantConfig) -> bool:
    """Whether a symmetric int spec uses compressed-tensors' full signed range (``int_range: full``)."""
    return spec.int_range == "full"


def int_format(name: str = "int", bits: int | None = None) -> NumberFormat:
    """An integer grid (``harness.quant.format_math.int_*``): ``bits`` wide, or quant.*.bits (2..8) when None."""
    def width(spec: TensorQuantConfig) -> int:
        return spec.bits if bits is None else bits

    def quantize(x: Tensor, spec: TensorQuantConfig, granularity: str, include_zero: bool = True) -> Tensor:
        return format_math.int_quantize(x, width(spec), symmetric=spec.symmetric, granularity=granularity,
                                        group_size=spec.group_size if granularity == "group" else None,
                                        include_zero=include_zero, full_range=full_range(spec))

    def round_(x: Tensor, spec: TensorQuantConfig, scale: Tensor, zero: Tensor | None) -> Tensor:
        symmetric = zero is None or spec.symmetric
        zero = torch.zeros_like(scale) if zero is None else zero
        return format_math.int_fake_quant(x, scale, zero, width(spec), symmetric=symmetric, full_range=full_range(spec))

    def qparams(x: Tensor, spec: TensorQuantConfig, dims: tuple[int, ...], include_zero: bool
                ) -> tuple[Tensor, Tensor | None]:
        return format_math.int_qparams(x, width(spec), symmetric=spec.symmetric, dim=dims, include_zero=include_zero,
                                       full_range=full_range(spec))

    def label(spec: TensorQuantConfig) -> str:
        grain = f"group{spec.group_size}" if spec.granularity == "group" else spec.granularity
        return f"int{width(spec)}{'' if spec.symmetric else ' asym'} {grain}"

    return NumberFormat(name, max=lambda spec: float(2 ** (width(spec) - 1) - 1), element_bits=width,
                        granularities=frozenset({"tensor", "channel", "group", "token"}), quantize=quantize,
                        round=round_, qparams=qparams, symmetric_only=False,
                        bits_range=(2, 8) if bits is None else None, label=label)


def fp8_format(name: str, element: format_math.Fp8Format) -> NumberFormat:
    """Scaled FP8 (``format_math.fp8_quantize``): an fp32 scale per tensor, row, token, group or 2-D block."""
    fmax = format_math.FP8_MAX[element]

    def quantize(x: Tensor, spec: TensorQuantConfig, granularity: str, include_zero: bool = True) -> Tensor:
        return format_math.fp8_quantize(x, element, granularity=granularity, group_size=spec.group_size,
                                        block_shape=tuple(spec.block_shape))

    def round_(x: Tensor, spec: TensorQuantConfig, scale: Tensor, zero: Tensor | None) -> Tensor:
        return format_math.fp8_quantize(x, element, scale=scale)

    def qparams(x: Tensor, spec: TensorQuantConfig, dims: tuple[int, ...], include_zero: bool
                ) -> tuple[Tensor, Tensor | None]:
        amax = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(dim=dims, keepdim=True)
        return torch.where(amax > 0, amax / fmax, 1.0), None

    return NumberFormat(name, max=lambda spec: fmax, element_bits=lambda spec: 8.0,
                        granularities=frozenset({"tensor", "channel", "token", "group", "block"}),
                        quantize=quantize, round=round_, qparams=qparams, default_scale_bits=32)


def block_format(name: str, block_size: int, quantize: Callable[[Tensor], Tensor], element_max: float,
                 element_bits: float, *, tensor_scale_bits: float = 0.0) -> NumberFormat:
    """A format with fixed blocks along the last dim whose scales (8 bits each) come from each block (NVFP4, MX)."""
    return NumberFormat(name, max=lambda spec: element_max, element_bits=lambda spec: element_bits,
                        granularities=frozenset({"group", "block"}), block_size=block_size,
                        quantize=lambda x, spec, granularity, include_zero=True: quantize(x),
                        tensor_scale_bits=tensor_scale_bits)


for _entry in (
    int_format(),
    fp8_format("fp8_e4m3", "e4m3"),
    fp8_format("fp8_e5m2", "e5m2"),
    block_format("nvfp4", format_math.NVFP4_BLOCK_SIZE, format_math.nvfp4_quantize, format_math.E2M1_MAX, 4.0,
                 tensor_scale_bits=32.0),
    block_format("mxfp4", 32, lambda x: format_math.mx_quantize(x, "fp4_e2m1", block_size=32),
                 format_math.E2M1_MAX, 4.0),
    block_format("mxfp8", 32, lambda x: format_math.mx_quantize(x, "fp8_e4m3", block_size=32),
                 format_math.FP8_MAX["e4m3"], 8.0),
):
    register_format(_entry)


# --------------------------------------------------------------------------------- spec-level API
def validate_spec(spec: TensorQuantConfig, role: str) -> None:
    """Refuse nonsensical specs at config time. ``role`` is weights | activations | keys | values."""
    where = f"quant.{role}"
    if spec.format not in FORMATS:
        raise SchemeError(f"{where}.format={spec.format!r}: expected one of {sorted(FORMATS)}")
    fmt = FORMATS[spec.format]
    if spec.int_range not in ("restricted", "full"):
        raise SchemeError(f"{where}.int_range={spec.int_range!r}: use restricted (the harness's ±(2^(b-1)-1) codes) "
                          "or full (compressed-tensors' -2^(b-1)..2^(b-1)-1 with scale amax/((2^b-1)/2))")
    if spec.int_range == "full" and not (spec.symmetric and spec.format == "int"):
        raise SchemeError(f"{where}.int_range=full applies to symmetric int grids (asymmetric grids already use "
                          f"all 2^b codes; {spec.format} has no integer range); drop it or set symmetric: true")
    if fmt.bits_range is not None and not fmt.bits_range[0] <= spec.bits <= fmt.bits_range[1]:
        raise SchemeError(f"{where}.bits={spec.bits}: {fmt.name} supports {fmt.bits_range[0]}.."
                          f"{fmt.bits_range[1]} bits")
    if fmt.symmetric_only and not spec.symmetric:
        raise SchemeError(f"{where}: asymmetric {spec.format} makes no sense (floating-point grids are "
                          "symmetric around 0 and have no zero point); set symmetric: true or use format: int")
    allowed = fmt.granularities | ({"head"} if fmt.scaled and role in ("keys", "values") else set())
    if spec.granularity not in allowed and fmt.block_size is not None:
        raise SchemeError(f"{where}: {spec.format} has fixed blocks of {fmt.block_size} along the "
                          f"input dimension; set granularity: group (got {spec.granularity!r})")
    if spec.granularity not in allowed:
        raise SchemeError(f"{where}.granularity={spec.granularity!r}: {fmt.name} supports "
                          f"{sorted(fmt.granularities)}")
    if fmt.block_size is not None and spec.group_size != fmt.block_size:
        raise SchemeError(f"{where}: {spec.format} blocks are {fmt.block_size} elements "
                          f"(group_size={spec.group_size} given)")
    if not spec.dynamic and not fmt.scaled:
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
    block = get_format(spec.format).block_size
    if block is not None:
        return block
    if spec.granularity == "group" and not spec.ragged_groups:
        return spec.group_size
    return 1


def fake_quantize(x: Tensor, spec: TensorQuantConfig, *, scale: Tensor | None = None) -> Tensor:
    """Quantize then dequantize ``x`` as ``spec`` says (same shape and dtype).

    ``scale``: a static (calibrated) symmetric scale, broadcastable against ``x``. A group spec
    with ``ragged_groups`` whose group size does not divide the last dim gives the shorter last
    group its own scale.
    """
    fmt = get_format(spec.format)
    if (fmt.block_size is None and spec.granularity == "group" and spec.ragged_groups
            and x.shape[-1] % spec.group_size):
        full = x.shape[-1] - x.shape[-1] % spec.group_size
        head = fmt.quantize(x[..., :full], spec, "group", True) if full else x[..., :0]
        return torch.cat([head, fmt.quantize(x[..., full:], spec, "channel", True)], dim=-1)
    if scale is not None:
        if fmt.round is None:
            raise SchemeError(f"format {spec.format!r} has no static scales; set dynamic: true")
        return fmt.round(x, spec, scale, None)
    return fmt.quantize(x, spec, "token" if spec.granularity == "head" else spec.granularity, True)


def storage_bits(spec: TensorQuantConfig, out_features: int | None, in_features: int | None) -> float:
    """Bits per weight of a [out, in] matrix stored in this format, scales included."""
    return get_format(spec.format).bits(spec, out_features, in_features)


def label(spec: TensorQuantConfig) -> str:
    """The short name of a spec in reports: ``int4 group128``, ``fp8_e4m3 channel``, ``nvfp4``."""
    return get_format(spec.format).describe(spec)


def kv_bits(spec: TensorQuantConfig, head_dim: int, group_tokens: int) -> float:
    """Mean storage bits of one cached key or value element under ``spec``, scales and zero points included.

    Read as a matrix of one scale's elements: ``token`` granularity has one scale per token and head
    (a row of ``head_dim``), ``channel`` (KIVI keys) one per channel per ``group_tokens`` tokens,
    ``tensor`` and ``head`` a handful per layer, nothing per token.
    """
    if spec.granularity in ("tensor", "head"):
        return storage_bits(replace(spec, granularity="tensor"), None, None)
    elements = head_dim if spec.granularity == "token" else group_tokens
    return storage_bits(replace(spec, granularity="channel"), 1, elements)


def bits_per_element(fmt: str, *, bits: int = 8, granularity: str = "channel", group_size: int | None = None,
                     symmetric: bool = True, in_features: int | None = None, scale_bits: int | None = None,
                     block_shape: tuple[int, int] = (128, 128), out_features: int | None = None) -> float:
    """Storage bits per weight from keyword facts instead of a spec (the format's table entry answers).

    ``scale_bits`` defaults to the entry's (16 for int: fp16 scales; 32 for fp8: fp32 scales, as
    compressed-tensors and DeepSeek store them). Per-tensor scales count only when both ``in_features``
    and ``out_features`` are given. Examples: int4 g128 symmetric 4.125; nvfp4 4.5; mxfp4 4.25;
    mxfp8 8.25; fp8 block 8 + 32/16384.
    """
    if fmt not in FORMATS:
        raise SchemeError(f"unknown format {fmt!r}; registered: {sorted(FORMATS)}")
    entry = FORMATS[fmt]
    if granularity == "group" and not group_size and entry.block_size is None:
        raise ValueError("granularity='group' needs group_size, e.g. group_size=128")
    spec = TensorQuantConfig(format=fmt, bits=bits, symmetric=symmetric, granularity=granularity,
                             group_size=group_size or entry.block_size or 128, block_shape=list(block_shape),
                             scale_bits=entry.default_scale_bits if scale_bits is None else scale_bits)
    return entry.bits(spec, out_features, in_features)
