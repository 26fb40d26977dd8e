"""The harness's own quantizers, simulated (quantize then dequantize) in PyTorch.

``apply(model, scheme, context)`` is the one entry point: it validates the scheme against the
model, checks the context holds what the scheme's calibration passes need, runs the registered
weight method (rtn, gptq, awq, smoothquant, or one from ``quant.plugins``) — through the
calibrated-weight cache when its spec says cacheable — then installs activation and KV-cache
quantization, which compose with any method. Methods: ``harness.quant.base.MethodSpec``;
number formats: the table in ``harness.quant.tensor``.
"""
from __future__ import annotations

import time
from typing import Any

from torch import nn

from harness.config import QuantConfig
from harness.quant import awq, gptq, rtn, smoothquant  # noqa: F401  (register their methods)
from harness.quant.base import (
    MethodSpec,
    QuantReport,
    available_methods,
    calibration_passes,
    check_context,
    get_method,
    linear_census,
    method_settings,
    register_method,
    target_linears,
    validate_for_model,
    validate_scheme,
    with_model_defaults,
)
from harness.quant.calibrated_cache import run_cached
from harness.quant.kv import install_kv_quant
from harness.quant.linear import (
    calibrate_static_scales,
    install_activation_quant,
    keep_float32_weights,
)
from harness.quant.tensor import (
    NumberFormat,
    SchemeError,
    fake_quantize,
    get_format,
    register_format,
)

__all__ = ["apply", "changes_weights", "MethodSpec", "NumberFormat", "QuantReport", "SchemeError", "available_methods",
           "calibration_passes", "fake_quantize", "get_format", "get_method", "is_reference", "method_settings",
           "register_format", "register_method", "target_linears", "validate_for_model", "validate_scheme",
           "with_model_defaults"]


def is_reference(scheme: QuantConfig) -> bool:
    """True when the scheme changes nothing (the reference model itself)."""
    return scheme.weights is None and scheme.activations is None and scheme.kv_cache is None


def changes_weights(scheme: QuantConfig) -> bool:
    """True when applying the scheme rewrites weights: a weight grid, or a calibrated method (which
    solves or folds into them, e.g. SmoothQuant's scales into the norms)."""
    return scheme.weights is not None or get_method(scheme.method).calibrated


def apply(model: nn.Module, scheme: QuantConfig, context: Any = None) -> QuantReport:
    """Quantize ``model`` in place as ``scheme`` says; returns the per-layer report."""
    validate_for_model(model, scheme)
    check_context(scheme, context)
    spec = get_method(scheme.method)
    start = time.perf_counter()
    report = QuantReport(scheme=scheme.name, method=scheme.method,
                         total_params=sum(p.numel() for p in model.parameters()))
    if scheme.activations is not None:  # W8A8 / W4A4: the GEMM's operands stay exact (harness.quant.linear)
        keep_float32_weights(target_linears(model, scheme)[0])
    if spec.cacheable:
        run_cached(model, scheme, context, report, lambda: spec.quantize(model, scheme, context, report))
    else:
        spec.quantize(model, scheme, context, report)
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
    report.seconds = time.perf_counter() - start
    return report
