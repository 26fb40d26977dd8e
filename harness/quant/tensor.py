"""The number-format table, and the one entry point from a tensor spec (config) to it.

Each number format (``int``, ``fp8_e4m3``, ``fp8_e5m2``, ``nvfp4``, ``mxfp4``, ``mxfp8``, or one a
plugin registers with :func:`register_format`) is one :class:`NumberFormat` entry: its grid's
largest magnitude, the granularities it supports, its fixed block size, how it quantizes,
how it rounds onto a given (calibrated) scale, and what it costs in storage. Everything that
depends on the format reads the entry: ``fake_quantize`` (weights and activations),
``validate_spec``, ``storage_bits``, static activation scales (``harness.quant.apply``) and the
KV cache (``harness.quant.kv``). The math itself lives in ``harness.quant.formats``.

Two kinds of entry: *scaled* formats (a scale, and for asymmetric int a zero point, per slice;
elements on a fixed grid) give ``round`` and ``qparams``, so they support static scales and the
KV cache; *block* formats (NVFP4, MX) compute their scales from each fixed block and give only
``quantize``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from harness.config import TensorQuantConfig
from harness.errors import UserError
from harness.quant import formats

__all__ = ["FORMATS", "NumberFormat", "SchemeError", "block_format", "fake_quantize", "fp8_format", "get_format",
           "input_multiple", "int_format", "register_format", "storage_bits", "unregister_format", "validate_spec"]

# (x, spec, granularity, include_zero) -> x on the grid; scales from x's own slices at ``granularity``.
# include_zero: asymmetric grids widen min/max to include 0 (False: KIVI's plain min/max, the KV cache's).
QuantizeFn = Callable[[Tensor, TensorQuantConfig, str, bool], Tensor]
# (x, spec, scale, zero or None) -> x on the grid of the given broadcastable scale; zero None: symmetric.
RoundFn = Callable[[Tensor, TensorQuantConfig, Tensor, "Tensor | None"], Tensor]
# (x, spec, dims, include_zero) -> (scale, zero or None) reduced over dims (kept), from finite values only.
QParamsFn = Callable[[Tensor, TensorQuantConfig, "tuple[int, ...]", bool], "tuple[Tensor, Tensor | None]"]
# (spec, out_features, in_features) -> storage bits per element, scales included.
StorageFn = Callable[[TensorQuantConfig, int, int], float]


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
    storage_bits: StorageFn
    round: RoundFn | None = None  # None: no static (calibrated) scales and no KV cache
    qparams: QParamsFn | None = None  # needed with round
    block_size: int | None = None  # elements along the last dim that share one scale, fixed by the format
    symmetric_only: bool = True  # False: asymmetric (zero point) grids are allowed
    bits_range: tuple[int, int] | None = None  # allowed quant.*.bits; None: the format fixes its width

    @property
    def scaled(self) -> bool:
        """Rounds onto a given scale: supports static scales and the KV cache."""
        return self.round is not None and self.qparams is not None


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


# ------------------------------------------------------------------------------------ entry makers
def full_range(spec: TensorQuantConfig) -> bool:
    """Whether a symmetric int spec uses compressed-tensors' full signed range (``int_range: full``)."""
    return spec.int_range == "full"


