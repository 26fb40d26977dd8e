"""Number formats as pure tensor functions: simulated ("fake") quantization.

Every public quantizer quantizes and immediately dequantizes: it returns a tensor of the input's shape,
dtype and device whose values lie on the format's grid. Internally everything is float32. No module is
touched here; methods (RTN, GPTQ, AWQ, SmoothQuant, KV cache) call these functions.

Conventions shared by all functions, chosen so one bad element cannot silently damage its neighbours:

- Rounding is round-half-to-even (``torch.round`` and torch's float8 casts).
- Scales are computed from the *finite* values of each slice (tensor, row, group, block) only.
- NaN stays NaN in its own element and never spreads to its slice.
- ±Inf saturates to the largest magnitude of its slice's grid (the reference libraries would instead
  turn the slice's scale into Inf/NaN and the whole slice into NaN or zeros).
- A slice without any finite non-zero value dequantizes to zeros (NaN elements excepted), never NaN/Inf.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "E2M1_MAX",
    "FP8_MAX",
    "Granularity",
    "NVFP4_BLOCK_SIZE",
    "NVFP4_ZERO_BLOCK_SCALE",
    "e2m1_round",
    "fp8_cast",
    "fp8_quantize",
    "int_fake_quant",
    "int_qparams",
    "int_quantize",
    "mx_quantize",
    "nvfp4_global_scale",
    "nvfp4_quantize",
]

Granularity = Literal["tensor", "channel", "group", "token"]
Fp8Format = Literal["e4m3", "e5m2"]
MxElement = Literal["fp4_e2m1", "fp8_e4m3", "fp8_e5m2"]

FP8_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0}
_FP8_DTYPE: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
E2M1_MAX = 6.0
NVFP4_BLOCK_SIZE = 16
# compressed-tensors replaces a zero E4M3 block scale by finfo(float8_e4m3fn).eps = 0.125.
NVFP4_ZERO_BLOCK_SCALE = 0.125
# OCP MX v1.0: emax of each element format (exponent of its largest normal power of two).
_MX_ELEMENT_EMAX: dict[str, int] = {"fp4_e2m1": 2, "fp8_e4m3": 8, "fp8_e5m2": 15}
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127


# ----------------------------------------------------------------------------------------- helpers
def _finite_abs(x: Tensor) -> Tensor:
    """|x| with NaN and ±Inf replaced by 0, so that scales come from finite values only."""
    return x.abs().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # one fused pass (vs isfinite + where)


def _all_dims(x: Tensor) -> tuple[int, ...]:
    return tuple(range(x.ndim))


def _split_last(x: Tensor, size: int | None, name: str) -> Tensor:
    """View ``x`` as ``[..., n, size]`` groups of ``size`` consecutive elements of the last dim."""
    if size is None or not isinstance(size, int) or size <= 0:
        raise ValueError(f"{name} must be a positive integer, got {size!r}")
    last = x.shape[-1] if x.ndim else 0
    if x.ndim == 0 or last % size:
        raise ValueError(
            f"{name}={size} does not divide the last dimension ({last}) of a tensor of shape "
            f"{tuple(x.shape)}; pick a {name} that divides {last} or pad the tensor"
        )
    return x.reshape(*x.shape[:-1], last // size, size)


def _check_int_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 2 <= bits <= 16:
        raise ValueError(f"bits must be an integer in [2, 16], got {bits!r}")


def _fp8_spec(fmt: str) -> tuple[float, torch.dtype]:
    if fmt not in FP8_MAX:
        raise ValueError(f"unknown FP8 format {fmt!r}; use one of {sorted(FP8_MAX)}")
    return FP8_MAX[fmt], _FP8_DTYPE[fmt]


@functools.lru_cache(maxsize=None)
def _fp8_decode_table(dtype: torch.dtype) -> Tensor:
    """float32 value of each of the 256 codes of an FP8 dtype, from torch's own cast (CPU)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)


