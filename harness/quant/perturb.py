"""The scheme's own noise floor: a scheme's simulation with its input embeddings moved in the last bit.

A scheme that quantizes activations dynamically (FP8 or INT8 per token) puts some values on a rounding
boundary of its grid; any difference in arithmetic (another GEMM kernel, another batch shape, another
engine) sends them to the neighbouring code, and a greedy reply can then change from that token on. How
often that happens is a property of the scheme on these items, not of any engine. This module measures
it with the harness's own simulation: every entry of the input embeddings' output is multiplied by
``1 ± eps`` (``eps`` the machine epsilon of its dtype, 2^-23 for float32: one part in 2^23, about one
unit in the last place), with a sign that is a fixed hash of (token id, hidden index) and of a seed, so
the perturbation does not depend on the batch a prompt is answered in.

Importing the module (``quant.plugins=[..., harness.quant.perturb]``) registers, for every method
registered before it, a method ``<method>_ulp``: the same method, with the same settings plus
``ulp_seed`` (default 0), after which the hook is installed. Weights are exactly the method's; the
scheme's activation and KV-cache quantizers then run on perturbed inputs (static scales calibrated after
the method see the perturbed inputs too). ``python -m harness.parity`` runs this as the simulation's
twin (:func:`harness.job.parity_runs.make_runs`) to get the scheme's own floor; tests and
:func:`perturb_embeddings` use the hook directly.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from harness.config import QuantConfig
from harness.quant.methods import available_methods, get_method, method_settings, register_method
from harness.quant.report import QuantReport

__all__ = ["SUFFIX", "base_method", "perturb_embeddings", "ulp_signs", "ulp_perturbed"]

SUFFIX = "_ulp"
_MIX = 0x9E3779B1  # Knuth's multiplicative hash constant (odd, 32 bits)


def ulp_signs(ids: torch.Tensor, hidden: int, seed: int = 0) -> torch.Tensor:
    """±1 per (token id, hidden index): ``[*ids.shape, hidden]``, a fixed function of the id, index and seed."""
    index = torch.arange(hidden, device=ids.device, dtype=torch.int64)
    h = (ids.to(torch.int64)[..., None] * hidden + index + (seed + 1) * 0x5BD1E995) & 0xFFFFFFFF
    h = (h * _MIX) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * _MIX) & 0xFFFFFFFF
    return ((h >> 31) & 1).to(torch.int8) * 2 - 1


def ulp_perturbed(ids: torch.Tensor, embeds: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``embeds`` (the embedding of ``ids``) times ``1 + sign * eps``, eps the dtype's machine epsilon."""
    eps = torch.finfo(embeds.dtype).eps
    signs = ulp_signs(ids, embeds.shape[-1], seed).to(embeds.dtype)
    return embeds * (1 + signs * eps)


def perturb_embeddings(model: nn.Module, seed: int = 0) -> torch.utils.hooks.RemovableHandle:
    """Install the last-bit perturbation on ``model``'s input embeddings; the handle removes it."""
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return ulp_perturbed(args[0], output, seed)
    return model.get_input_embeddings().register_forward_hook(hook)


def base_method(name: str) -> str | None:
    """``rtn`` for ``rtn_ulp``; None for a name that is not a perturbed twin."""
    return name[: -len(SUFFIX)] if name.endswith(SUFFIX) else None


def _settings_type(base: Any) -> type:
    fields = [(f.name, f.type, f) for f in dataclasses.fields(base.settings)] if base.settings is not None else []
    # the seed of the sign pattern: another seed is another last-bit perturbation of the same size
    seed = ("ulp_seed", int, dataclasses.field(default=0))
    return dataclasses.make_dataclass(f"{base.name.title().replace('_', '')}UlpSettings", [*fields, seed])


def _register(base_name: str) -> None:
    base = get_method(base_name)
    settings = _settings_type(base)

    def quantize(model: nn.Module, scheme: QuantConfig, context: Any, report: QuantReport) -> list[str] | None:
        given = dataclasses.asdict(method_settings(scheme))
        seed = int(given.pop("ulp_seed"))
        plain = dataclasses.replace(scheme, method=base.name,
                                    settings={k: v for k, v in (scheme.settings or {}).items() if k != "ulp_seed"})
        changed = base.quantize(model, plain, context, report)
        perturb_embeddings(model, seed)
        report.notes.append(f"input embeddings moved by one unit in the last place (seed {seed}): the scheme's "
                            "own noise floor")
        return changed

    quantize.__module__ = __name__
    # not cacheable: a cached entry would skip quantize and with it the hook
    register_method(f"{base.name}{SUFFIX}", settings=settings, needs=tuple(sorted(base.needs)),
                    weight_formats=None if base.weight_formats is None else tuple(base.weight_formats),
                    validate=base.validate)(quantize)


for _name in available_methods():
    if base_method(_name) is None and f"{_name}{SUFFIX}" not in available_methods():
        _register(_name)