def int_format(name: str = "int", bits: int | None = None) -> NumberFormat:
    """An integer grid (``harness.quant.formats.int_*``): ``bits`` wide, or quant.*.bits (2..8) when None."""
    def width(spec: TensorQuantConfig) -> int:
        return spec.bits if bits is None else bits

    def quantize(x: Tensor, spec: TensorQuantConfig, granularity: str, include_zero: bool = True) -> Tensor:
        return formats.int_quantize(x, width(spec), symmetric=spec.symmetric, granularity=granularity,
                                    group_size=spec.group_size if granularity == "group" else None,
                                    include_zero=include_zero, full_range=full_range(spec))

    def round_(x: Tensor, spec: TensorQuantConfig, scale: Tensor, zero: Tensor | None) -> Tensor:
        symmetric = zero is None or spec.symmetric
        zero = torch.zeros_like(scale) if zero is None else zero
        return formats.int_fake_quant(x, scale, zero, width(spec), symmetric=symmetric, full_range=full_range(spec))

    def qparams(x: Tensor, spec: TensorQuantConfig, dims: tuple[int, ...], include_zero: bool
                ) -> tuple[Tensor, Tensor | None]:
        return formats.int_qparams(x, width(spec), symmetric=spec.symmetric, dim=dims, include_zero=include_zero,
                                   full_range=full_range(spec))

    def storage(spec: TensorQuantConfig, out_features: int, in_features: int) -> float:
        if spec.granularity == "group" and in_features % spec.group_size:
            groups = -(-in_features // spec.group_size)  # ragged: ceil(in / g) scales (and zeros) per row
            per_group = spec.scale_bits + (0 if spec.symmetric else width(spec))
            return width(spec) + groups * per_group / in_features
        return formats.bits_per_element(
            "int", bits=width(spec), granularity=spec.granularity, group_size=spec.group_size,
            symmetric=spec.symmetric, in_features=in_features, out_features=out_features,
            scale_bits=spec.scale_bits, block_shape=tuple(spec.block_shape))

    return NumberFormat(name, max=lambda spec: float(2 ** (width(spec) - 1) - 1), element_bits=width,
                        granularities=frozenset({"tensor", "channel", "group", "token"}), quantize=quantize,
                        storage_bits=storage, round=round_, qparams=qparams, symmetric_only=False,
                        bits_range=(2, 8) if bits is None else None)


def fp8_format(name: str, element: formats.Fp8Format) -> NumberFormat:
    """Scaled FP8 (``formats.fp8_quantize``): an fp32 scale per tensor, row, token, group or 2-D block."""
    fmax = formats.FP8_MAX[element]

    def quantize(x: Tensor, spec: TensorQuantConfig, granularity: str, include_zero: bool = True) -> Tensor:
        return formats.fp8_quantize(x, element, granularity=granularity, group_size=spec.group_size,
                                    block_shape=tuple(spec.block_shape))

    def round_(x: Tensor, spec: TensorQuantConfig, scale: Tensor, zero: Tensor | None) -> Tensor:
        return formats.fp8_quantize(x, element, scale=scale)

    def qparams(x: Tensor, spec: TensorQuantConfig, dims: tuple[int, ...], include_zero: bool
                ) -> tuple[Tensor, Tensor | None]:
        amax = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(dim=dims, keepdim=True)
        return torch.where(amax > 0, amax / fmax, 1.0), None

    def storage(spec: TensorQuantConfig, out_features: int, in_features: int) -> float:
        return formats.bits_per_element(name, granularity=spec.granularity, group_size=spec.group_size,
                                        in_features=in_features, out_features=out_features,
                                        scale_bits=spec.scale_bits, block_shape=tuple(spec.block_shape))

    return NumberFormat(name, max=lambda spec: fmax, element_bits=lambda spec: 8.0,
                        granularities=frozenset({"tensor", "channel", "token", "group", "block"}),
                        quantize=quantize, storage_bits=storage, round=round_, qparams=qparams)


def block_format(name: str, block_size: int, quantize: Callable[[Tensor], Tensor], element_max: float,
                 element_bits: float) -> NumberFormat:
    """A format with fixed blocks along the last dim whose scales come from each block (NVFP4, MX)."""
    def storage(spec: TensorQuantConfig, out_features: int, in_features: int) -> float:
        return formats.bits_per_element(name, group_size=spec.group_size, in_features=in_features,
                                        out_features=out_features)

    return NumberFormat(name, max=lambda spec: element_max, element_bits=lambda spec: element_bits,
                        granularities=frozenset({"group", "block"}), block_size=block_size,
                        quantize=lambda x, spec, granularity, include_zero=True: quantize(x), storage_bits=storage)


for _entry in (
    int_format(),
    fp8_format("fp8_e4m3", "e4m3"),
    fp8_format("fp8_e5m2", "e5m2"),
    block_format("nvfp4", formats.NVFP4_BLOCK_SIZE, formats.nvfp4_quantize, formats.E2M1_MAX, 4.0),
    block_format("mxfp4", 32, lambda x: formats.mx_quantize(x, "fp4_e2m1", block_size=32), formats.E2M1_MAX, 4.0),
    block_format("mxfp8", 32, lambda x: formats.mx_quantize(x, "fp8_e4m3", block_size=32),
                 formats.FP8_MAX["e4m3"], 8.0),
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


def storage_bits(spec: TensorQuantConfig, out_features: int, in_features: int) -> float:
    """Bits per weight of a [out, in] matrix stored in this format, scales included."""
    return get_format(spec.format).storage_bits(spec, out_features, in_features)
