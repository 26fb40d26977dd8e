"""``model.device=auto``: a model spread by accelerate over GPUs, CPU RAM and disk.

``device_map="auto"`` fills the visible GPUs in order (up to ``model.max_memory``), then CPU RAM,
then disk. Layers placed on a GPU stay there and compute there (accelerate's hooks move the
activations between devices); layers offloaded to CPU RAM (on a GPU machine) or to disk keep
their weights off the compute device and have them brought in for each forward. Whatever the
split, the model computes the same function, which is what the harness's stages rely on.

Disk offload is opt-in: it happens only when ``model.max_memory`` names ``disk``; otherwise a
model that does not fit the budget is refused before any weight is read. Weights that are
offloaded (their parameters are on the ``meta`` device, the values live in accelerate's
weights map) cannot be rewritten in place by a weight-quantizing scheme, so such a scheme is
refused on them (:func:`check_quantizable`) rather than silently doing nothing.

Imports run one way: :mod:`harness.models.loading` loads a model and asks this module to place it;
this module knows devices (:mod:`harness.infra.devices`) and accelerate, never the model sources.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness.errors import UserError
from harness.infra.devices import parse_max_memory

log = logging.getLogger(__name__)


class PlacementError(UserError, RuntimeError):
    """The model cannot be placed under the given ``model.max_memory`` (or a scheme cannot run on that placement).

    A user error like :class:`harness.models.loading.ModelLoadError` (:func:`harness.cli.user_errors` lists both).
    """


def _no_split(model: nn.Module) -> list[str]:
    return list(getattr(model, "_no_split_modules", None) or [])


def _check_map(device_map: dict[str, Any], max_memory: dict | None, size_bytes: int) -> None:
    placed = set(map(str, device_map.values()))
    if list(device_map.values()) == ["disk"]:
        raise PlacementError(
            f"model.max_memory={max_memory} leaves no room on any device for the embeddings and one layer "
            f"({size_bytes / 2**30:.2f} GiB model): everything would live on disk. Raise the GPU/CPU budget")
    if "disk" in placed and not (max_memory and "disk" in max_memory):
        budget = ", ".join(f"{k}: {v}" for k, v in (max_memory or {}).items()) or "all free memory"
        raise PlacementError(
            f"the model ({size_bytes / 2**30:.2f} GiB of weights) does not fit model.max_memory ({budget}): "
            f"{sum(v == 'disk' for v in device_map.values())} module(s) would be offloaded to disk. Raise the "
            "budget, add GPUs, or allow disk offload explicitly with a disk entry (slow): "
            "+model.max_memory={cpu: 64GiB, disk: 500GiB}")


def infer_map(model: nn.Module, max_memory: dict | None) -> dict[str, Any]:
    """accelerate's device map for ``model`` (real or on the meta device) under ``max_memory``."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes
    device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=_no_split(model))
    _check_map(device_map, max_memory, compute_module_sizes(model)[""])
    return device_map


def check_fits(source: str, cfg: Any, offload_dir: Path, dtype: torch.dtype) -> dict[str, Any]:
    """Infer the device map of a hub/local model from its config alone (no weights read)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 trust_remote_code=cfg.trust_remote_code)
    device_map = infer_map(empty, parse_max_memory(cfg.max_memory))
    if "disk" in device_map.values():
        offload_dir.mkdir(parents=True, exist_ok=True)
    return device_map


def dispatch(model: nn.Module, max_memory: dict | None, offload_dir: Path) -> nn.Module:
    """Spread an in-memory model (tiny_random, a dequantized GGUF) as ``device_map="auto"`` would."""
    from accelerate import dispatch_model
    device_map = infer_map(model, max_memory)
    targets = set(map(str, device_map.values()))
    if targets == {"cpu"}:
        model.hf_device_map = device_map
        return model.to("cpu")
    if "disk" in targets:
        offload_dir.mkdir(parents=True, exist_ok=True)
    log.info("device map: %s", _summary(device_map))
    model = dispatch_model(model, device_map=device_map, offload_dir=str(offload_dir))
    model.hf_device_map = device_map
    return model


def _summary(device_map: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for target in device_map.values():
        counts[str(target)] = counts.get(str(target), 0) + 1
    return ", ".join(f"{n} module(s) on {t}" for t, n in counts.items())


def offloaded(model: nn.Module) -> list[str]:
    """Names of the parameters whose values are held off-module by accelerate (meta placeholders)."""
    return [name for name, param in model.named_parameters() if param.device.type == "meta"]


def check_quantizable(model: nn.Module, changes_weights: bool) -> None:
    """Refuse a weight-changing scheme on a model with offloaded weights (it would change nothing)."""
    names = offloaded(model)
    if changes_weights and names:
        raise PlacementError(
            f"{len(names)} weight(s) are offloaded (e.g. {names[0]}): a weight-quantizing scheme cannot rewrite "
            "them in place. Give the model enough GPU/CPU memory (model.max_memory without disk), or run a "
            "scheme that leaves weights alone (KV-cache or activation-only)")


def materialized_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with real tensors, also when accelerate offloaded its weights."""
    import copy

    from accelerate.utils import align_module_device
    if not any(p.device.type == "meta" for p in module.parameters()):
        return copy.deepcopy(module)
    with align_module_device(module, torch.device("cpu")):
        clone = copy.deepcopy(module)
    for name in ("_hf_hook", "_old_forward"):
        clone.__dict__.pop(name, None)
    if "forward" in clone.__dict__:
        del clone.forward  # accelerate's wrapped forward; the class's own forward is the computation
    return clone
