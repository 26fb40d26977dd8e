"""Recovering the quantization grid of the harness's dequantized weights, for the export.

The harness keeps dequantized (fake-quantized) weights, not codes; compressed-tensors stores codes
and scales. Each function here finds scales on which every value of a weight is exactly
representable (:func:`recover_int_grid`, :func:`recover_fp8_scale`, :func:`recover_nvfp4`), or
raises :class:`ExportError` naming the worst group. ``harness.checkpoint.export`` uses them and checks the
result by decompressing its own output with compressed-tensors.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from harness.errors import UsageError
from harness.quant import format_math

REPRESENTABLE = ("int weights (4 or 8 bits; channel or group; symmetric or asymmetric; groups that divide every "
                 "input size), no activation quantization: RTN, GPTQ, AWQ, SmoothQuant-smoothed",
                 "int8 symmetric channel weights with int8 dynamic per-token activations (int8_w8a8, int8_w8a8_sq)",
                 "fp8_e4m3 weights (tensor or channel), optionally with fp8_e4m3 dynamic per-token activations",
                 "nvfp4 weights (blocks of 16), optionally with nvfp4 dynamic activations (nvfp4_w4a16, nvfp4)",
                 "any of these (or no weight quantization) with an fp8_e4m3 KV cache of static per-tensor scales "
                 "(kv8, *_kv8)")


class ExportError(UsageError):
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


# E2M1 magnitudes a block's largest element can land on (6 for every block whose E4M3 scale is
# normal; smaller ones when the scale is an E4M3 subnormal and rounded far from gs·amax/6).
_E2M1_TOPS = (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5)


def _nvfp4_blocks(blocks: Tensor, gs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Best E4M3 block scales for global scale ``gs``, and each block's largest error (in ``dtype``).

    compressed-tensors dequantizes ``e2m1 · (s_b / gs)`` in float32 and casts to ``dtype``: for each
    candidate top code the block scale is ``e4m3(gs · amax_b / top)``; the first that reproduces the
    block exactly wins (the smallest error otherwise).
    """
    amax = blocks.abs().amax(-1, keepdim=True)
    best_scale = torch.full_like(amax, format_math.NVFP4_ZERO_BLOCK_SCALE)
    best_error = torch.full_like(amax, float("inf"))
    for top in _E2M1_TOPS:
        scale = format_math.fp8_cast(gs * amax / top, "e4m3")
        scale = torch.where(scale == 0, format_math.NVFP4_ZERO_BLOCK_SCALE, scale)  # all-zero blocks, as the harness
        step = scale / gs
        codes = format_math.e2m1_round((blocks / step).clamp(-format_math.E2M1_MAX, format_math.E2M1_MAX))
        error = ((codes * step).to(dtype).to(torch.float32) - blocks).abs().amax(-1, keepdim=True)
        better = error < best_error
        best_scale = torch.where(better, scale, best_scale)
        best_error = torch.where(better, error, best_error)
    return best_scale[..., 0], best_error[..., 0]


def recover_nvfp4(weight: Tensor, *, search_ulps: int = 64) -> tuple[Tensor, Tensor, float]:
    """E4M3 block scales [out, in/16] (as float32), the float32 global scale [1], and the max error.

    NVFP4 (harness and compressed-tensors alike): ``gs = 448·6 / amax`` over the tensor,
    ``s_b = e4m3(gs · amax_b / 6)``, values ``e2m1 · (s_b / gs)``. The largest dequantized value is
    ``6 · (448 / gs)`` in float32 rounding, so ``448·6 / max|w|`` gives ``gs`` to a few float32 ulps
    only; the ulps around it are tried (nearest first) until every block is reproduced exactly in
    the weight's dtype. Without an exact candidate (weights not on an NVFP4 grid, or a bf16/fp16
    model whose rounding hides ``gs``) the best candidate is returned with its max error, and the
    caller decides. Raises :class:`ExportError` if the input dim is not a multiple of 16.
    """
    if weight.shape[-1] % format_math.NVFP4_BLOCK_SIZE:
        raise _unsupported(f"nvfp4 weights with {weight.shape[-1]} input features (not a multiple of 16)")
    w = weight.detach().to(torch.float32)
    blocks = w.reshape(w.shape[0], -1, format_math.NVFP4_BLOCK_SIZE)
    top = w.abs().max()
    if not bool(top > 0):
        one = torch.ones(1)
        return torch.full(blocks.shape[:2], format_math.NVFP4_ZERO_BLOCK_SCALE), one, 0.0
    estimate = (format_math.FP8_MAX["e4m3"] * format_math.E2M1_MAX / top).reshape(1)
    best: tuple[Tensor, Tensor, float] | None = None
    up, down = estimate.clone(), estimate.clone()
    candidates = [estimate]
    for _ in range(search_ulps):
        up, down = torch.nextafter(up, torch.full_like(up, math.inf)), torch.nextafter(down, torch.zeros_like(down))
        candidates += [up, down]
    for gs in candidates:
        scales, errors = _nvfp4_blocks(blocks, gs, weight.dtype)
        error = float(errors.max())
        if best is None or error < best[2]:
            best = (scales, gs.clone(), error)
        if error == 0.0:
            break
    assert best is not None
    return best
