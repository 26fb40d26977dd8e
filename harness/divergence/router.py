"""Router divergence of a mixture-of-experts model: does the quantized model send tokens to the same experts?

On the same teacher-forced texts, per MoE layer, the reference's and the quantized model's top-k expert sets
are compared token by token:

* ``identical``: the share of tokens whose selected expert set is the same (order ignored);
* ``overlap``: the mean share of the k experts both select (``|S_ref ∩ S_q| / k``);
* ``load_shift``: the total-variation distance between the two expert-load distributions (the share of
  routed slots each expert receives), 0 when every expert gets the same share; ``max_load_change`` the
  largest change of one expert's share.

An expert-selection flip is a discrete error: the token's MLP output comes from a different expert, however
small the weight error that caused it. Both models are identical at ``quant=none``: every layer then reads
identical = overlap = 1 and load_shift = 0 exactly. The routing is captured at the experts module's input
(``top_k_index``, the argument every transformers 5 experts module takes), fused or unfused alike.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor, nn

from harness.models.hooks import forward_pre_hooks, run_batches

__all__ = ["LayerRouting", "capture_routing", "compare_routing", "routing_metrics", "routing_summary"]


@dataclass(frozen=True)
class LayerRouting:
    layer: str  # the experts module's name
    tokens: int
    top_k: int
    num_experts: int
    identical: float
    overlap: float
    load_shift: float
    max_load_change: float


def _experts_modules(model: nn.Module) -> dict[str, tuple[nn.Module, int]]:
    """Experts modules by name with their expert count: fused (a 3-D ``down_proj``) or unfused (harness.quant's
    per-expert ModuleList, which keeps its fused original as ``fused``). Duck-typed: divergence sits below
    quant in the package layers and does not import it."""
    found = {}
    for name, module in model.named_modules():
        down = getattr(module, "down_proj", None)
        if isinstance(module, nn.ModuleList) and getattr(module, "fused", None) is not None:
            found[name] = (module, len(module))
        elif isinstance(down, nn.Parameter) and down.dim() == 3:
            found[name] = (module, int(down.shape[0]))
    return found


@torch.no_grad()
def capture_routing(model: nn.Module, sequences: Iterable[Tensor]) -> dict[str, Tensor]:
    """Each MoE layer's selected experts ``[tokens, k]`` (int64, on CPU) over ``sequences`` (token id tensors
    ``[1, T]`` or ``[T]``, run one at a time so that no padding enters the count), in order."""
    with capturing(model) as captured:
        run_batches(model, (ids if ids.dim() == 2 else ids.unsqueeze(0) for ids in sequences))
    return captured


def num_experts(model: nn.Module) -> dict[str, int]:
    return {name: experts for name, (_m, experts) in _experts_modules(model).items()}


def compare_routing(reference: dict[str, Tensor], quantized: dict[str, Tensor],
                    experts: dict[str, int]) -> list[LayerRouting]:
    """Per layer (in the reference's order): agreement and load shift of two captures of the same texts."""
    out = []
    for layer, ref in reference.items():
        got = quantized.get(layer)
        if got is None or got.shape != ref.shape:
            raise ValueError(f"router divergence: layer {layer} has {None if got is None else tuple(got.shape)} "
                             f"selections against the reference's {tuple(ref.shape)}; score the same texts")
        count, k = ref.shape
        e = experts[layer]
        ref_hot = torch.zeros(count, e, dtype=torch.bool).scatter_(1, ref, True)
        got_hot = torch.zeros(count, e, dtype=torch.bool).scatter_(1, got, True)
        common = (ref_hot & got_hot).sum(dim=1)
        identical = (ref_hot == got_hot).all(dim=1)
        ref_load = ref_hot.sum(dim=0).double() / max(count * k, 1)
        got_load = got_hot.sum(dim=0).double() / max(count * k, 1)
        change = (ref_load - got_load).abs()
        out.append(LayerRouting(layer, count, k, e, float(identical.double().mean()),
                                float(common.double().mean() / k), float(0.5 * change.sum()), float(change.max())))
    return out


def routing_summary(layers: list[LayerRouting]) -> dict[str, Any]:
    """Means over layers, the worst layer, and the first layer (in depth order) where agreement falls below 1."""
    if not layers:
        return {}
    first = next((l.layer for l in layers if l.identical < 1.0), None)
    worst = min(layers, key=lambda l: l.identical)
    return {"layers": len(layers), "identical_mean": sum(l.identical for l in layers) / len(layers),
            "overlap_mean": sum(l.overlap for l in layers) / len(layers),
            "identical_min": worst.identical, "worst_layer": worst.layer,
            "load_shift_max": max(l.load_shift for l in layers), "first_disagreeing_layer": first,
            "per_layer": [asdict(l) for l in layers]}


def routing_metrics(summary: dict[str, Any], prefix: str = "router") -> dict[str, float]:
    """Flat MLflow metrics of a summary: ``router/identical_mean`` etc."""
    keys = ("identical_mean", "overlap_mean", "identical_min", "load_shift_max")
    return {f"{prefix}/{key}": float(summary[key]) for key in keys if key in summary}


@contextlib.contextmanager
def capturing(model: nn.Module) -> Iterator[dict[str, Tensor]]:
    """Record each MoE layer's top-k selections of the forwards run inside the block (one text at a time).

    Yields a dict filled on exit (layer → ``[tokens, k]``); empty for a dense model, at no cost.
    """
    modules = _experts_modules(model)
    found: dict[str, Tensor] = {}
    parts: dict[str, list[Tensor]] = {name: [] for name in modules}
    hooks = []
    for name, (module, _experts) in modules.items():
        def record(_module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            index = args[1] if len(args) > 1 else next(v for k, v in kwargs.items() if "ind" in k)
            parts[name].append(index.detach().reshape(-1, index.shape[-1]).to("cpu", torch.int64))
        hooks.append((module, record))
    try:
        with forward_pre_hooks(hooks, with_kwargs=True):
            yield found
    finally:
        found.update({name: torch.cat(p) for name, p in parts.items() if p})


def record_slice(model: nn.Module, slice_name: str, reference: dict[str, Tensor] | None,
                 quantized: dict[str, Tensor]) -> None:
    """Add one text's routing comparison to the slice's running totals in the model's quant report.

    ``harness.quant.apply`` leaves its report on the model (``_harness_quant_report``); the totals go to its
    ``moe["router"]`` (summary.json, MLflow, the report). A reference scored without routing (a cache entry
    from before routing was recorded) is counted as missing.
    """
    report = getattr(model, "_harness_quant_report", None)
    if report is None or not quantized:
        return
    slices = report.moe.setdefault("router", {})
    entry = slices.setdefault(slice_name, {"texts": 0, "missing_reference": 0, "selections": {}})
    entry["texts"] += 1
    if not reference:
        entry["missing_reference"] += 1
        return
    for layer, got in quantized.items():
        ref = reference.get(layer)
        if ref is None or ref.shape != got.shape:
            entry["missing_reference"] += 1
            return
    for layer, got in quantized.items():
        pair = entry["selections"].setdefault(layer, [[], []])
        pair[0].append(reference[layer])
        pair[1].append(got)


def slice_summaries(report: Any, experts: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """Per slice: :func:`routing_summary` of every text recorded by :func:`record_slice`."""
    out = {}
    for slice_name, entry in (getattr(report, "moe", {}) or {}).get("router", {}).items():
        selections = entry["selections"]
        if not selections:
            out[slice_name] = {"texts": entry["texts"], "missing_reference": entry["missing_reference"]}
            continue
        ref = {layer: torch.cat(pair[0]) for layer, pair in selections.items()}
        got = {layer: torch.cat(pair[1]) for layer, pair in selections.items()}
        counts = experts or {layer: int(max(ref[layer].max(), got[layer].max())) + 1 for layer in ref}
        summary = routing_summary(compare_routing(ref, got, counts))
        summary.update(texts=entry["texts"], missing_reference=entry["missing_reference"])
        out[slice_name] = summary
    return out
