"""The method registry: every weight method registers itself, its settings schema and its traits here.

A method is a function ``(model, scheme, context, report)`` that quantizes the target linears' weights in
place and records each layer in the report. Its module calls :func:`register_method` with the dataclass
of its settings (read from the scheme's ``settings:`` block, :func:`method_settings`) and the traits
that validation, the calibrated-weight cache, ``harness.quant.apply``, the sweep planner and the
checkpoint export ask (:class:`MethodSpec`), never the method's name. The built-in methods (rtn, gptq,
awq, smoothquant) register from their own modules, imported by ``harness.quant``; any other registers
from a module listed in the scheme's ``plugins:`` (:func:`load_plugins`).
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from harness.config import QuantConfig
from harness.quant.format_table import SchemeError
from harness.quant.report import QuantReport

# A method quantizes the target linears' weights in place, records each layer in the report and
# returns the names (as in ``model.named_parameters()``) of the parameters it changed (needed when
# it is cacheable: those are what the calibrated-weight cache stores).
Method = Callable[[nn.Module, QuantConfig, Any, QuantReport], "list[str] | None"]

# What a method may need from the calibration context, and the context attribute that provides it.
CONTEXT_NEEDS = {
    "tokens": "tokens",  # the [num_samples, seq_len] token set (block-by-block capture: GPTQ, AWQ)
    "batches": "calibration_batches",  # forward passes over the calibration batches (maxima, static scales)
}

# Checkpoint formats a method's quantized model can be written as (harness.checkpoint.export), and what a
# method that declares one promises about the weights it leaves.
COMPRESSED_TENSORS = "compressed-tensors"
CHECKPOINT_FORMATS = {
    COMPRESSED_TENSORS: "every target weight lies on quant.weights' grid and every other parameter it changes "
                        "stays an ordinary weight of the model (e.g. scales folded into the norms)",
}


@dataclass(frozen=True)
class MethodSpec:
    """A weight method and everything the rest of the harness asks about it."""

    name: str  # the value of quant.method
    quantize: Method
    settings: type | None = None  # dataclass schema of quant.settings (None: the method takes none)
    needs: frozenset[str] = frozenset()  # from the calibration context (keys of CONTEXT_NEEDS)
    cacheable: bool = False  # its weights go in the calibrated-weight cache (keyed by its settings)
    weight_formats: frozenset[str] | None = None  # quant.weights formats it can solve for (None: any, or none)
    exports: frozenset[str] = frozenset()  # checkpoint formats its weights map to (keys of CHECKPOINT_FORMATS)
    validate: Callable[[QuantConfig], None] | None = None  # further checks of its settings (SchemeError)

    @property
    def calibrated(self) -> bool:
        return bool(self.needs)


_METHODS: dict[str, MethodSpec] = {}


def register_method(name: str, *, settings: type | None = None, needs: tuple[str, ...] = (),
                    cacheable: bool = False, weight_formats: tuple[str, ...] | None = None,
                    exports: tuple[str, ...] = (),
                    validate: Callable[[QuantConfig], None] | None = None) -> Callable[[Method], Method]:
    """Decorator registering ``fn`` as method ``name`` with its traits (see :class:`MethodSpec`)."""
    unknown = set(needs) - set(CONTEXT_NEEDS)
    if unknown:
        raise ValueError(f"method {name!r}: unknown needs {sorted(unknown)}; use {sorted(CONTEXT_NEEDS)}")
    if settings is not None and not dataclasses.is_dataclass(settings):
        raise ValueError(f"method {name!r}: settings must be a dataclass type, got {settings!r}")
    if cacheable and not needs:
        raise ValueError(f"method {name!r}: only calibrated methods (with needs) are cacheable")
    unknown = set(exports) - set(CHECKPOINT_FORMATS)
    if unknown:
        raise ValueError(f"method {name!r}: unknown checkpoint formats {sorted(unknown)}; use "
                         f"{sorted(CHECKPOINT_FORMATS)}")

    def decorator(fn: Method) -> Method:
        previous = _METHODS.get(name)
        if previous is not None and previous.quantize.__module__ != fn.__module__:  # a reload may re-register
            raise ValueError(f"method {name!r} is already registered by {previous.quantize.__module__}")
        _METHODS[name] = MethodSpec(name, fn, settings, frozenset(needs), cacheable,
                                    None if weight_formats is None else frozenset(weight_formats), frozenset(exports),
                                    validate)
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
    """The scheme's ``quant.settings`` as its method's settings dataclass, defaults filled (None: it takes none).

    Checked against the dataclass as Hydra checks the run config: an unknown key or a value of the wrong
    type is a :class:`SchemeError` naming the method's settings.
    """
    spec = get_method(scheme.method)
    given = dict(scheme.settings or {})
    if spec.settings is None:
        if given:
            raise SchemeError(f"quant.settings={given}: method {spec.name} takes no settings")
        return None
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(spec.settings), given))
    except OmegaConfBaseException as error:
        fields = [f.name for f in dataclasses.fields(spec.settings)]
        raise SchemeError(f"quant.settings for method {spec.name}: {str(error).splitlines()[0]}; its settings "
                          f"are {fields}") from error
