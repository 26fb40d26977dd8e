"""The harness's own quantizers, simulated (quantize then dequantize) in PyTorch.

``apply(model, scheme, context)`` is the one entry point: it validates the scheme
against the model, runs the registered weight method (rtn, gptq, awq, smoothquant),
then installs activation and KV-cache quantization, which compose with any method.
"""
from __future__ import annotations

import time
from typing import Any

from torch import nn

from harness.config import QuantConfig
from harness.quant import awq, gptq, rtn, smoothquant  # noqa: F401  (register their methods)
from harness.quant.base import (QuantReport, available_methods, get_method, register_method, target_linears,
                                validate_for_model, validate_scheme, with_model_defaults)
from harness.quant.linear import calibrate_static_scales, install_activation_quant
from harness.quant.tensor import NumberFormat, SchemeError, fake_quantize, get_format, register_format

__all__ = ["apply", "NumberFormat", "QuantReport", "SchemeError", "available_methods", "fake_quantize", "get_format",
           "register_format", "register_method", "target_linears", "validate_for_model", "validate_scheme",
           "is_reference", "with_model_defaults"]


def is_reference(scheme: QuantConfig) -> bool:
    """True when the scheme changes nothing (the reference model itself)."""
    return scheme.weights is None and scheme.activations is None and scheme.kv_cache is None


def apply(model: nn.Module, scheme: QuantConfig, context: Any = None) -> QuantReport:
    """Quantize ``model`` in place as ``scheme`` says; returns the per-layer report."""
    validate_for_model(model, scheme)
    if scheme.activations is not None and not scheme.activations.dynamic and context is None:
        raise SchemeError("static activation scales need calibration data (a QuantContext)")
    start = time.perf_counter()
    report = QuantReport(scheme=scheme.name, method=scheme.method,
                         total_params=sum(p.numel() for p in model.parameters()))
    if scheme.weights is not None or scheme.method != "rtn":
        get_method(scheme.method)(model, scheme, context, report)
    targets, kept = target_linears(model, scheme)
    report.kept = kept
    if scheme.activations is not None:
        install_activation_quant(targets, scheme.activations)
        if not scheme.activations.dynamic:
            spec = scheme.activations
            fmt_max = get_format(spec.format).max(spec)
            calibrate_static_scales(model, targets, context.calibration_batches(), fmt_max)
    if scheme.kv_cache is not None:
        from harness.quant.kv import install_kv_quant
        install_kv_quant(model, scheme.kv_cache, context)
    report.seconds = time.perf_counter() - start
    return report