def _fp8_round(x: Tensor, fmt: str, *, overwrite: bool = False) -> Tensor:
    """Saturating float32 → FP8 → float32 round trip (see :func:`fp8_cast`).

    On CPU the FP8 → float32 cast is a slow scalar loop; decoding the codes through a 256-entry
    table built from that very cast gives the same values (bitwise) about 4x faster.
    ``overwrite=True`` lets the clamp reuse ``x`` (a temporary of the caller's).
    """
    fmax, dtype = _fp8_spec(fmt)
    encoded = (x.clamp_(-fmax, fmax) if overwrite else x.clamp(-fmax, fmax)).to(dtype)
    if encoded.device.type != "cpu":
        return encoded.to(torch.float32)
    codes = encoded.view(torch.uint8).reshape(-1).to(torch.int32)
    return _fp8_decode_table(dtype).index_select(0, codes).reshape(encoded.shape)


def _exp2_int(exponent: Tensor) -> Tensor:
    """Exact float32 2**e for integer e in [-127, 127], built from the bit pattern.

    Bit construction instead of ``torch.exp2`` because approximate exp2 kernels are not guaranteed
    to return exact powers of two on every device.
    """
    normal = ((exponent.clamp(-126, 127) + 127).to(torch.int32) << 23).view(torch.float32)
    return torch.where(exponent < -126, normal * 0.5, normal)


# ------------------------------------------------------------------------------------------ integer
def int_qparams(
    x: Tensor,
    bits: int,
    *,
    symmetric: bool,
    dim: int | tuple[int, ...] | None,
    include_zero: bool = True,
    full_range: bool = False,
) -> tuple[Tensor, Tensor]:
    """Scale and zero point of a b-bit integer grid, reducing over ``dim`` (kept as size 1).

    ``dim=None`` reduces the whole tensor. Returns float32 ``(scale, zero)``; ``zero`` holds integers.

    - Symmetric: ``scale = amax / (2^(b-1) - 1)``, ``zero = 0``, restricted range
      ``q ∈ [-(2^(b-1)-1), 2^(b-1)-1]``: the code -2^(b-1) is never produced, so the grid is symmetric
      around 0 (llm-awq ``zero_point=False`` and SmoothQuant's absmax INT8 produce the same values).
      IST-DASLab gptq's symmetric mode instead uses all 2^b codes with scale ``2·amax/(2^b-1)``.
    - Symmetric with ``full_range=True``: compressed-tensors' (llm-compressor's) convention,
      ``scale = amax / ((2^b - 1) / 2)`` (amax/7.5 at 4 bits) and ``q ∈ [-2^(b-1), 2^(b-1)-1]``.
    - Asymmetric: ``scale = (max - min) / (2^b - 1)``, ``zero = round(-min / scale)``, ``q ∈ [0, 2^b-1]``.
      With ``include_zero=True`` (default) min/max are first widened to include 0, as IST-DASLab gptq
      ``quant.py`` does, so 0 is exactly representable and ``zero`` lies in ``[0, 2^b-1]``.
      ``include_zero=False`` follows llm-awq's min/max without widening; the zero point is then *not*
      clamped (llm-awq clamps it, which clips slices of one sign) and may lie outside ``[0, 2^b-1]``.
    - Degenerate slices: a constant slice (max == min) is widened to include 0, so it is reproduced
      exactly; an all-zero (or all non-finite) slice gets ``scale = 1, zero = 0`` (gptq uses a ±1
      range there; dequantized values are zeros either way). Scales are never 0, NaN or Inf for
      finite inputs (statistics ignore NaN/Inf elements).
    """
    _check_int_bits(bits)
    xf = x.to(torch.float32)
    dims = _all_dims(xf) if dim is None else dim
    if symmetric:
        amax = _finite_abs(xf).amax(dim=dims, keepdim=True)
        top = (2**bits - 1) / 2 if full_range else 2 ** (bits - 1) - 1
        scale = torch.where(amax > 0, amax / top, 1.0)
        return scale, torch.zeros_like(scale)
    finite = torch.isfinite(xf)
    xmin = torch.where(finite, xf, float("inf")).amin(dim=dims, keepdim=True)
    xmax = torch.where(finite, xf, float("-inf")).amax(dim=dims, keepdim=True)
    empty = xmin > xmax
    xmin, xmax = torch.where(empty, 0.0, xmin), torch.where(empty, 0.0, xmax)
    widen = (xmin == xmax) | include_zero
    xmin = torch.where(widen, xmin.clamp(max=0.0), xmin)
    xmax = torch.where(widen, xmax.clamp(min=0.0), xmax)
    span = xmax - xmin
    scale = torch.where(span > 0, span / (2**bits - 1), 1.0)
    return scale, torch.round(-xmin / scale)


