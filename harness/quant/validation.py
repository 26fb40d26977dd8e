"""Checking a scheme before any work: on its own (config time), then against a model's shapes.

Both raise :class:`~harness.quant.format_table.SchemeError` naming the bad value and the fix, before a
weight changes. :func:`with_model_defaults` fills the per-model defaults a scheme leaves unset.
"""
from __future__ import annotations

import copy

from torch import nn

from harness.config import QuantConfig
from harness.quant.calibration import validate_calibration
from harness.quant.coverage import check_coverage, coverage_account
from harness.quant.experts import expert_shapes
from harness.quant.format_table import SchemeError, input_multiple, validate_spec
from harness.quant.kv import validate_kv_cache
from harness.quant.methods import get_method, load_plugins, method_settings
from harness.quant.targets import target_linears


def validate_scheme(scheme: QuantConfig) -> None:
    """Checks that need no model: the plugins, the method and its settings, every spec on its own."""
    load_plugins(scheme)
    spec = get_method(scheme.method)
    method_settings(scheme)
    validate_calibration(scheme.calibration)
    if spec.validate is not None:
        spec.validate(scheme)
    if scheme.weights is not None:
        validate_spec(scheme.weights, "weights")
    if scheme.activations is not None:
        validate_spec(scheme.activations, "activations")
    if scheme.kv_cache is not None:
        validate_kv_cache(scheme.kv_cache)
    formats = spec.weight_formats
    if formats is not None and (scheme.weights is None or scheme.weights.format not in formats):
        grid = "an integer grid" if formats == {"int"} else f"the grids {sorted(formats)}"
        raise SchemeError(f"quant.method={spec.name} solves for {grid}: set quant.weights.format="
                          f"{'|'.join(sorted(formats))}")


def validate_for_model(model: nn.Module, scheme: QuantConfig) -> None:
    """Checks that need the model's shapes (works on a meta-device model too)."""
    validate_scheme(scheme)
    targets, _ = target_linears(model, scheme)
    if scheme.weights is None and scheme.activations is None:
        return
    if scheme.weights is not None:  # before anything else: a silent skip is the worst outcome
        check_coverage(coverage_account(model, scheme, targets), bool(getattr(scheme, "allow_uncovered", False)))
    if scheme.moe.min_tokens < 1:
        raise SchemeError(f"quant.moe.min_tokens={scheme.moe.min_tokens} must be at least 1 (an expert needs "
                          "calibration tokens to be solved; fewer fall back to round-to-nearest)")
    if not targets and not expert_shapes(model, scheme):
        raise SchemeError(f"quant.targets={list(scheme.targets)} minus quant.keep={list(scheme.keep)} selects no "
                          "Linear layer of this model")
    for role, spec in (("weights", scheme.weights), ("activations", scheme.activations)):
        if spec is None:
            continue
        multiple = input_multiple(spec)
        bad = [(n, m.in_features) for n, m in targets.items() if m.in_features % multiple]
        bad += [(n, inp) for n, (_out, inp) in expert_shapes(model, scheme).items() if inp % multiple]
        if bad:
            name, size = bad[0]
            raise SchemeError(
                f"quant.{role}: group/block size {multiple} does not divide the input size {size} of {name} "
                f"({len(bad)} layers affected). Fix: pick a group size that divides {size}, set "
                f"quant.{role}.ragged_groups=true to allow a shorter last group (GPTQ-reference behaviour; "
                "kernels such as Marlin need divisibility), or exclude those layers with quant.keep")


def with_model_defaults(scheme: QuantConfig, ragged_groups: bool) -> QuantConfig:
    """Fill the scheme's unset (None) per-model defaults from the model config."""
    scheme = copy.deepcopy(scheme)
    specs = [scheme.weights, scheme.activations]
    if scheme.kv_cache is not None:
        specs += [scheme.kv_cache.keys, scheme.kv_cache.values]
    for spec in specs:
        if spec is not None and spec.ragged_groups is None:
            spec.ragged_groups = ragged_groups
    return scheme
