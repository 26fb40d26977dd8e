"""AWQ [Lin et al. 2023]: activation-aware per-channel scales, folded away, then round-to-nearest.

For each group of linears sharing an input (the adapter's groups: q/k/v after the attention
norm, o after v where shapes allow, gate/up after the MLP norm, down after up), the input
channels are scaled by ``s = mean|x|^α`` (normalised by ``sqrt(max s · min s)``; with
``duo_scaling`` divided by ``mean|ŵ|^(1-α)`` of the group-normalised weights), α on a grid
of ``grid`` points in [0, 1) (the settings are :class:`AWQSettings`, the scheme's ``quant.settings``).
The α minimising the MSE of the group's inspected module output (llm-awq's ``module2inspect``:
the attention for q/k/v, the MLP for gate/up, the linear itself for o and down) with weights
``Q(W·s)/s`` wins. ``1/s`` is folded into the
preceding norm (Gemma's ``(1 + w)`` form included) or linear and ``s`` into the linears'
input columns: an exact equivalence before rounding. An optional clipping search then
shrinks each (row, group) maximum by up to ``max_shrink`` to minimise that group's output
error on sampled tokens (q and k are never clipped, as in llm-awq), and the scaled weights
are rounded to nearest on ``scheme.weights``' grid (the same grid as RTN: with the single
grid point α = 0 and no clipping, AWQ equals RTN).

As in llm-awq, every block sees the full-precision outputs of the blocks before it (the
transforms are equivalences), scales are searched on the unmodified block and then applied.
The loss of the α and clip searches is measured on the first ``quant.settings.search_samples``
calibration sequences; the activation statistics use all of them. Search cost per block ≈
Σ over foldable groups of ``grid`` × (fake-quantize the group's weights + run its inspected
module on search_samples × seq_len tokens), plus per clipped linear ``max_shrink · clip_grid``
rounds on 512 sampled tokens. ``quant.settings.coarse_to_fine`` evaluates about ``2·sqrt(grid)``
of the grid points instead (:func:`coarse_to_fine_steps`). On SmolLM2 (one thread, 8 × 512
search tokens) one grid point costs ~136 ms for q/k/v (the attention), ~255 ms for gate/up
(the MLP) and ~72 ms for down; o_proj is not searched there (grouped-query attention: v's
output is not o's input). :class:`AWQOutcome` records the wall and CPU seconds of each phase.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from harness.config import QuantConfig, TensorQuantConfig
from harness.quant.architectures import (
    Adapter,
    BlockProgress,
    LinearGroup,
    block_on_device,
    capture_block_inputs,
    get_adapter,
    make_batches,
    round_outside_blocks,
    run_block,
    small_ops_threads,
)
from harness.quant.experts import expert_index, moe_settings, record_fallback
from harness.quant.format_table import SchemeError, fake_quantize
from harness.quant.methods import COMPRESSED_TENSORS, method_settings, register_method
from harness.quant.report import QuantReport
from harness.quant.targets import bits_for, target_linears

log = logging.getLogger(__name__)


@dataclass
class AWQSettings:
    """``quant.settings`` of ``quant.method=awq``."""

    grid: int = 20  # points of the alpha grid in [0, 1)
    duo_scaling: bool = False  # llm-compressor's mean|x|^a / mean|w|^(1-a) variant
    clip: bool = True  # search a per-group clipping ratio after scaling
    clip_grid: int = 20  # shrink steps of 1/clip_grid; max_shrink * clip_grid of them are tried
    max_shrink: float = 0.5  # largest clipping shrink tried (0.5: clip down to half of each group's max)
    # Calibration sequences the alpha and clip losses are measured on (0: all); the activation
    # statistics always use every sequence. Search time grows linearly with it. SmolLM2: 4 instead of 8 moved
    # held-out KL by -0.005 ± 0.003, as much as searching 8 other sequences did (benchmarks/results/awq_search.json).
    search_samples: int = 4
    # Evaluate every ~sqrt(grid)-th alpha, then the neighbourhood of the best: the full grid's choice whenever the
    # loss curve has a single minimum (11 of 20 points). SmolLM2: same alpha in 89 of 90 groups, held-out KL
    # unchanged within noise, 0.54x the search time (benchmarks/results/awq_search.json). false: every point.
    coarse_to_fine: bool = True


# Sequences on which the α and clip losses are measured (0: all): quant.settings.search_samples. Full-precision
# statistics always use every sequence. 4 × 512 tokens keeps SmolLM2 on a 2-core CPU within ~3 minutes (the
# choice of search sequences moves held-out KL by a few per cent either way); on a GPU use all (search_samples=0).
DEFAULT_SEARCH_SAMPLES = AWQSettings.search_samples
CLIP_TOKENS = 512  # llm-awq's n_sample_token for the clip search
CLIP_BATCH_ELEMENTS = 1 << 24  # rows × tokens × groups per clip-search batch (64 MiB of float32 outputs)


def candidate_scales(x_mean: Tensor, ratio: float, w_mean: Tensor | None = None) -> Tensor:
    """``mean|x|^α`` (or duo ``mean|x|^α / mean|ŵ|^(1-α)``), clamped at 1e-4, normalised to geometric centre 1."""
    if w_mean is None:
        scales = x_mean.pow(ratio).clamp(min=1e-4)
    else:
        scales = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    return scales / (scales.max() * scales.min()).sqrt()


def group_segments(columns: int, spec: TensorQuantConfig) -> list[tuple[int, int, int]]:
    """``(start, end, size)`` runs of equal-size quantization groups along the input dimension.

    One run of ``group_size`` groups, plus a shorter last group when ragged groups allow it;
    per channel (and per tensor, for clipping purposes) a whole row is one group.
    """
    size = spec.group_size if spec.granularity == "group" else columns
    full = columns - columns % size
    runs = [(0, full, size)] if full else []
    return runs + ([(full, columns, columns - full)] if full < columns else [])


def weight_mean(weights: list[Tensor], spec: TensorQuantConfig) -> Tensor:
    """Per input channel mean of ``|W|`` normalised by its quantization group's max (duo scaling)."""
    stacked = torch.cat([w.float() for w in weights], dim=0).abs()
    parts = []
    for start, end, size in group_segments(stacked.shape[1], spec):
        groups = stacked[:, start:end].reshape(stacked.shape[0], -1, size)
        parts.append((groups / (groups.amax(dim=-1, keepdim=True) + 1e-6)).reshape(stacked.shape[0], -1))
    return torch.cat(parts, dim=1).mean(dim=0)