def int_fake_quant(x: Tensor, scale: Tensor, zero: Tensor, bits: int, *, symmetric: bool,
                   full_range: bool = False) -> Tensor:
    """Round ``x`` onto the integer grid given by ``scale``/``zero`` and dequantize.

    The reference gptq ``quantize(x, scale, zero, maxq)``: ``q = clamp(round(x/scale) + zero)``,
    returns ``(q - zero) · scale``. Ties round half to even. Values beyond the grid saturate (±Inf to
    the grid's end points); NaN stays NaN. ``scale`` and ``zero`` must broadcast against ``x``.
    Ranges as in :func:`int_qparams` (restricted symmetric, ``[0, 2^b-1]`` asymmetric).
    """
    _check_int_bits(bits)
    xf = x.to(torch.float32)
    scale = scale.to(device=xf.device, dtype=torch.float32)
    zero = zero.to(device=xf.device, dtype=torch.float32)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        qmin = -(qmax + 1) if full_range else -qmax  # full_range: compressed-tensors' signed range
        out = (xf / scale).round_().clamp_(qmin, qmax).mul_(scale)  # in place on the fresh quotient
    else:
        q = torch.clamp(torch.round(xf / scale) + zero, 0, 2**bits - 1)
        out = (q - zero) * scale
    return out.to(x.dtype)


def int_quantize(
    x: Tensor,
    bits: int,
    *,
    symmetric: bool = True,
    granularity: Granularity = "channel",
    group_size: int | None = None,
    include_zero: bool = True,
    full_range: bool = False,
) -> Tensor:
    """Round-to-nearest integer quantization of a weight or activation tensor.

    Weights are ``[out_features, in_features]``. ``"channel"``: one scale per row (reduce the last dim);
    ``"group"``: one scale per ``group_size`` consecutive elements of the last dim (ValueError if it
    does not divide); ``"token"``: activations ``[..., hidden]``, one scale per vector along the last
    dim (same math as channel); ``"tensor"``: one scale. Grid, degenerate-slice and NaN/Inf
    conventions: :func:`int_qparams` and :func:`int_fake_quant`.
    """
    if granularity == "group":
        view, dim = _split_last(x, group_size, "group_size"), -1
    elif granularity in ("channel", "token"):
        view, dim = x, -1
    elif granularity == "tensor":
        view, dim = x, None
    else:
        raise ValueError(f"unknown granularity {granularity!r}; use tensor, channel, group or token")
    scale, zero = int_qparams(view, bits, symmetric=symmetric, dim=dim, include_zero=include_zero,
                              full_range=full_range)
    return int_fake_quant(view, scale, zero, bits, symmetric=symmetric, full_range=full_range).reshape(x.shape)


# --------------------------------------------------------------------------------------------- FP8
def fp8_cast(x: Tensor, fmt: Fp8Format = "e4m3") -> Tensor:
    """Saturating round trip through ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``.

    Clamps to ±448 (E4M3) or ±57344 (E5M2) first, as compressed-tensors and vLLM do: torch's cast is
    not guaranteed to saturate (older versions turn overflow into NaN). Rounds to nearest, ties to
    even, including E4M3 subnormals down to 2^-9. NaN stays NaN; ±Inf saturates to ±max.
    """
    return _fp8_round(x.to(torch.float32), fmt).to(x.dtype)


def _fp8_block_scales(x: Tensor, fmt: str, block_shape: tuple[int, int]) -> Tensor:
    """Per-tile scales amax/fmt_max of a 2-D tensor, expanded back to ``x``'s shape."""
    if x.ndim != 2:
        raise ValueError(f"block granularity needs a 2-D weight, got shape {tuple(x.shape)}")
    if len(block_shape) != 2 or any(not isinstance(b, int) or b <= 0 for b in block_shape):
        raise ValueError(f"block_shape must be two positive integers, got {block_shape!r}")
    rows, cols = block_shape
    m, n = x.shape
    pad_rows, pad_cols = (-m) % rows, (-n) % cols
    padded = torch.nn.functional.pad(_finite_abs(x), (0, pad_cols, 0, pad_rows))
    tiles = padded.reshape((m + pad_rows) // rows, rows, (n + pad_cols) // cols, cols)
    amax = tiles.amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX[fmt], 1.0)
    return scale.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)[:m, :n]


