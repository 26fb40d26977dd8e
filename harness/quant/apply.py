"""``apply(model, scheme, context)``: quantize a model in place as a scheme says, and what that does.

It validates the scheme against the model, checks the context holds what the scheme's calibration
passes need, runs the registered weight method (:mod:`harness.quant.methods`) — through the
calibrated-weight cache when its registration says cacheable — then installs activation and KV-cache
quantization, which compose with any method.
"""
from __future__ import annotations

import time
from typing import Any

from torch import nn

from harness.config import QuantConfig
from harness.quant.calibrated_cache import run_cached
from harness.quant.calibration import check_context
from harness.quant.coverage import CoverageAccount, coverage_account
from harness.quant.experts import find_fused_experts, fuse_experts, moe_settings, quantize_routers, unfuse_experts
from harness.quant.format_table import get_format
from harness.quant.kv import install_kv_quant
from harness.quant.linear import calibrate_static_scales, install_activation_quant, keep_float32_weights
from harness.quant.methods import MethodSpec, get_method
from harness.quant.report import QuantReport, linear_census
from harness.quant.targets import target_linears
from harness.quant.validation import validate_for_model


def is_reference(scheme: QuantConfig) -> bool:
    """True when the scheme changes nothing (the reference model itself)."""
    return scheme.weights is None and scheme.activations is None and scheme.kv_cache is None


def changes_weights(scheme: QuantConfig) -> bool:
    """True when applying the scheme rewrites weights: a weight grid, or a calibrated method (which
    solves or folds into them, e.g. SmoothQuant's scales into the norms)."""
    return scheme.weights is not None or get_method(scheme.method).calibrated


def coverage_of(model: nn.Module, scheme: QuantConfig) -> CoverageAccount:
    """The coverage account of ``scheme`` on ``model`` (harness.quant.coverage): what each parameter becomes."""
    return coverage_account(model, scheme, target_linears(model, scheme)[0] if scheme.weights is not None else {})


def apply(model: nn.Module, scheme: QuantConfig, context: Any = None) -> QuantReport:
    """Quantize ``model`` in place as ``scheme`` says; returns the per-layer report.

    Fused mixture-of-experts experts are unfused into per-expert Linears for the method
    (:mod:`harness.quant.experts`) and fused back afterwards, unless activations are quantized (the
    per-expert Linears then quantize their inputs and stay). The report carries the coverage account.
    """
    validate_for_model(model, scheme)
    check_context(scheme, context)
    spec = get_method(scheme.method)
    start = time.perf_counter()
    report = QuantReport(scheme=scheme.name, method=scheme.method,
                         total_params=sum(p.numel() for p in model.parameters()))
    report.coverage = coverage_of(model, scheme)
    moe = moe_settings(scheme)
    unfuse = bool(find_fused_experts(model)) and (changes_weights(scheme) or scheme.activations is not None)
    state = unfuse_experts(model, all_tokens=moe.calibrate_all_experts) if unfuse else None
    try:
        _apply_unfused(model, scheme, context, spec, report)
    finally:
        if state is not None:
            for swap in state.swaps:
                swap.unfused.all_tokens = swap.unfused.calibrating = False  # both are for calibration only
            if scheme.activations is None:
                fuse_experts(model, state)
    if state is not None:
        report.moe.update(fused_modules=len(state.swaps), calibrate_all_experts=moe.calibrate_all_experts,
                          routers="quantized" if moe.quantize_router else "kept",
                          unfused=scheme.activations is not None)
    experts = find_fused_experts(model)
    if experts or state is not None:  # the divergence stage adds its router agreement here (harness.divergence.router)
        report.moe["experts"] = {name: info.num_experts for name, info in experts.items()} or \
            {f"{n}": len(s.unfused) for n, s in ((s.unfused.fused.name, s) for s in state.swaps)}
        model._harness_quant_report = report
    report.seconds = time.perf_counter() - start
    return report


def _apply_unfused(model: nn.Module, scheme: QuantConfig, context: Any, spec: MethodSpec, report: QuantReport) -> None:
    if scheme.activations is not None:  # W8A8 / W4A4: the GEMM's operands stay exact (harness.quant.linear)
        keep_float32_weights(target_linears(model, scheme)[0])
    if spec.cacheable:
        run_cached(model, scheme, context, report, lambda: spec.quantize(model, scheme, context, report))
    else:
        spec.quantize(model, scheme, context, report)
    if moe_settings(scheme).quantize_router and scheme.weights is not None:
        quantize_routers(model, scheme, report)
    targets, kept = target_linears(model, scheme)
    report.kept = kept
    report.kept_params, report.output_head, report.input_embedding = linear_census(model, kept)
    if scheme.activations is not None:
        install_activation_quant(targets, scheme.activations)
        if not scheme.activations.dynamic:
            fmt_max = get_format(scheme.activations.format).max(scheme.activations)
            calibrate_static_scales(model, targets, context.calibration_batches(), fmt_max)
    if scheme.kv_cache is not None:
        install_kv_quant(model, scheme.kv_cache, context)