@dataclass
class ScaleSearch:
    scales: Tensor
    ratio: float
    losses: list[float]


def coarse_to_fine_steps(grid: int, loss: Callable[[int], float]) -> list[int]:
    """The grid steps a coarse-to-fine search evaluates, best first found by ``loss(step)``.

    Every ``stride``-th step (``stride = round(sqrt(grid))``, at least 2), then every step within
    ``stride - 1`` of the best of those. For a loss that falls strictly to its minimum over the
    grid and rises strictly after it, the minimum lies strictly between the best coarse step's
    neighbours, so this finds the full grid's choice with about ``2·sqrt(grid)`` evaluations
    (11 of 20). Returns the evaluated steps in ascending order.
    """
    stride = max(2, round(math.sqrt(grid)))
    coarse = list(range(0, grid, stride))
    values = {step: loss(step) for step in coarse}
    best = min(coarse, key=lambda step: (not values[step] < math.inf, values[step], step))
    for step in range(max(0, best - stride + 1), min(grid, best + stride)):
        if step not in values:
            values[step] = loss(step)
    return sorted(values)


@torch.no_grad()
def search_scales(linears: list[nn.Linear], quantize: list[bool], inspect: Callable[[], list[Tensor]],
                  x_mean: Tensor, spec: TensorQuantConfig, *, grid: int, duo_scaling: bool,
                  reference: list[Tensor] | None = None, coarse_to_fine: bool = False) -> ScaleSearch:
    """Grid search of α: the scales whose ``Q(W·s)/s`` weights best reproduce ``inspect()``'s outputs.

    ``inspect`` runs the inspected module on the search inputs with the linears' current
    weights; ``reference`` is its output with the original weights when the caller already
    has it (recorded during the statistics pass), else ``inspect()`` computes it. With
    ``coarse_to_fine`` only the steps of :func:`coarse_to_fine_steps` are evaluated (the others'
    losses are NaN); the choice among the evaluated steps follows the same rule as the full grid
    (the first strictly smallest loss in ascending α). The linears' weights are restored before
    returning.
    """
    if grid < 1:
        raise SchemeError(f"quant.settings.grid={grid} must be at least 1")
    originals = [linear.weight.data for linear in linears]
    if not reference:
        reference = inspect()
    total = sum(r.numel() for r in reference)
    w_mean = weight_mean(originals, spec) if duo_scaling else None
    losses = [math.nan] * grid
    candidates: dict[int, Tensor] = {}

    def loss(step: int) -> float:
        scales = candidate_scales(x_mean, step / grid, w_mean)
        with small_ops_threads(x_mean.device):  # memory-bound element-wise passes
            for linear, original, rounded in zip(linears, originals, quantize):
                if rounded:
                    scaled = fake_quantize(original.float() * scales, spec) / scales
                    linear.weight.data = scaled.to(original.dtype)
        error = sum(float((out.float() - ref.float()).pow(2).sum()) for out, ref in zip(inspect(), reference))
        losses[step], candidates[step] = error / max(total, 1), scales
        return losses[step]

    try:
        if coarse_to_fine:
            steps = coarse_to_fine_steps(grid, loss)
        else:
            steps = list(range(grid))
            for step in steps:
                loss(step)
    finally:
        for linear, original in zip(linears, originals):
            linear.weight.data = original
    best: int | None = None
    for step in steps:  # ascending α, strictly smaller wins: the full grid's rule
        if best is None or losses[step] < losses[best]:
            best = step
    assert best is not None
    if not math.isfinite(losses[best]):
        raise RuntimeError("AWQ: the scale search loss is not finite (NaN/Inf activations in this block)")
    return ScaleSearch(scales=candidates[best], ratio=best / grid, losses=losses)


