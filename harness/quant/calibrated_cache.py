"""Cache of calibrated weights, so that a sweep's jobs and later runs never redo calibration.

``harness.quant.apply`` runs every method whose spec says ``cacheable`` through :func:`run_cached`.
An entry holds every parameter a calibrated method changed (quantized target weights, and
for AWQ the norms and linears that absorbed its scales) as safetensors, plus the method's
per-layer report. It is keyed by the model's identity, the parts of the scheme that shape
the weights (method, weight spec, targets, method settings; *not* the name, activation or
KV-cache settings, so ``gptq_w4g128_kv8`` reuses ``gptq_w4g128``'s entry), the calibration
source when it is not the default (name and text digest) and the content hash of the
calibration tokens. The first job computes under the entry's file lock;
concurrent jobs wait on it and then load. Every entry is checked against its manifest (size and
SHA-256 per file, :meth:`harness.infra.cache.Cache.usable`) before a single weight is copied into the
model, so a damaged entry can never leave the model half-loaded.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Callable

import torch
from torch import nn

from harness.config import MoEQuantConfig, QuantConfig
from harness.infra.cache import stable_hash
from harness.quant.methods import get_method, method_settings
from harness.quant.report import LayerReport, QuantReport

log = logging.getLogger(__name__)

NAMESPACE = "calibrated"
# Bump when a change to a cacheable method (GPTQ, AWQ) alters the weights it produces: old entries are then ignored.
ALGORITHM_VERSION = 1
_TENSORS = "weights.safetensors"
_REPORT = "report.json"


def _as_json_data(value: Any) -> Any:
    """A dataclass or OmegaConf node as plain JSON-able data."""
    if value is None:
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    from omegaconf import DictConfig, ListConfig, OmegaConf
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def scheme_identity(scheme: QuantConfig, chat: bool = False) -> dict[str, Any]:
    """The parts of a scheme that determine the calibrated weights.

    A calibration source other than the default adds its name and text digest
    (``calibration.source_identity``), and so does the chat format (``chat``: the calibration
    format in force); the default source in plain format adds nothing, so its keys are unchanged.
    """
    from harness.quant.calibration import source_identity
    spec = get_method(scheme.method)
    weights = _as_json_data(scheme.weights)
    if isinstance(weights, dict) and weights.get("int_range") == "restricted":
        del weights["int_range"]  # the default grid: keys made before the option existed stay valid
    settings = _as_json_data(method_settings(scheme)) if spec.cacheable else None
    if isinstance(settings, dict) and settings.get("coarse_to_fine") is False:
        del settings["coarse_to_fine"]  # AWQ's full grid: keys made before the option existed stay valid
    identity = {
        "method": scheme.method,
        "weights": weights,
        "targets": list(scheme.targets),
        "keep": list(scheme.keep),
        "settings": settings,
        "version": ALGORITHM_VERSION,
    }
    source = source_identity(scheme.calibration, chat)
    if source is not None:
        identity["calibration_source"] = source
    moe = getattr(scheme, "moe", None)
    if moe is not None and moe != MoEQuantConfig():  # mixture-of-experts options; the defaults add nothing
        identity["moe"] = _as_json_data(moe)
    return identity


def calibrated_key(model_key: str, scheme: QuantConfig, calibration_hash: str, chat: bool = False) -> str:
    return stable_hash({"model": model_key, "scheme": scheme_identity(scheme, chat), "calibration": calibration_hash},
                       24)


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
    chat = getattr(context, "format", None) == "chat"
    key = calibrated_key(context.model_key, scheme, context.calibration_hash, chat)
    with cache.lock(NAMESPACE, key):
        if cache.usable(NAMESPACE, key):  # complete and intact (a damaged entry is moved aside and recomputed)
            _load(model, cache.entry(NAMESPACE, key), report)
            log.info("%s: loaded calibrated weights from the cache (%s)", scheme.method, key)
            report.notes.append(f"{scheme.method}: calibrated weights loaded from cache entry {key}")
            return True
        first_layer = len(report.layers)
        names = compute()
        _store(model, names, report.layers[first_layer:], cache, key)
        report.notes.append(f"{scheme.method}: calibrated weights stored in cache entry {key}")
        return False


_SHARDS = "shards.json"  # {file: [tensor names]}: one safetensors file per decoder block (or other module)


def _shard_of(name: str) -> str:
    """The shard a parameter is stored in: its block (``model.layers.7``) or its top module."""
    parts = name.split(".")
    for index, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:index + 1])
    return parts[0]


def _store(model: nn.Module, names: list[str], layers: list[LayerReport], cache: Any, key: str) -> None:
    """Write the changed parameters one shard (decoder block) at a time.

    Only one shard's tensors are copied to host memory at once, so the peak host RAM of a save
    is about the largest block's changed weights (8B in bf16: ~0.4 GB), not all of them (~14 GB).
    """
    from safetensors.torch import save_file

    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in names if n not in params]
    if missing:
        raise KeyError(f"calibrated parameters {missing[:3]} are not parameters of the model")
    shards: dict[str, list[str]] = {}
    for name in sorted(set(names)):
        shards.setdefault(_shard_of(name), []).append(name)
    index: dict[str, list[str]] = {}
    with cache.writing(NAMESPACE, key) as directory:
        for number, (_shard, members) in enumerate(shards.items()):
            filename = f"weights-{number:05d}.safetensors"
            tensors = {name: params[name].detach().to("cpu").contiguous().clone() for name in members}
            save_file(tensors, str(directory / filename))
            del tensors
            index[filename] = members
        (directory / _SHARDS).write_text(json.dumps(index, indent=1))
        (directory / _REPORT).write_text(json.dumps([dataclasses.asdict(l) for l in layers], indent=1))


@torch.no_grad()
def _load(model: nn.Module, directory: Any, report: QuantReport) -> None:
    """Copy the stored parameters into ``model`` one tensor at a time (memory-mapped reads).

    Reads the sharded layout and the single-file layout of older entries alike.
    """
    from safetensors import safe_open

    files = (list(json.loads((directory / _SHARDS).read_text())) if (directory / _SHARDS).exists()
             else [_TENSORS])
    params = dict(model.named_parameters(remove_duplicate=False))
    for filename in files:
        with safe_open(str(directory / filename), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                shape = tuple(handle.get_slice(name).get_shape())
                if name not in params or tuple(params[name].shape) != shape:
                    raise RuntimeError(
                        f"calibrated cache entry {directory} does not match this model ({name}: "
                        f"{shape} vs {tuple(params[name].shape) if name in params else 'absent'}); "
                        "delete the entry to recompute it")
                value = handle.get_tensor(name)
                params[name].data.copy_(value.to(device=params[name].device, dtype=params[name].dtype))
                del value
    for record in json.loads((directory / _REPORT).read_text()):
        report.layers.append(LayerReport(**record))
