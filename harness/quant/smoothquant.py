"""SmoothQuant [Xiao et al. 2023; mit-han-lab/smoothquant ``smooth.py``] for INT8 (or FP8) W8A8.

Activations of LLMs have a few channels with outliers that a per-token scale cannot absorb; weights
are easy to quantize. SmoothQuant migrates part of the difficulty: for the linears that read one
norm's output, every input channel j is divided by ``s_j`` in the activation and multiplied by
``s_j`` in the weights, with

    s_j = max|X_j|^α / max|W_:,j|^(1−α)

(``max|X_j|`` over calibration tokens, ``max|W_:,j|`` over all linears of the group). Dividing the
activation is free: it is folded into the norm's weight (Llama ``x·w`` → ``w/s``; Gemma
``x·(1+w)`` → ``(1+w)/s − 1``; a norm bias is divided too). The transformation is exact in real
arithmetic, so with quantization disabled the model's outputs are unchanged up to float rounding.
Only norm-fed groups are smoothed (q/k/v and gate/up), as the reference does for Llama.

Collect, then solve: :func:`collect_input_maxima` records the maxima with hooks during forward
passes over ``context.calibration_batches()``; :func:`smooth_model` folds the scales; then the
weights are rounded to nearest with ``scheme.weights`` (:func:`harness.quant.rtn.quantize_weights_rtn`).
The activation quantizer is installed afterwards by ``harness.quant.apply`` and sees the smoothed
inputs. The norm→linears mapping comes from :mod:`harness.quant.architectures`.

Deviation from the reference: a channel whose activation or weight maximum is 0 (dead in the
calibration text) keeps ``s = 1`` instead of the reference's clamp to 1e-5, which would blow the
norm weight up by 10^5 for a channel that may wake up on other text.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from harness.config import QuantConfig
from harness.models.hooks import forward_pre_hooks, run_batches
from harness.quant.architectures import get_adapter, has_modules
from harness.quant.format_table import SchemeError
from harness.quant.methods import COMPRESSED_TENSORS, method_settings, register_method
from harness.quant.report import QuantReport
from harness.quant.rtn import quantize_weights_rtn
from harness.quant.targets import target_linears

log = logging.getLogger(__name__)

__all__ = ["SmoothGroup", "SmoothQuantSettings", "collect_input_maxima", "smooth_groups", "smooth_model",
           "smoothing_scales"]

_MIN_SCALE = 1e-5  # the reference's clamp of the weight maxima and of s


@dataclass
class SmoothQuantSettings:
    """``quant.settings`` of ``quant.method=smoothquant``."""

    alpha: float = 0.5  # migration strength; 0.8-0.9 for larger models


@dataclass(frozen=True)
class SmoothGroup:
    """A norm and the linears that read its output (full module names)."""

    norm: str
    linears: tuple[str, ...]


def smooth_groups(model: nn.Module, scheme: QuantConfig | None = None) -> list[SmoothGroup]:
    """Norm-fed groups of every decoder block (via the model's adapter).

    With a ``scheme``, groups none of whose linears the scheme quantizes are left out (smoothing
    them would change nothing that gets quantized).
    """
    adapter = get_adapter(model)
    targets = set(target_linears(model, scheme)[0]) if scheme is not None else None
    groups = []
    for index, block in enumerate(adapter.blocks(model)):
        prefix = adapter.block_name(index)
        for group in adapter.groups:
            if not has_modules(block, group) or isinstance(block.get_submodule(group.prev), nn.Linear):
                continue  # v→o and up→down: the reference smooths norm-fed groups only
            linears = tuple(f"{prefix}.{name}" for name in group.linears)
            if targets is not None and not targets.intersection(linears):
                continue
            groups.append(SmoothGroup(f"{prefix}.{group.prev}", linears))
    return groups


@torch.no_grad()
def collect_input_maxima(model: nn.Module, groups: list[SmoothGroup], batches: list[Tensor]) -> dict[str, Tensor]:
    """Per-channel ``max |x|`` of each group's input over all calibration tokens (float32, by norm name)."""
    maxima: dict[str, Tensor] = {}
    hooks = []
    for group in groups:
        def record(_module: nn.Module, args: tuple, norm: str = group.norm) -> None:
            x = args[0].detach()
            value = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            maxima[norm] = value if norm not in maxima else torch.maximum(maxima[norm], value)
        hooks.append((model.get_submodule(group.linears[0]), record))
    with forward_pre_hooks(hooks):
        run_batches(model, batches)
    missing = [g.norm for g in groups if g.norm not in maxima]
    if missing:
        raise RuntimeError(f"no calibration input reached the linears fed by {missing[:3]}; cannot smooth them")
    return maxima


def smoothing_scales(activation_max: Tensor, weight_max: Tensor, alpha: float) -> Tensor:
    """``s = max|X|^α / max|W|^(1−α)`` per input channel; 1 where either maximum is 0."""
    activation_max, weight_max = activation_max.float(), weight_max.float()
    scales = activation_max.pow(alpha) / weight_max.clamp(min=_MIN_SCALE).pow(1 - alpha)
    dead = (activation_max <= 0) | (weight_max <= 0) | ~torch.isfinite(scales)
    return torch.where(dead, torch.ones_like(scales), scales.clamp(min=_MIN_SCALE))


@torch.no_grad()
def smooth_model(model: nn.Module, groups: list[SmoothGroup], maxima: dict[str, Tensor], alpha: float,
                 norm_offset: float = 0.0) -> dict[str, Tensor]:
    """Fold the smoothing scales into each group's norm and linears in place; returns the scales."""
    scales_by_norm = {}
    for group in groups:
        norm = model.get_submodule(group.norm)
        linears = [model.get_submodule(name) for name in group.linears]
        weight_max = torch.stack([l.weight.detach().abs().float().amax(dim=0) for l in linears]).amax(dim=0)
        act_max = maxima[group.norm].to(weight_max.device)
        if act_max.shape != weight_max.shape or norm.weight.shape != weight_max.shape:
            raise SchemeError(f"smoothquant: {group.norm} has {tuple(norm.weight.shape)} channels but its linears "
                              f"read {tuple(weight_max.shape)}; the adapter's norm→linears mapping is wrong")
        scales = smoothing_scales(act_max, weight_max, alpha)
        norm_weight = norm.weight.data
        folded = (norm_weight.float() + norm_offset) / scales - norm_offset
        norm.weight.data = folded.to(norm_weight.dtype)
        if getattr(norm, "bias", None) is not None:
            norm.bias.data = (norm.bias.data.float() / scales).to(norm.bias.dtype)
        for linear in linears:
            weight = linear.weight.data
            linear.weight.data = (weight.float() * scales[None, :]).to(weight.dtype)
        scales_by_norm[group.norm] = scales
    return scales_by_norm


def _check_alpha(scheme: QuantConfig) -> None:
    alpha = float(method_settings(scheme).alpha)
    if not 0.0 <= alpha <= 1.0:
        raise SchemeError(f"quant.settings.alpha={alpha}: the migration strength must lie in [0, 1] "
                          "(0.5 default; 0.8-0.9 for larger models)")


@register_method("smoothquant", settings=SmoothQuantSettings, needs=("batches",), exports=(COMPRESSED_TENSORS,),
                 validate=_check_alpha)
def smoothquant(model: nn.Module, scheme: QuantConfig, context: Any, report: QuantReport) -> None:
    """Smooth with calibration maxima, then round the weights to nearest with ``scheme.weights``."""
    alpha = float(method_settings(scheme).alpha)
    adapter = get_adapter(model)
    groups = smooth_groups(model, scheme)
    batches = context.calibration_batches()
    maxima = collect_input_maxima(model, groups, batches)
    scales = smooth_model(model, groups, maxima, alpha, adapter.norm_offset)
    tokens = sum(b.numel() for b in batches)
    spread = max((float(s.max() / s.min()) for s in scales.values()), default=1.0)
    report.notes.append(f"smoothquant: alpha={alpha}, {len(groups)} norm groups smoothed from {tokens} calibration "
                        f"tokens (largest max/min scale ratio {spread:.3g})")
    log.info("smoothquant: smoothed %d groups (alpha %.2f, %d tokens)", len(groups), alpha, tokens)
    quantize_weights_rtn(model, scheme, report)
