"""What every quantization method shares: target selection, the report, the method registry.

A method is a function ``(model, scheme, context) -> None`` registered by name; it
quantizes the target linears' weights in place and records each layer in the report.
``harness.quant.apply`` validates the scheme against the model's shapes first, runs the
method, then installs activation and KV-cache quantization, which compose with any method.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import Tensor, nn

from harness.config import QuantConfig
from harness.quant.tensor import SchemeError, input_multiple, storage_bits, validate_spec


@dataclass
class LayerReport:
    name: str
    out_features: int
    in_features: int
    bits_per_weight: float
    sqnr_db: float  # 10 log10(|W|^2 / |W - Q(W)|^2); inf when exact
    rel_rms: float  # |W - Q(W)| / |W|


@dataclass
class QuantReport:
    scheme: str
    method: str
    layers: list[LayerReport] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # linears left in high precision by `keep`
    total_params: int = 0
    high_precision_bits: int = 16  # bits of weights that stay unquantized (bf16 deployment)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def add_layer(self, name: str, original: Tensor, quantized: Tensor, bits_per_weight: float) -> None:
        original, quantized = original.detach().float(), quantized.detach().float()
        signal = original.pow(2).sum().item()
        noise = (original - quantized).pow(2).sum().item()
        sqnr = math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-30) / noise)
        rel = 0.0 if signal == 0 else math.sqrt(noise / signal)
        self.layers.append(LayerReport(name, original.shape[0], original.shape[-1], bits_per_weight, sqnr, rel))

    @property
    def quantized_params(self) -> int:
        return sum(l.out_features * l.in_features for l in self.layers)

    @property
    def weight_bits(self) -> float:
        """Total storage bits of all parameters: quantized layers at their rate, the rest at 16."""
        quantized = sum(l.out_features * l.in_features * l.bits_per_weight for l in self.layers)
        return quantized + (self.total_params - self.quantized_params) * self.high_precision_bits

    def summary(self) -> dict[str, float]:
        params = max(self.total_params, 1)
        qparams = max(self.quantized_params, 1)
        finite = [l.sqnr_db for l in self.layers if math.isfinite(l.sqnr_db)]
        return {
            "bits_per_weight": sum(l.out_features * l.in_features * l.bits_per_weight for l in self.layers) / qparams
            if self.layers else float(self.high_precision_bits),
            "bits_per_param_total": self.weight_bits / params,
            "weight_gb": self.weight_bits / 8 / 1e9,
            "quantized_fraction": self.quantized_params / params,
            "sqnr_db_mean": sum(finite) / len(finite) if finite else math.inf,
            "sqnr_db_min": min(finite) if finite else math.inf,
            "layers_quantized": len(self.layers),
            "quantize_s": self.seconds,
        }

    def to_records(self) -> list[dict[str, Any]]:
        return [asdict(l) for l in self.layers]


class QuantContext(Protocol):
    """What a method may need besides the model: calibration data, caches, progress."""

    tokenizer: Any
    device: torch.device

    def calibration_batches(self) -> list[Tensor]: ...


Method = Callable[[nn.Module, QuantConfig, Any, QuantReport], None]
_METHODS: dict[str, Method] = {}


def register_method(name: str) -> Callable[[Method], Method]:
    def decorator(fn: Method) -> Method:
        _METHODS[name] = fn
        return fn
    return decorator


def get_method(name: str) -> Method:
    if name not in _METHODS:
        raise SchemeError(f"quant.method={name!r} is not registered; available: {sorted(_METHODS)}")
    return _METHODS[name]


def available_methods() -> list[str]:
    return sorted(_METHODS)


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name.rsplit(".", 1)[-1], p) for p in patterns)


def target_linears(model: nn.Module, scheme: QuantConfig) -> tuple[dict[str, nn.Linear], list[str]]:
    """Linear layers the scheme quantizes, and the names it keeps in high precision."""
    targets: dict[str, nn.Linear] = {}
    kept: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if _matches(name, list(scheme.keep)) or not _matches(name, list(scheme.targets)):
            kept.append(name)
        else:
            targets[name] = module
    return targets, kept


def validate_scheme(scheme: QuantConfig) -> None:
    """Checks that need no model: every spec on its own."""
    get_method(scheme.method)
    if scheme.weights is not None:
        validate_spec(scheme.weights, "weights")
    if scheme.activations is not None:
        validate_spec(scheme.activations, "activations")
    if scheme.kv_cache is not None:
        from harness.quant.kv import validate_kv_cache
        validate_kv_cache(scheme.kv_cache)
    if scheme.method in ("gptq", "awq") and (scheme.weights is None or scheme.weights.format != "int"):
        raise SchemeError(f"quant.method={scheme.method} solves for an integer grid: set quant.weights.format=int")


def validate_for_model(model: nn.Module, scheme: QuantConfig) -> None:
    """Checks that need the model's shapes (works on a meta-device model too)."""
    validate_scheme(scheme)
    targets, _ = target_linears(model, scheme)
    if scheme.weights is None and scheme.activations is None:
        return
    if not targets:
        raise SchemeError(f"quant.targets={list(scheme.targets)} minus quant.keep={list(scheme.keep)} selects no "
                          "Linear layer of this model")
    for role, spec in (("weights", scheme.weights), ("activations", scheme.activations)):
        if spec is None:
            continue
        multiple = input_multiple(spec)
        bad = [(n, m.in_features) for n, m in targets.items() if m.in_features % multiple]
        if bad:
            name, size = bad[0]
            raise SchemeError(
                f"quant.{role}: group/block size {multiple} does not divide the input size {size} of {name} "
                f"({len(bad)} layers affected). Fix: pick a group size that divides {size}, set "
                f"quant.{role}.ragged_groups=true to allow a shorter last group (GPTQ-reference behaviour; "
                "kernels such as Marlin need divisibility), or exclude those layers with quant.keep")


def with_model_defaults(scheme: QuantConfig, ragged_groups: bool) -> QuantConfig:
    """Fill the scheme's unset (None) per-model defaults from the model config."""
    import copy
    scheme = copy.deepcopy(scheme)
    specs = [scheme.weights, scheme.activations]
    if scheme.kv_cache is not None:
        specs += [scheme.kv_cache.keys, scheme.kv_cache.values]
    for spec in specs:
        if spec is not None and spec.ragged_groups is None:
            spec.ragged_groups = ragged_groups
    return scheme


def bits_for(scheme: QuantConfig, module: nn.Linear) -> float:
    assert scheme.weights is not None
    return storage_bits(scheme.weights, module.out_features, module.in_features)
