"""What every quantization method shares: target selection, the report, the method registry.

A method is a function ``(model, scheme, context, report)`` registered with its traits
(:class:`MethodSpec`: settings schema, what it needs from the calibration context, whether its
weights are cached, which weight formats it solves for); validation, the calibrated-weight
cache, ``harness.quant.apply`` and the sweep planner ask the spec, never the method's name.
It quantizes the target linears' weights in place and records each layer in the report.
``harness.quant.apply`` validates the scheme against the model's shapes first, runs the
method, then installs activation and KV-cache quantization, which compose with any method.
A method or format outside the package registers itself from a module listed in ``quant.plugins``.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Protocol

import torch
from torch import Tensor, nn

from harness.config import QuantConfig
from harness.quant.calibration import validate_calibration
from harness.quant.coverage import check_coverage, coverage_account
from harness.quant.experts import expert_shapes, find_routers, moe_settings, name_matches
from harness.quant.kv import validate_kv_cache
from harness.quant.format_table import (
    SchemeError,
    input_multiple,
    storage_bits,
    validate_spec,
)


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
    kept_params: int = 0  # parameters of the kept linears that count in bits per weight (all but the output head)
    output_head: str | None = None  # the output head's name: not counted in bits per weight (see bits_per_weight)
    input_embedding: tuple[int, int] | None = None  # (vocab, hidden) of an untied input embedding: decode gathers it
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    coverage: Any = None  # harness.quant.coverage.CoverageAccount: every parameter's status
    moe: dict[str, Any] = field(default_factory=dict)  # experts: fused modules, fallback_experts, routers

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
        finite = [l.sqnr_db for l in self.layers if math.isfinite(l.sqnr_db)]
        coverage = self.coverage.metrics() if self.coverage is not None else {}
        return {
            # from the coverage account when there is one: every matrix-shaped weight (experts and routers
            # included), the embeddings and the output head out; on a dense model the same number as below
            "bits_per_weight": coverage["coverage_bits_per_weight"] if coverage else
            bits_per_weight([(l.out_features * l.in_features, l.bits_per_weight)
                             for l in self.layers if l.name != self.output_head],
                            self.kept_params, self.high_precision_bits),
            **coverage,
            # the whole account (rows by status, rule and module kind; uncovered modules) for summary.json
            **({"coverage": self.coverage.to_dict()} if self.coverage is not None else {}),
            **({"moe_fallback_experts": self.moe.get("fallback_experts", 0)} if self.moe else {}),
            **self._router_summary(),
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

    def _router_summary(self) -> dict[str, Any]:
        """Router agreement with the reference on each slice's divergence texts (mixture of experts only):
        ``router`` per slice (per layer in its detail), and means over the slices as flat metrics."""
        if not self.moe.get("router"):
            return {}
        from harness.divergence.router import slice_summaries
        slices = slice_summaries(self, self.moe.get("experts"))
        scored = [s for s in slices.values() if "identical_mean" in s]
        flat = {f"router_{key}": sum(s[key] for s in scored) / len(scored) if "mean" in key else
                (min if key == "identical_min" else max)(s[key] for s in scored)
                for key in ("identical_mean", "overlap_mean", "identical_min", "load_shift_max")} if scored else {}
        return {"router": slices, **flat}


def bits_per_weight(quantized: Iterable[tuple[float, float]], kept_params: float = 0.0,
                    kept_bits: float = 16.0) -> float:
    """Bits per weight of a scheme: its linears' mean storage bits, kept ones at their own precision.

    ``quantized``: (parameters, bits per weight with scales) of each quantized linear; ``kept_params``:
    the linears left in high precision, at ``kept_bits``. The output head is left out by the callers
    (kept or not): by convention it stays at 16 bits, small models tie it to the embedding, and a 70B
    extrapolation is about the decoder blocks; its bytes are in the weight size all the same. Every
    number called bits per weight (run summary, ledger, recommend, candidates) is this one.
    """
    quantized = list(quantized)
    params = sum(p for p, _ in quantized) + kept_params
    if params <= 0:
        return float(kept_bits)
    return (sum(p * b for p, b in quantized) + kept_params * kept_bits) / params


def linear_census(model: nn.Module, kept: list[str]) -> tuple[int, str | None, tuple[int, int] | None]:
    """(parameters of the kept linears but the output head, the output head's name, an untied input
    embedding's shape) of ``model``: what :class:`QuantReport` needs beyond the quantized layers."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head_name = next((name for name, module in model.named_modules() if module is head), None) if head is not None \
        else None
    modules = dict(model.named_modules())
    kept_params = sum(modules[name].weight.numel() for name in kept if name != head_name and name in modules)
    weight = getattr(embedding, "weight", None)
    tied = weight is not None and head is not None and getattr(head, "weight", None) is weight
    shape = (int(weight.shape[0]), int(weight.shape[1])) if weight is not None and weight.dim() == 2 and not tied \
        else None
    return kept_params, head_name, shape


class QuantContext(Protocol):
    """What a method may need besides the model: calibration data, caches, progress."""

    tokenizer: Any
    device: torch.device

    def tokens(self) -> Tensor: ...

    def calibration_batches(self) -> list[Tensor]: ...


# A method quantizes the target linears' weights in place, records each layer in the report and
# returns the names (as in ``model.named_parameters()``) of the parameters it changed (needed when
# it is cacheable: those are what the calibrated-weight cache stores).
Method = Callable[[nn.Module, QuantConfig, Any, QuantReport], "list[str] | None"]

# What a method may need from the calibration context, and the context attribute that provides it.
CONTEXT_NEEDS = {
    "tokens": "tokens",  # the [num_samples, seq_len] token set (block-by-block capture: GPTQ, AWQ)
    "batches": "calibration_batches",  # forward passes over the calibration batches (maxima, static scales)
}


@dataclass(frozen=True)
class MethodSpec:
    """A weight method and everything the rest of the harness asks about it."""

    name: str  # the value of quant.method
    quantize: Method
    settings: type | None = None  # dataclass schema of the method's settings (None: it has none)
    # QuantConfig field holding the settings (the built-ins: quant.gptq.*); None: quant.settings
    section: str | None = None
    needs: frozenset[str] = frozenset()  # from the calibration context (keys of CONTEXT_NEEDS)
    cacheable: bool = False  # its weights go in the calibrated-weight cache (keyed by its settings)
    weight_formats: frozenset[str] | None = None  # quant.weights formats it can solve for (None: any, or none)
    validate: Callable[[QuantConfig], None] | None = None  # further checks of its settings (SchemeError)

    @property
    def calibrated(self) -> bool:
        return bool(self.needs)


_METHODS: dict[str, MethodSpec] = {}


def register_method(name: str, *, settings: type | None = None, section: str | None = None,
                    needs: tuple[str, ...] = (), cacheable: bool = False, weight_formats: tuple[str, ...] | None = None,
                    validate: Callable[[QuantConfig], None] | None = None) -> Callable[[Method], Method]:
    """Decorator registering ``fn`` as method ``name`` with its traits (see :class:`MethodSpec`)."""
    unknown = set(needs) - set(CONTEXT_NEEDS)
    if unknown:
        raise ValueError(f"method {name!r}: unknown needs {sorted(unknown)}; use {sorted(CONTEXT_NEEDS)}")
    if settings is not None and not dataclasses.is_dataclass(settings):
        raise ValueError(f"method {name!r}: settings must be a dataclass type, got {settings!r}")
    if cacheable and not needs:
        raise ValueError(f"method {name!r}: only calibrated methods (with needs) are cacheable")

    def decorator(fn: Method) -> Method:
        previous = _METHODS.get(name)
        if previous is not None and previous.quantize.__module__ != fn.__module__:  # a reload may re-register
            raise ValueError(f"method {name!r} is already registered by {previous.quantize.__module__}")
        _METHODS[name] = MethodSpec(name, fn, settings, section, frozenset(needs), cacheable,
                                    None if weight_formats is None else frozenset(weight_formats), validate)
        return fn
    return decorator


def unregister_method(name: str) -> None:
    """Remove a method (tests that register a toy one)."""
    _METHODS.pop(name, None)


def get_method(name: str) -> MethodSpec:
    if name not in _METHODS:
        raise SchemeError(f"quant.method={name!r} is not registered; available: {sorted(_METHODS)} (a method "
                          "outside harness.quant registers itself from a module listed in quant.plugins)")
    return _METHODS[name]


def available_methods() -> list[str]:
    return sorted(_METHODS)


def load_plugins(scheme: QuantConfig) -> None:
    """Import the modules of ``quant.plugins``: each registers methods or formats on import."""
    for module in scheme.plugins:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise SchemeError(f"quant.plugins: cannot import {module!r} ({error}); put its directory on "
                              "PYTHONPATH or fix the name") from error


def method_settings(scheme: QuantConfig) -> Any:
    """The scheme's settings for its method, as the method's schema (None when it has none).

    Built-ins keep theirs in their own QuantConfig section (``quant.gptq.*``); other methods read
    ``quant.settings``, checked against their dataclass as Hydra checks the built-in sections.
    """
    spec = get_method(scheme.method)
    if spec.section is not None:
        return getattr(scheme, spec.section)
    if spec.settings is None:
        return None
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    try:
        merged = OmegaConf.merge(OmegaConf.structured(spec.settings), dict(scheme.settings or {}))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        fields = [f.name for f in dataclasses.fields(spec.settings)]
        raise SchemeError(f"quant.settings for method {spec.name}: {str(error).splitlines()[0]}; its settings "
                          f"are {fields}") from error


def calibration_passes(scheme: QuantConfig) -> list[tuple[str, frozenset[str]]]:
    """Each part of the scheme that runs over the calibration set, with what it needs from the context.

    The method (when calibrated), static activation scales and static KV-cache scales each make
    one pass; methods under ``rtn`` calibrate too when a scale is static (fp8_static, kv8).
    """
    passes = []
    spec = get_method(scheme.method)
    if spec.calibrated:
        passes.append((f"quant.method={spec.name}", spec.needs))
    if scheme.activations is not None and not scheme.activations.dynamic:
        passes.append(("static activation scales (quant.activations.dynamic=false)", frozenset({"batches"})))
    kv = scheme.kv_cache
    if kv is not None and any(s is not None and not s.dynamic for s in (kv.keys, kv.values)):
        passes.append(("static KV-cache scales (quant.kv_cache.*.dynamic=false)", frozenset({"batches"})))
    return passes


def check_context(scheme: QuantConfig, context: Any) -> None:
    """Refuse a context that lacks what the scheme's calibration passes need, before any work."""
    for what, needs in calibration_passes(scheme):
        missing = [f"{CONTEXT_NEEDS[n]}()" for n in sorted(needs) if not hasattr(context, CONTEXT_NEEDS[n])]
        if missing:
            raise SchemeError(f"{what} needs calibration data (a context with {', '.join(missing)}): pass a "
                              "CalibrationContext to quant.apply")


_matches = name_matches  # the target-selection rule (harness.quant.experts.name_matches)


def target_linears(model: nn.Module, scheme: QuantConfig) -> tuple[dict[str, nn.Linear], list[str]]:
    """Linear layers the scheme quantizes, and the names it keeps in high precision."""
    targets: dict[str, nn.Linear] = {}
    kept: list[str] = []
    routers = set() if moe_settings(scheme).quantize_router else set(find_routers(model))
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if _matches(name, list(scheme.keep)) or not _matches(name, list(scheme.targets)) or name in routers:
            kept.append(name)
        else:
            targets[name] = module
    return targets, kept


def validate_scheme(scheme: QuantConfig) -> None:
    """Checks that need no model: the plugins, the method and its settings, every spec on its own."""
    load_plugins(scheme)
    spec = get_method(scheme.method)
    if scheme.settings and spec.section is not None:
        raise SchemeError(f"quant.settings is for methods registered outside harness.quant; {spec.name}'s settings "
                          f"are quant.{spec.section}.*")
    if scheme.settings and spec.settings is None:
        raise SchemeError(f"quant.settings={dict(scheme.settings)}: method {spec.name} takes no settings")
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
