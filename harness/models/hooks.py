"""Watching a model's modules while it runs: forward pre-hooks held for a block, and calibration batches run
through the model.

Calibration statistics (SmoothQuant's input maxima, the tokens each expert receives) and router captures all
follow one pattern: register a hook on some modules, run batches, remove the hooks, also when a forward fails.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor, nn


@contextlib.contextmanager
def forward_pre_hooks(hooks: Iterable[tuple[nn.Module, Callable[..., Any]]], *,
                      with_kwargs: bool = False) -> Iterator[None]:
    """Each ``(module, hook)`` registered as a forward pre-hook for the block, and removed when it ends (also
    on an error, and for those registered before one failed). ``with_kwargs``: hooks take
    ``(module, args, kwargs)`` instead of ``(module, args)``."""
    handles = []
    try:
        for module, hook in hooks:
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=with_kwargs))
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def run_batches(model: nn.Module, batches: Iterable[Tensor]) -> None:
    """Each batch of token ids (``[batch, tokens]``) through ``model`` on its first parameter's device, without
    a KV cache; the outputs are dropped (what the hooks record is the point)."""
    device = next(model.parameters()).device
    for batch in batches:
        model(batch.to(device), use_cache=False)