def fp8_quantize(
    x: Tensor,
    fmt: Fp8Format = "e4m3",
    *,
    granularity: Literal["tensor", "channel", "token", "group", "block"] = "tensor",
    group_size: int = 128,
    block_shape: tuple[int, int] = (128, 128),
    scale: Tensor | None = None,
) -> Tensor:
    """Scaled FP8 quantization: ``fp8_cast(x / scale) · scale`` with ``scale = amax / fmt_max``.

    Granularity: ``"tensor"`` one scale; ``"channel"``/``"token"`` one per vector along the last dim
    (per output channel for ``[out, in]`` weights, per token for activations: "FP8_DYNAMIC");
    ``"group"`` one per ``group_size`` elements of the last dim (ValueError if it does not divide);
    ``"block"`` one per ``block_shape`` tile of a 2-D weight (DeepSeek-style "FP8_BLOCK"). Shapes that
    tiles do not divide get partial edge tiles, each scaled by its own elements (ceil-div scale grid,
    as DeepSeek-V3 and vLLM store it). Scales are float32 and not themselves rounded
    (compressed-tensors). ``amax = 0`` gives scale 1 (zeros stay zeros).

    A given ``scale`` (static, calibrated) overrides the dynamic one and ``granularity`` is not used:
    it must broadcast against ``x`` (expand group/block scales with ``repeat_interleave``) and be
    positive and finite. Element rounding, saturation and NaN/Inf handling: :func:`fp8_cast`.
    """
    fmax, _ = _fp8_spec(fmt)
    xf = x.to(torch.float32)
    if scale is not None:
        static = scale.to(device=xf.device, dtype=torch.float32)
        if not bool(torch.all(torch.isfinite(static) & (static > 0))):
            raise ValueError("a static FP8 scale must be positive and finite; recalibrate it")
        return (_fp8_round(xf / static, fmt) * static).to(x.dtype)
    if granularity == "block":
        dynamic = _fp8_block_scales(xf, fmt, block_shape)
        return _fp8_round(xf / dynamic, fmt, overwrite=True).mul_(dynamic).to(x.dtype)
    if granularity == "group":
        view, dims = _split_last(xf, group_size, "group_size"), (-1,)
    elif granularity in ("channel", "token"):
        view, dims = xf, (-1,)
    elif granularity == "tensor":
        view, dims = xf, _all_dims(xf)
    else:
        raise ValueError(f"unknown granularity {granularity!r}; use tensor, channel, token, group or block")
    amax = _finite_abs(view).amax(dim=dims, keepdim=True)
    dynamic = torch.where(amax > 0, amax / fmax, 1.0)
    return _fp8_round(view / dynamic, fmt, overwrite=True).mul_(dynamic).reshape(x.shape).to(x.dtype)


# --------------------------------------------------------------------------------------- FP4 / MX
def e2m1_round(x: Tensor) -> Tensor:
    """Round to the FP4 E2M1 grid ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} (no scaling).

    Round to nearest, ties to the even mantissa (0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4),
    matching compressed-tensors' and torchao's FP4 casts. Saturates at ±6 (±Inf → ±6); NaN stays
    NaN; the sign of zero is kept.
    """
    xf = x.to(torch.float32)
    magnitude = xf.abs().clamp_(max=E2M1_MAX)
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    return (magnitude / step).round_().mul_(step).copysign_(xf).to(x.dtype)


