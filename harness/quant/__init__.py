"""The harness's own quantizers, simulated (quantize then dequantize) in PyTorch: the package's public names.

``apply(model, scheme, context)`` (:mod:`harness.quant.apply`) is the one entry point. Weight methods
register in :mod:`harness.quant.methods`, each from its own module (the built-ins below: rtn, gptq, awq,
smoothquant; any other from a module listed in ``quant.plugins``); number formats in the table of
:mod:`harness.quant.format_table`. A scheme is checked by :mod:`harness.quant.validation`, its targets are
chosen by :mod:`harness.quant.targets`, and the result is a :class:`QuantReport` (:mod:`harness.quant.report`).
"""
from __future__ import annotations

from harness.quant import awq, gptq, rtn, smoothquant  # noqa: F401  (the built-in methods register on import)
from harness.quant.apply import apply, changes_weights, coverage_of, is_reference
from harness.quant.calibration import calibration_passes
from harness.quant.coverage import CoverageAccount, check_coverage
from harness.quant.format_table import NumberFormat, SchemeError, fake_quantize, get_format, register_format
from harness.quant.methods import (
    COMPRESSED_TENSORS,
    MethodSpec,
    available_methods,
    get_method,
    method_settings,
    register_method,
    unregister_method,
)
from harness.quant.report import LayerReport, QuantReport, bits_per_weight, linear_census
from harness.quant.targets import bits_for, target_linears
from harness.quant.validation import validate_for_model, validate_scheme, with_model_defaults

__all__ = ["COMPRESSED_TENSORS", "CoverageAccount", "LayerReport", "MethodSpec", "NumberFormat", "QuantReport",
           "SchemeError", "apply", "available_methods", "bits_for", "bits_per_weight", "calibration_passes",
           "changes_weights", "check_coverage", "coverage_of", "fake_quantize", "get_format", "get_method",
           "is_reference", "linear_census", "method_settings", "register_format", "register_method",
           "target_linears", "unregister_method", "validate_for_model", "validate_scheme", "with_model_defaults"]
