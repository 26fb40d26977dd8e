"""GPTQ [Frantar et al. 2022]: second-order weight rounding from calibration activations.

Collect, then solve. For each linear layer, :class:`HessianAccumulator` sums
``H = (2/n) Σ x xᵀ`` over its calibration inputs (float32); :func:`gptq_quantize_weight`
then quantizes the weight columns left to right, spreading each column's rounding error
over the not-yet-quantized columns through the upper Cholesky factor of ``H⁻¹``, in blocks
of ``block_size`` columns with lazy updates of the columns beyond the block (the
reference IST-DASLab ``gptq.py`` algorithm). Group scales come from the error-updated
weights (or, with ``act_order`` + ``static_groups``, from the original weights so that
groups stay contiguous in storage). The grid is ``harness.quant.format_math``' integer grid,
shared with RTN and AWQ: with an identity Hessian GPTQ reproduces RTN exactly.

:func:`quantize_gptq` drives a whole model: blocks in order, one on the compute device
at a time, each fed by the outputs of the already-quantized blocks before it, and inside
a block the adapter's groups in dependency order (q/k/v → o → gate/up → down). One
forward pass per block serves all of them: every batch pauses before each group's first
linear until all batches have added their inputs to its Hessian and the group is
quantized (:func:`harness.quant.architectures.staged_forward`). The linears of a group share
one Hessian and are solved as one stacked weight (:func:`_solve_stage`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from harness.config import QuantConfig, TensorQuantConfig
from harness.quant import format_math
from harness.quant.architectures import (
    BlockProgress,
    block_on_device,
    capture_block_inputs,
    get_adapter,
    make_batches,
    round_outside_blocks,
    small_ops_threads,
    staged_forward,
)
from harness.quant.experts import expert_fallback, expert_index, expert_stages, moe_settings
from harness.quant.format_table import SchemeError, full_range
from harness.quant.methods import COMPRESSED_TENSORS, method_settings, register_method
from harness.quant.report import QuantReport
from harness.quant.targets import bits_for, target_linears

log = logging.getLogger(__name__)

MAX_DAMPING_RETRIES = 6  # ×10 each: from 1% of the mean diagonal up to 10^4 %


@dataclass
class GPTQSettings:
    """``quant.settings`` of ``quant.method=gptq``."""

    damp_percent: float = 0.01  # fraction of mean(diag H) added to the diagonal
    block_size: int = 128  # columns per lazy-update block
    act_order: bool = False  # quantize columns by descending diag(H), static groups
    # with act_order: group scales fixed before the column reordering (no g_idx at inference)
    static_groups: bool = True


class HessianAccumulator:
    """Running ``H = (2/n) Σ x xᵀ`` over the rows of every batch of a layer's inputs.

    ``H`` is symmetric, so each batch adds only its lower triangle, in row bands of
    ``band`` columns (``H[i:j, :j] += X[:, i:j]ᵀ X[:, :j]``): about half the multiply-adds of
    the full ``XᵀX``, which on SmolLM2 costs as much as the calibration forward itself.
    :meth:`hessian` mirrors the triangle. Each entry is the same dot product as in the full
    product (bitwise equal on CPU in our measurements; the full ``XᵀX`` is itself exactly
    symmetric there).
    """

    def __init__(self, columns: int, device: torch.device | str):
        self.sum = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.count = 0
        self.band = max(128, columns // 8)  # narrower bands save more but multiply less efficiently

    def add_batch(self, inputs: Tensor) -> None:
        rows = inputs.reshape(-1, inputs.shape[-1]).to(device=self.sum.device, dtype=torch.float32)
        columns = rows.shape[1]
        for start in range(0, columns, self.band):
            end = min(start + self.band, columns)
            self.sum[start:end, :end].addmm_(rows[:, start:end].t(), rows[:, :end])
        self.count += rows.shape[0]

    def hessian(self) -> Tensor:
        if self.count == 0:
            raise RuntimeError("no calibration inputs reached this layer; cannot build its Hessian")
        lower = torch.tril(self.sum)
        return (lower + torch.tril(lower, diagonal=-1).t()) * (2.0 / self.count)


@dataclass
class GPTQResult:
    quantized: Tensor  # float32, same shape as the weight
    damp_percent: float  # the damping actually used (larger than asked when Cholesky failed)
    dead_columns: int


def _upper_inverse_cholesky(hessian: Tensor, damp_percent: float, name: str) -> tuple[Tensor, float]:
    """Upper Cholesky factor of ``(H + λI)⁻¹`` with ``λ = damp · mean(diag H)``.

    When a factorization fails the damping grows ×10 (from 1e-4 if it was 0) and a warning
    says so; after :data:`MAX_DAMPING_RETRIES` failures a RuntimeError names the layer.
    """
    if not bool(torch.isfinite(hessian).all()):
        raise RuntimeError(f"GPTQ: the Hessian of {name} has NaN/Inf entries (non-finite activations reach "
                           "this layer); damping cannot fix that. Check the model in float32 on the calibration set")
    mean_diag = torch.diagonal(hessian).mean()
    eye = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
    damp = damp_percent
    for attempt in range(MAX_DAMPING_RETRIES + 1):
        lower, info = torch.linalg.cholesky_ex(hessian + damp * mean_diag * eye)
        if int(info) == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if int(info) == 0 and bool(torch.isfinite(upper).all()):
                return upper, damp
        if attempt == MAX_DAMPING_RETRIES:
            break
        new_damp = damp * 10 if damp > 0 else 1e-4
        log.warning("GPTQ: Cholesky factorization of the Hessian of %s failed with damp_percent=%g; retrying with "
                    "%g (its inputs are nearly collinear; raise quant.settings.damp_percent to avoid this)",
                    name, damp, new_damp)
        damp = new_damp
    raise RuntimeError(f"GPTQ: the Hessian of {name} is not positive definite even with damp_percent={damp:g}; "
                       "its calibration inputs are degenerate. Use more calibration samples, or keep the layer "
                       "in high precision with quant.keep")


def _qparams(weight: Tensor, spec: TensorQuantConfig, dim: int | None) -> tuple[Tensor, Tensor]:
    return format_math.int_qparams(weight, spec.bits, symmetric=spec.symmetric, dim=dim, full_range=full_range(spec))


@torch.no_grad()
def gptq_quantize_weight(weight: Tensor, hessian: Tensor, spec: TensorQuantConfig, *, damp_percent: float = 0.01,
                         block_size: int = 128, act_order: bool = False, static_groups: bool = True,
                         name: str = "layer") -> GPTQResult:
    """Quantize one ``[out, in]`` weight given the ``[in, in]`` Hessian of its inputs.

    ``spec`` is an integer weight spec: ``bits``, ``symmetric`` and ``granularity`` channel,
    group (``group_size`` along the input) or tensor. Dead inputs (``H_dd = 0``) get weight 0.
    ``static_groups`` matters only with ``act_order``: each group of contiguous inputs then keeps
    the grid of its original weights; without it act-order groups consecutive *permuted* columns
    (a g_idx is then needed to store them).
    """
    if spec.format != "int" or spec.granularity not in ("channel", "group", "tensor"):
        raise SchemeError(f"GPTQ solves for an integer grid per channel, group or tensor; got format={spec.format!r}, "
                          f"granularity={spec.granularity!r}")
    W = weight.detach().to(torch.float32).clone()
    H = hessian.detach().to(device=W.device, dtype=torch.float32).clone()
    rows, columns = W.shape
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    group = spec.group_size if spec.granularity == "group" else 0
    if group and columns % group and not spec.ragged_groups:
        raise SchemeError(f"GPTQ {name}: group_size={group} does not divide the input size {columns}; set "
                          "ragged_groups=true for a shorter last group")
    perm = torch.argsort(torch.diagonal(H), descending=True) if act_order else None
    # Fixed grids: per channel / tensor from the start (as the reference does), or, with act-order,
    # static groups from the original weights (the last one shorter when group_size does not divide
    # the input size). Otherwise each group's grid comes from its error-updated weights.
    static_groups = bool(group) and act_order and static_groups
    fixed: tuple[Tensor, Tensor] | None = None
    if not group:
        fixed = _qparams(W, spec, dim=None if spec.granularity == "tensor" else -1)
    elif static_groups:
        params = [_qparams(W[:, g:g + group], spec, dim=-1) for g in range(0, columns, group)]
        scale, zero = torch.cat([p[0] for p in params], dim=1), torch.cat([p[1] for p in params], dim=1)
        group_of = (perm if perm is not None else torch.arange(columns, device=W.device)) // group
        static_scale, static_zero = scale[:, group_of], zero[:, group_of]  # per (permuted) column
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]

    Hinv, damp_used = _upper_inverse_cholesky(H, damp_percent, name)
    # Dynamic groups must not straddle a lazy-update boundary, so blocks are whole groups.
    if group and not static_groups:
        block_size = max(group, block_size // group * group)
    Q = torch.zeros_like(W)
    scale = zero = None
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        W1 = W[:, start:end].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[start:end, start:end]
        pivots = torch.diagonal(Hinv1)
        for i in range(end - start):
            column = start + i
            if fixed is not None:
                scale, zero = fixed
            elif static_groups:
                scale, zero = static_scale[:, column:column + 1], static_zero[:, column:column + 1]
            elif column % group == 0:
                scale, zero = _qparams(W1[:, i:i + group], spec, dim=-1)
            w = W1[:, i]
            q = format_math.int_fake_quant(w.unsqueeze(1), scale, zero, spec.bits, symmetric=spec.symmetric,
                                           full_range=full_range(spec))[:, 0]
            Q1[:, i] = q
            err = (w - q) / pivots[i]
            W1[:, i:].addr_(err, Hinv1[i, i:], alpha=-1.0)
            Err1[:, i] = err
        Q[:, start:end] = Q1
        W[:, end:] -= Err1 @ Hinv[start:end, end:]
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    return GPTQResult(Q, damp_used, int(dead.sum()))


@dataclass
class GPTQTimes:
    """Wall seconds of a whole-model GPTQ by phase: Hessian accumulation, solves, and the rest
    (the calibration forward through the blocks, which the two others interrupt)."""

    hessian: float = 0.0
    solve: float = 0.0
    total: float = 0.0
    blocks: int = 0
    per_block: list[float] = field(default_factory=list)

    @property
    def forward(self) -> float:
        return self.total - self.hessian - self.solve


LAST_TIMES = GPTQTimes()  # the phase split of the latest quantize_gptq in this process (benchmarks read it)


@torch.no_grad()
def quantize_gptq(model: nn.Module, scheme: QuantConfig, tokens: Tensor, device: torch.device | str,
                  report: QuantReport, *, batch_size: int = 8) -> list[str]:
    """GPTQ every target linear of ``model`` in place; returns the changed parameter names.

    ``tokens`` is the ``[num_samples, seq_len]`` calibration set. Target linears outside the
    decoder blocks (an lm_head removed from ``keep``) are rounded to nearest, with a warning.
    """
    spec = scheme.weights
    if spec is None:
        raise SchemeError("quant.method=gptq needs quant.weights (an integer weight spec)")
    settings: GPTQSettings = method_settings(scheme)
    device = torch.device(device)
    adapter = get_adapter(model)
    targets, _ = target_linears(model, scheme)
    blocks = adapter.blocks(model)
    changed = round_outside_blocks(model, adapter, scheme, targets, report)
    inputs = capture_block_inputs(model, adapter, make_batches(tokens, batch_size), device)
    hidden = inputs.hidden
    progress = BlockProgress("gptq", len(blocks))
    times, started = GPTQTimes(blocks=len(blocks)), time.perf_counter()
    min_tokens = moe_settings(scheme).min_tokens

    def add_inputs(stage: int, x: Tensor) -> None:
        begin = time.perf_counter()
        accumulators[stage].add_batch(x)
        times.hessian += time.perf_counter() - begin

    for index, block in enumerate(blocks):
        prefix = adapter.block_name(index)
        with block_on_device(block, device):
            stages = [[n for n in group.linears if f"{prefix}.{n}" in targets] for group in adapter.groups]
            stages = expert_stages([names for names in stages if names])  # one Hessian per expert
            # All linears of a group read the same input: one Hessian serves them all.
            accumulators = [HessianAccumulator(block.get_submodule(names[0]).in_features, device)
                            for names in stages]

            def quantize_stage(stage: int) -> None:
                begin = time.perf_counter()
                if expert_index(stages[stage][0]) is not None and accumulators[stage].count < min_tokens:
                    changed.extend(expert_fallback(block, prefix, stages[stage], accumulators[stage].count,
                                                   scheme, report))
                    accumulators[stage] = None
                    times.solve += time.perf_counter() - begin
                    return
                hessian = accumulators[stage].hessian()
                accumulators[stage] = None  # free it
                modules = [block.get_submodule(name) for name in stages[stage]]
                for solved in _solve_stage(prefix, stages[stage], modules, hessian, spec, settings):
                    full, module, result = solved
                    if result.damp_percent != settings.damp_percent:
                        report.notes.append(f"gptq: {full} needed damp_percent={result.damp_percent:g}")
                    report.add_layer(full, module.weight.data, result.quantized, bits_for(scheme, module))
                    module.weight.data.copy_(result.quantized.to(module.weight.dtype))
                    changed.append(f"{full}.weight")
                times.solve += time.perf_counter() - begin

            hidden = staged_forward(block, hidden, inputs.extras[index], [block.get_submodule(n[0]) for n in stages],
                                    add_inputs, quantize_stage, device)
        progress.done(index)
    times.total, times.per_block = time.perf_counter() - started, progress.block_seconds
    global LAST_TIMES
    LAST_TIMES = times
    log.info("gptq: %d blocks in %.1fs: calibration forward %.1fs, Hessians %.1fs, solves %.1fs (%d x %d tokens)",
             len(blocks), times.total, times.forward, times.hessian, times.solve, *tokens.shape)
    return changed


def _solve_stage(prefix: str, names: list[str], modules: list[nn.Linear], hessian: Tensor,
                 spec: TensorQuantConfig, settings: GPTQSettings) -> list[tuple[str, nn.Linear, GPTQResult]]:
    """GPTQ the linears of one stage, which share ``hessian``; returns (name, module, result) each.

    GPTQ treats the rows of a weight independently (the error of row r moves only along row r,
    through the shared ``H⁻¹``; scales are per row or per (row, group)), so linears that read one
    input are solved as one stacked weight: one Cholesky and one column loop for q/k/v instead
    of three. Per-tensor grids couple the rows of a weight, so those are solved one by one.
    """
    def solve(weight: Tensor, name: str) -> GPTQResult:
        with small_ops_threads(weight.device):
            return gptq_quantize_weight(weight, hessian, spec, damp_percent=settings.damp_percent,
                                        block_size=settings.block_size, act_order=settings.act_order,
                                        static_groups=settings.static_groups, name=name)

    fulls = [f"{prefix}.{name}" for name in names]
    if len(modules) == 1 or spec.granularity == "tensor":
        return [(full, module, solve(module.weight.data, full)) for full, module in zip(fulls, modules)]
    stacked = torch.cat([module.weight.data.to(torch.float32) for module in modules])
    result = solve(stacked, f"{prefix}.{{{','.join(names)}}}")
    parts = result.quantized.split([module.out_features for module in modules])
    return [(full, module, GPTQResult(part, result.damp_percent, result.dead_columns))
            for full, module, part in zip(fulls, modules, parts)]


@register_method("gptq", settings=GPTQSettings, needs=("tokens",), cacheable=True, weight_formats=("int",),
                 exports=(COMPRESSED_TENSORS,))
def gptq(model: nn.Module, scheme: QuantConfig, context: Any, report: QuantReport) -> list[str]:
    return quantize_gptq(model, scheme, context.tokens(), context.device, report,
                         batch_size=getattr(context, "batch_size", 8))
