"""Target selection: the Linear layers a scheme quantizes, the ones it keeps, and their storage bits."""
from __future__ import annotations

from torch import nn

from harness.config import QuantConfig
from harness.quant.experts import find_routers, moe_settings, name_matches
from harness.quant.format_table import storage_bits


def target_linears(model: nn.Module, scheme: QuantConfig) -> tuple[dict[str, nn.Linear], list[str]]:
    """Linear layers the scheme quantizes, and the names it keeps in high precision.

    A linear is a target when a ``quant.targets`` pattern matches its name and no ``quant.keep`` pattern
    does (:func:`harness.quant.experts.name_matches`); mixture-of-experts routers are kept unless
    ``quant.moe.quantize_router``.
    """
    targets: dict[str, nn.Linear] = {}
    kept: list[str] = []
    routers = set() if moe_settings(scheme).quantize_router else set(find_routers(model))
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name_matches(name, list(scheme.keep)) or not name_matches(name, list(scheme.targets)) or name in routers:
            kept.append(name)
        else:
            targets[name] = module
    return targets, kept


def bits_for(scheme: QuantConfig, module: nn.Linear) -> float:
    """Storage bits per weight of ``module`` on the scheme's weight grid, scales included."""
    assert scheme.weights is not None
    return storage_bits(scheme.weights, module.out_features, module.in_features)