@torch.no_grad()
def fold_scales(prev: nn.Module, linears: list[nn.Linear], scales: Tensor, norm_offset: float = 0.0) -> None:
    """Divide ``prev``'s output by ``scales`` and multiply the linears' input columns by them.

    ``prev`` is a Linear (rows and bias divided) or a norm with an affine ``weight`` (and
    optional ``bias``) that multiplies by ``norm_offset + weight``.
    """
    scales = scales.float()
    if isinstance(prev, nn.Linear):
        prev.weight.data = (prev.weight.float() / scales[:, None]).to(prev.weight.dtype)
    else:
        weight = getattr(prev, "weight", None)
        if not isinstance(weight, Tensor) or weight.shape != scales.shape:
            raise SchemeError(f"AWQ cannot fold scales into {type(prev).__name__}: it has no per-channel weight of "
                              f"size {scales.numel()}; fix the adapter's groups")
        # (offset + w') = (offset + w) / s, written so that small w keep their precision and s = 1 is exact.
        prev.weight.data = ((weight.float() + norm_offset * (1 - scales)) / scales).to(weight.dtype)
    bias = getattr(prev, "bias", None)
    if isinstance(bias, Tensor):
        prev.bias.data = (bias.float() / scales).to(bias.dtype)
    for linear in linears:
        linear.weight.data = (linear.weight.float() * scales).to(linear.weight.dtype)


@torch.no_grad()
def search_clip(weight: Tensor, inputs: Tensor, spec: TensorQuantConfig, *, grid: int, max_shrink: float) -> Tensor:
    """Per (row, group) maximum ``m`` minimising that group's output error of ``Q(clamp(W, ±m))``.

    ``inputs`` is ``[tokens, in]``. Candidates shrink the group's max by ``k/grid`` for
    ``k < max_shrink·grid`` (llm-awq ``auto_clip``). Returns the chosen bound of every weight
    element (shape of ``weight``), to be applied as ``clamp(W, -bound, bound)``.
    """
    rows, columns = weight.shape
    bounds = torch.empty(rows, columns, dtype=torch.float32, device=weight.device)
    for start, end, size in group_segments(columns, spec):
        segment_spec = TensorQuantConfig(format=spec.format, bits=spec.bits, symmetric=spec.symmetric,
                                         granularity="group", group_size=size)
        x = inputs[:, start:end].float().reshape(len(inputs), -1, size)
        batch_rows = max(1, CLIP_BATCH_ELEMENTS // (x.shape[0] * x.shape[1]))
        for first in range(0, rows, batch_rows):
            w = weight[first:first + batch_rows, start:end].float()
            w = w.reshape(len(w), -1, size)
            original_max = w.abs().amax(dim=-1, keepdim=True)
            reference = torch.einsum("ngk,rgk->rng", x, w)
            best_max, best_err = original_max.clone(), torch.full_like(original_max, float("inf"))
            for step in range(max(1, int(max_shrink * grid))):
                bound = original_max * (1 - step / grid)
                clipped = torch.maximum(torch.minimum(w, bound), -bound)
                rounded = fake_quantize(clipped.reshape(len(w), -1), segment_spec).reshape(clipped.shape)
                err = (torch.einsum("ngk,rgk->rng", x, rounded) - reference).pow(2).mean(dim=1).unsqueeze(-1)
                better = err < best_err
                best_err, best_max = torch.where(better, err, best_err), torch.where(better, bound, best_max)
            bounds[first:first + len(w), start:end] = best_max.expand_as(w).reshape(len(w), -1)
    return bounds


@dataclass
class _GroupCapture:
    """What one forward pass records for a group: |x| statistics, search inputs, inspect calls."""

    abs_sum: Tensor | None = None
    count: int = 0
    inputs: list[Tensor] = field(default_factory=list)
    calls: list[tuple[tuple, dict]] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)  # the inspected module's output of each call