def nvfp4_global_scale(x: Tensor) -> Tensor:
    """compressed-tensors' per-tensor NVFP4 global scale ``gs = 448·6 / amax`` (float32 scalar).

    A multiplier (not a divisor). ``amax`` is over finite values; amax 0 gives 1; the result is
    clamped to the float32 maximum so that tensors with amax below ~1e-35 do not give Inf.
    """
    amax = _finite_abs(x.to(torch.float32)).amax()
    gs = torch.where(amax > 0, FP8_MAX["e4m3"] * E2M1_MAX / amax, 1.0)
    return gs.clamp(max=torch.finfo(torch.float32).max)


def nvfp4_quantize(x: Tensor, *, global_scale: Tensor | float | None = None) -> Tensor:
    """NVFP4: blocks of 16 along the last dim, E4M3 block scales, one FP32 global scale.

    compressed-tensors convention: ``gs`` from :func:`nvfp4_global_scale` unless given;
    ``s_b = e4m3(clamp(gs·amax_b/6, ±448))`` (saturating, nearest-even); effective scale
    ``s_b / gs``; ``q = e2m1(clamp(x / (s_b/gs), ±6))``; output ``q · s_b / gs``.
    A block scale that rounds to 0 in E4M3 (all-zero block, or a block below ~2^-10·6/gs) is replaced
    by :data:`NVFP4_ZERO_BLOCK_SCALE` = 0.125 as compressed-tensors does (modelopt uses 1.0, torchao
    clamps to 2^-6); such blocks dequantize to zeros. NaN/Inf as in the module docstring: an Inf
    becomes ``±6·s_b/gs`` of its block. Raises ValueError if the last dim is not a multiple of 16.
    """
    xf = x.to(torch.float32)
    blocks = _split_last(xf, NVFP4_BLOCK_SIZE, "the NVFP4 block size")
    if global_scale is None:
        gs = nvfp4_global_scale(xf)
    else:
        gs = torch.as_tensor(global_scale, dtype=torch.float32, device=xf.device)
    amax = _finite_abs(blocks).amax(dim=-1, keepdim=True)
    block_scale = _fp8_round(gs * (amax / E2M1_MAX), "e4m3")  # compressed-tensors' order: ties in E4M3 agree
    block_scale = torch.where(block_scale == 0, NVFP4_ZERO_BLOCK_SCALE, block_scale)
    scale = block_scale / gs
    q = e2m1_round((blocks / scale).clamp_(-E2M1_MAX, E2M1_MAX))
    return q.mul_(scale).reshape(x.shape).to(x.dtype)


def mx_quantize(x: Tensor, elem: MxElement = "fp4_e2m1", *, block_size: int = 32) -> Tensor:
    """OCP Microscaling (MX v1.0) block quantization along the last dim: MXFP4 / MXFP8.

    Each block of ``block_size`` shares an E8M0 scale ``X = 2^(floor(log2 amax_b) - emax_elem)``
    (emax: E2M1 2, E4M3 8, E5M2 15), the spec's FLOOR mode (also torchao's default); the exponent is
    clamped to E8M0's range [-127, 127] and ``floor(log2)`` is taken exactly (``frexp``). Elements are
    ``x / X`` rounded to nearest-even in the element format and saturated at its max (6, 448, 57344):
    with FLOOR scales the block max can reach up to ~1.33× the element max and clips. All-zero blocks
    give zeros. NaN/Inf follow the module convention; the spec would instead make a block with
    NaN/Inf all NaN. Raises ValueError if ``block_size`` does not divide the last dim.
    """
    if elem not in _MX_ELEMENT_EMAX:
        raise ValueError(f"unknown MX element format {elem!r}; use one of {sorted(_MX_ELEMENT_EMAX)}")
    xf = x.to(torch.float32)
    blocks = _split_last(xf, block_size, "block_size")
    amax = _finite_abs(blocks).amax(dim=-1, keepdim=True)
    _, exponent = torch.frexp(amax)  # amax = m · 2^exponent, m in [0.5, 1): floor(log2 amax) = exponent - 1
    shared = torch.where(amax > 0, exponent - 1 - _MX_ELEMENT_EMAX[elem], 0)
    shared = shared.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
    scaled = blocks * _exp2_int(-shared)
    q = e2m1_round(scaled) if elem == "fp4_e2m1" else _fp8_round(scaled, elem.removeprefix("fp8_"))
    return (q * _exp2_int(shared)).reshape(x.shape).to(x.dtype)
