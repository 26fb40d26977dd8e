"""Cache of calibrated weights, so that a sweep's jobs and later runs never redo calibration.

``harness.quant.apply`` runs every method whose spec says ``cacheable`` through :func:`run_cached`.
An entry holds every parameter a calibrated method changed (quantized target weights, and
for AWQ the norms and linears that absorbed its scales) as safetensors, plus the method's
per-layer report. It is keyed by the model's identity, the parts of the scheme that shape
the weights (method, weight spec, targets, method settings; *not* the name, activation or
KV-cache settings, so ``gptq_w4g128_kv8`` reuses ``gptq_w4g128``'s entry), the calibration
source when it is not the default (name and text digest) and the content hash of the
calibration tokens. The first job computes under the entry's file lock;
concurrent jobs wait on it and then load.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Callable

import torch
from torch import nn

from harness.cache import stable_hash
from harness.config import QuantConfig
from harness.quant.base import LayerReport, QuantReport, get_method, method_settings

log = logging.getLogger(__name__)

NAMESPACE = "calibrated"
# Bump when a change to a cacheable method (GPTQ, AWQ) alters the weights it produces: old entries are then ignored.
ALGORITHM_VERSION = 1
_TENSORS = "weights.safetensors"
_REPORT = "report.json"


def _plain(value: Any) -> Any:
    """A dataclass or OmegaConf node as plain JSON-able data."""
    if value is None:
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    from omegaconf import DictConfig, ListConfig, OmegaConf
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def scheme_identity(scheme: QuantConfig) -> dict[str, Any]:
    """The parts of a scheme that determine the calibrated weights.

    A calibration source other than the default adds its name and text digest
    (``calibration.source_identity``); the default adds nothing, so its keys are unchanged.
    """
    from harness.quant.calibration import source_identity
    spec = get_method(scheme.method)
    identity = {
        "method": scheme.method,
        "weights": _plain(scheme.weights),
        "targets": list(scheme.targets),
        "keep": list(scheme.keep),
        "settings": _plain(method_settings(scheme)) if spec.cacheable else None,
        "version": ALGORITHM_VERSION,
    }
    source = source_identity(scheme.calibration)
    if source is not None:
        identity["calibration_source"] = source
    return identity


def calibrated_key(model_key: str, scheme: QuantConfig, calibration_hash: str) -> str:
    return stable_hash({"model": model_key, "scheme": scheme_identity(scheme), "calibration": calibration_hash}, 24)


def run_cached(model: nn.Module, scheme: QuantConfig, context: Any, report: QuantReport,
               compute: Callable[[], list[str]]) -> bool:
    """Load the calibrated weights of ``model`` from the cache, or ``compute()`` and store them.

    ``compute`` quantizes ``model`` in place, adds its layers to ``report`` and returns the
    names (as in ``model.named_parameters()``) of every parameter it changed. Returns True on
    a cache hit. A context without a cache (unit tests) just computes.
    """
    cache = getattr(context, "cache", None)
    if cache is None:
        compute()
        return False
    key = calibrated_key(context.model_key, scheme, context.calibration_hash)
    with cache.lock(NAMESPACE, key):
        if cache.complete(NAMESPACE, key):
            _load(model, cache.entry(NAMESPACE, key), report)
            log.info("%s: loaded calibrated weights from the cache (%s)", scheme.method, key)
            report.notes.append(f"{scheme.method}: calibrated weights loaded from cache entry {key}")
            return True
        first_layer = len(report.layers)
        names = compute()
        _store(model, names, report.layers[first_layer:], cache, key)
        report.notes.append(f"{scheme.method}: calibrated weights stored in cache entry {key}")
        return False


def _store(model: nn.Module, names: list[str], layers: list[LayerReport], cache: Any, key: str) -> None:
    from safetensors.torch import save_file

    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in names if n not in params]
    if missing:
        raise KeyError(f"calibrated parameters {missing[:3]} are not parameters of the model")
    tensors = {name: params[name].detach().to("cpu").contiguous().clone() for name in sorted(set(names))}
    with cache.writing(NAMESPACE, key) as directory:
        save_file(tensors, str(directory / _TENSORS))
        (directory / _REPORT).write_text(json.dumps([dataclasses.asdict(l) for l in layers], indent=1))


@torch.no_grad()
def _load(model: nn.Module, directory: Any, report: QuantReport) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(directory / _TENSORS))
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, value in tensors.items():
        if name not in params or params[name].shape != value.shape:
            raise RuntimeError(
                f"calibrated cache entry {directory} does not match this model ({name}: "
                f"{tuple(value.shape)} vs {tuple(params[name].shape) if name in params else 'absent'}); "
                "delete the entry to recompute it")
        params[name].data.copy_(value.to(device=params[name].device, dtype=params[name].dtype))
    for record in json.loads((directory / _REPORT).read_text()):
        report.layers.append(LayerReport(**record))