@dataclass
class AWQOutcome:
    changed: list[str]  # parameter names modified
    input_scales: dict[str, Tensor]  # linear → s multiplied into its input columns
    output_scales: dict[str, Tensor]  # linear → s its output rows were divided by (it is a fold target)
    ratios: dict[str, float]  # "<block>.<prev>" → chosen α
    losses: dict[str, list[float]] = field(default_factory=dict)  # "<block>.<prev>" → loss at each grid point
    # Wall seconds summed over blocks: "statistics" (the full-precision forward on every batch, which also
    # records the search inputs and reference outputs), "search" (the α grid), "clip_round" (clip search + RTN);
    # cpu_seconds: the same phases in process CPU time (all threads).
    seconds: dict[str, float] = field(default_factory=lambda: {"statistics": 0.0, "search": 0.0, "clip_round": 0.0})
    cpu_seconds: dict[str, float] = field(default_factory=lambda: {"statistics": 0.0, "search": 0.0, "clip_round": 0.0})


def _record(block: nn.Module, groups: list[LinearGroup], foldable: set[str],
            searching: list[bool]) -> tuple[list, dict[str, _GroupCapture]]:
    """Hooks recording each group's inputs on the search batches (for clipping), and for foldable
    groups also the |x| statistics over all batches and the inspected module's calls."""
    captures = {g.prev: _GroupCapture() for g in groups}
    handles = []
    for group in groups:
        capture, scaled = captures[group.prev], group.prev in foldable

        def inputs(_module: nn.Module, args: tuple, capture: _GroupCapture = capture, scaled: bool = scaled) -> None:
            x = args[0].detach()
            if scaled:
                flat = x.reshape(-1, x.shape[-1]).float().abs().sum(dim=0)
                capture.abs_sum = flat if capture.abs_sum is None else capture.abs_sum + flat
                capture.count += x.numel() // x.shape[-1]
            if searching[0]:
                capture.inputs.append(x)

        def calls(_module: nn.Module, args: tuple, kwargs: dict, capture: _GroupCapture = capture) -> None:
            if searching[0]:
                capture.calls.append((args, kwargs))

        def outputs(_module: nn.Module, _args: tuple, _kwargs: dict, output: Any,
                    capture: _GroupCapture = capture) -> None:
            if searching[0]:  # the search's reference: the same call on the same inputs, already computed
                capture.outputs.append(output[0] if isinstance(output, (tuple, list)) else output)

        handles.append(block.get_submodule(group.linears[0]).register_forward_pre_hook(inputs))
        if scaled:
            inspected = block.get_submodule(group.inspect)
            handles.append(inspected.register_forward_pre_hook(calls, with_kwargs=True))
            handles.append(inspected.register_forward_hook(outputs, with_kwargs=True))
    return handles, captures


def _inspector(module: nn.Module, calls: list[tuple[tuple, dict]]) -> Callable[[], list[Tensor]]:
    def run() -> list[Tensor]:
        outs = [module(*args, **kwargs) for args, kwargs in calls]
        return [o[0] if isinstance(o, (tuple, list)) else o for o in outs]
    return run


@torch.no_grad()
def quantize_awq(model: nn.Module, scheme: QuantConfig, tokens: Tensor, device: torch.device | str,
                 report: QuantReport, *, batch_size: int = 8, search_samples: int = DEFAULT_SEARCH_SAMPLES,
                 apply_quantization: bool = True) -> AWQOutcome:
    """AWQ every target linear of ``model`` in place.

    With ``apply_quantization=False`` only the (searched) scales are folded: the model then
    computes the same function as before, which the tests check.
    """
    spec = scheme.weights
    if spec is None:
        raise SchemeError("quant.method=awq needs quant.weights (an integer weight spec)")
    settings: AWQSettings = method_settings(scheme)
    device = torch.device(device)
    adapter = get_adapter(model)
    targets, _ = target_linears(model, scheme)
    blocks = adapter.blocks(model)
    changed = round_outside_blocks(model, adapter, scheme, targets, report)
    n_search = len(tokens) if search_samples <= 0 else min(search_samples, len(tokens))
    batches = make_batches(tokens[:n_search], batch_size) + make_batches(tokens[n_search:], batch_size)
    search_batches = math.ceil(n_search / batch_size)
    inputs = capture_block_inputs(model, adapter, batches, device)
    hidden = inputs.hidden
    outcome = AWQOutcome(changed, {}, {}, {})
    progress = BlockProgress("awq", len(blocks))
    min_tokens = moe_settings(scheme).min_tokens
    for index, block in enumerate(blocks):
        prefix = adapter.block_name(index)
        block_targets = {n: m for n, m in targets.items() if n.startswith(prefix + ".")}
        with block_on_device(block, device):
            originals = {n: m.weight.data.clone() for n, m in block_targets.items()}
            groups = [g for g in adapter.groups if any(f"{prefix}.{n}" in targets for n in g.linears)]
            foldable = [g for g in adapter.foldable_groups(block) if g in groups]
            searching = [False]
            handles, captures = _record(block, groups, {g.prev for g in foldable}, searching)
            clock = (time.perf_counter(), time.process_time())
            try:
                outputs = []
                for number, (states, extra) in enumerate(zip(hidden, inputs.extras[index])):
                    searching[0] = number < search_batches
                    outputs.append(run_block(block, states, extra))
            finally:
                for handle in handles:
                    handle.remove()
            clock = _tick(outcome, "statistics", clock)
            # an expert whose down projection saw fewer routed tokens than quant.moe.min_tokens: no scale, no clip
            few = [g for g in foldable if expert_index(g.linears[0]) is not None
                   and captures[g.prev].count < min_tokens]
            for group in few:
                record_fallback(report, prefix, group.linears[0], "awq", min_tokens)
            foldable, groups = [g for g in foldable if g not in few], [g for g in groups if g not in few]
            _process_block(block, prefix, adapter, foldable, captures, targets, spec, settings, outcome)
            clock = _tick(outcome, "search", clock)
            if apply_quantization:
                _clip_and_round(prefix, adapter, groups, captures, block_targets, originals, scheme, settings,
                                outcome, report)
            _tick(outcome, "clip_round", clock)
            hidden = outputs
        progress.done(index)
    searched_tokens = n_search * tokens.shape[1]
    log.info("awq: %d blocks; wall (CPU) seconds: statistics pass %.1f (%.1f) on %d x %d tokens, alpha search %.1f "
             "(%.1f) of grid %d x %d groups/block x %d tokens, clip + round %.1f (%.1f)", len(blocks),
             outcome.seconds["statistics"], outcome.cpu_seconds["statistics"], *tokens.shape,
             outcome.seconds["search"], outcome.cpu_seconds["search"], settings.grid,
             len(adapter.foldable_groups(blocks[0])) if len(blocks) else 0, searched_tokens,
             outcome.seconds["clip_round"], outcome.cpu_seconds["clip_round"])
    return outcome


def _tick(outcome: AWQOutcome, phase: str, since: tuple[float, float]) -> tuple[float, float]:
    """Add the wall and CPU seconds since ``since`` to ``phase``; returns the new (wall, CPU) stamp."""
    now = (time.perf_counter(), time.process_time())
    outcome.seconds[phase] += now[0] - since[0]
    outcome.cpu_seconds[phase] += now[1] - since[1]
    return now


def _process_block(block: nn.Module, prefix: str, adapter: Adapter, groups: list[LinearGroup],
                   captures: dict[str, _GroupCapture], targets: dict[str, nn.Linear], spec: TensorQuantConfig,
                   settings: AWQSettings, outcome: AWQOutcome) -> None:
    """Search every group's scales on the unmodified block, then fold them all."""
    found = []
    for group in groups:
        capture = captures[group.prev]
        linears = [block.get_submodule(n) for n in group.linears]
        x_mean = capture.abs_sum / max(capture.count, 1)
        result = search_scales(linears, [f"{prefix}.{n}" in targets for n in group.linears],
                               _inspector(block.get_submodule(group.inspect), capture.calls), x_mean, spec,
                               grid=settings.grid, duo_scaling=settings.duo_scaling,
                               coarse_to_fine=settings.coarse_to_fine,
                               reference=capture.outputs if len(capture.outputs) == len(capture.calls) else None)
        capture.outputs = []  # free them
        found.append((group, linears, result))
        outcome.ratios[f"{prefix}.{group.prev}"] = result.ratio
        outcome.losses[f"{prefix}.{group.prev}"] = result.losses
    for group, linears, result in found:
        prev = block.get_submodule(group.prev)
        fold_scales(prev, linears, result.scales, adapter.norm_offset)
        outcome.changed += [f"{prefix}.{group.prev}.{p}" for p, _ in prev.named_parameters()]
        outcome.changed += [f"{prefix}.{n}.weight" for n in group.linears]
        scales = result.scales.detach().to("cpu")
        for name in group.linears:
            outcome.input_scales[f"{prefix}.{name}"] = scales
        if isinstance(prev, nn.Linear):
            outcome.output_scales[f"{prefix}.{group.prev}"] = scales
        for i, x in enumerate(captures[group.prev].inputs):  # clip search sees the scaled inputs
            captures[group.prev].inputs[i] = x / result.scales.to(x.dtype)


def _clip_and_round(prefix: str, adapter: Adapter, groups: list[LinearGroup],
                    captures: dict[str, _GroupCapture], block_targets: dict[str, nn.Linear],
                    originals: dict[str, Tensor], scheme: QuantConfig, settings: AWQSettings, outcome: AWQOutcome,
                    report: QuantReport) -> None:
    spec = scheme.weights
    assert spec is not None
    clip_inputs: dict[str, Tensor] = {}
    for group in groups:
        rows = torch.cat([x.reshape(-1, x.shape[-1]) for x in captures[group.prev].inputs])
        sample = rows[:: max(1, len(rows) // CLIP_TOKENS)][:CLIP_TOKENS]
        for name in group.linears:
            clip_inputs[f"{prefix}.{name}"] = sample
    clip = settings.clip and spec.granularity in ("group", "channel")
    for full, module in block_targets.items():
        relative = full[len(prefix) + 1:]
        if clip and full in clip_inputs and relative not in adapter.no_clip:
            with small_ops_threads(module.weight.device):
                bounds = search_clip(module.weight.data, clip_inputs[full], spec, grid=settings.clip_grid,
                                     max_shrink=settings.max_shrink)
            weight = module.weight.float()
            module.weight.data = torch.maximum(torch.minimum(weight, bounds), -bounds).to(module.weight.dtype)
        quantized = fake_quantize(module.weight.data, spec)
        module.weight.data = quantized
        # Report the effective weight in the original coordinates: diag(s_out) · Q · diag(1/s_in).
        effective = quantized.float()
        if full in outcome.input_scales:
            effective = effective / outcome.input_scales[full].to(effective.device)
        if full in outcome.output_scales:
            effective = effective * outcome.output_scales[full].to(effective.device)[:, None]
        report.add_layer(full, originals[full], effective, bits_for(scheme, module))
        outcome.changed.append(f"{full}.weight")


def _check_settings(scheme: QuantConfig) -> None:
    settings: AWQSettings = method_settings(scheme)
    for name in ("grid", "clip_grid"):
        if getattr(settings, name) < 1:
            raise SchemeError(f"quant.settings.{name}={getattr(settings, name)} must be at least 1 (default 20)")
    if settings.search_samples < 0:
        raise SchemeError(f"quant.settings.search_samples={settings.search_samples} must be >= 0 (0: every sequence)")
    if not 0.0 <= settings.max_shrink <= 1.0:
        raise SchemeError(f"quant.settings.max_shrink={settings.max_shrink} must lie in [0, 1] (default 0.5)")


@register_method("awq", settings=AWQSettings, needs=("tokens",), cacheable=True, weight_formats=("int",),
                 exports=(COMPRESSED_TENSORS,), validate=_check_settings)
def awq(model: nn.Module, scheme: QuantConfig, context: Any, report: QuantReport) -> list[str]:
    outcome = quantize_awq(model, scheme, context.tokens(), context.device, report,
                           batch_size=getattr(context, "batch_size", 8),
                           search_samples=method_settings(scheme).search_samples)
    return sorted(set(outcome.changed))
