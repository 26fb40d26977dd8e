"""Mixture-of-experts experts in a checkpoint: one tensor set per expert, under the names engines read.

transformers 5 keeps a MoE layer's experts as fused 3-D parameters (``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I]); checkpoints on the hub, llm-compressor's output and vLLM's loaders
(``FusedMoE.make_expert_params_mapping``) name each expert's matrices separately:
``<layer>.mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj`` (Qwen2/3-MoE, OLMoE,
DeepSeek-V3), ``<layer>.block_sparse_moe.experts.<e>.w1`` / ``w3`` / ``w2`` (Mixtral), each with its
compressed-tensors tensors (``weight_packed``, ``weight_scale``, ``weight_shape``, …).

The names are not hard-coded here: they are read from transformers' own conversion mapping, the
table it uses to fuse such checkpoints on load and to split them again on ``save_pretrained``
(``transformers.conversion_mapping``: a converter from ``experts.*.<gate>.weight`` +
``experts.*.<up>.weight`` to ``experts.gate_up_proj``, and module renamings such as Mixtral's
``block_sparse_moe`` → ``mlp``). So a checkpoint written here is one transformers fuses back on load,
and a model family transformers knows comes out under its hub names. A family without a mapping
gets vLLM's generic names (``gate_proj`` / ``up_proj`` / ``down_proj``).

:func:`to_checkpoint_layout` replaces each fused module of a model by a ModuleList of per-expert
``nn.Linear`` (so compressed-tensors, which quantizes Linears, packs each expert as it packs any
Linear) and :func:`restore_fused` writes the Linears back into the fused parameters.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from harness.quant.experts import FusedExperts, UnfusedExperts, find_fused_experts, name_matches

__all__ = ["ExpertModule", "checkpoint_names", "expert_modules", "harness_expert_weights", "restore_fused",
           "to_checkpoint_layout"]

GENERIC = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


@dataclass
class ExpertModule:
    """One fused experts module of a model, and how its experts are named in a checkpoint."""

    name: str  # module name in the model (``model.layers.0.mlp.experts``)
    fused: FusedExperts
    checkpoint_projections: dict[str, str]  # harness projection → checkpoint projection (gate_proj → w1)
    mapped: bool = True  # the names come from transformers' mapping (False: vLLM's generic names, a guess)

    @property
    def num_experts(self) -> int:
        return self.fused.num_experts

    def projections(self) -> tuple[str, ...]:
        return self.fused.projections()

    def shape(self, proj: str) -> tuple[int, int]:
        return self.fused.shape(proj)

    def harness_names(self) -> list[str]:
        """``<module>.<e>.<proj>``: the per-expert Linear names the harness's quantizers use."""
        return self.fused.expert_names()

    def layout_name(self, harness_name: str) -> str:
        """The per-expert Linear's name in the checkpoint layout of the same model (``….3.gate_proj`` →
        ``….3.w1`` for Mixtral): before transformers' module renamings (see :func:`checkpoint_names`)."""
        prefix, _, proj = harness_name.rpartition(".")
        return f"{prefix}.{self.checkpoint_projections[proj]}"


def _pattern(text: str) -> re.Pattern:
    """A conversion-mapping pattern (``*`` a wildcard, dots literal) matching a name's end."""
    return re.compile(re.escape(text).replace(r"\*", r"[^.]+") + "$")


def _projection_names(model: nn.Module, fused: FusedExperts) -> dict[str, str] | None:
    """gate/up/down → the checkpoint's projection names, from transformers' converter into this module; None
    when transformers has none (it then cannot load per-expert tensors into this module)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter

        conversions = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # noqa: BLE001 — older transformers, or a model outside its tables
        return None
    names: dict[str, str] = {}
    for converter in conversions:
        if not isinstance(converter, WeightConverter):
            continue
        targets = list(converter.target_patterns)
        sources = list(converter.source_patterns)
        for param, projections in ((fused.fused_param("gate_proj" if fused.has_gate else "up_proj"),
                                    ("gate_proj", "up_proj") if fused.has_gate else ("up_proj",)),
                                   ("down_proj", ("down_proj",))):
            if len(targets) != 1 or not _pattern(targets[0]).search(f"{fused.name}.{param}"):
                continue
            found = [re.fullmatch(r".*experts\.\*\.([A-Za-z0-9_]+)\.weight", s) for s in sources]
            if len(found) == len(projections) and all(found):
                names.update({proj: m.group(1) for proj, m in zip(projections, found)})  # type: ignore[union-attr]
    return names if set(names) == set(fused.projections()) else None


def expert_modules(model: nn.Module) -> dict[str, ExpertModule]:
    """Every experts module of ``model``, fused or unfused by the harness (an activation-quantized scheme
    keeps its experts as per-expert Linears), by module name."""
    found: dict[str, FusedExperts] = dict(find_fused_experts(model))
    for name, module in model.named_modules():
        if isinstance(module, UnfusedExperts):
            found[name] = module.fused
    out = {}
    for name, fused in sorted(found.items()):
        names = _projection_names(model, fused)
        out[name] = ExpertModule(name, fused, names or {p: GENERIC[p] for p in fused.projections()}, names is not None)
    return out


def harness_expert_weights(model: nn.Module, modules: dict[str, ExpertModule]) -> dict[str, Tensor]:
    """Each expert's current ``[out, in]`` matrix by harness name: the per-expert Linear's weight where the
    experts are unfused (a method may have rebound it, ending the view), else a view of the fused parameter."""
    weights: dict[str, Tensor] = {}
    for name, info in modules.items():
        module = model.get_submodule(name)
        for expert in range(info.num_experts):
            for proj in info.projections():
                if isinstance(module, UnfusedExperts):
                    weights[f"{name}.{expert}.{proj}"] = getattr(module[expert], proj).weight.detach()
                else:
                    weights[f"{name}.{expert}.{proj}"] = info.fused.matrix(expert, proj).detach()
    return weights


class _CheckpointExpert(nn.Module):
    """One expert's projections as Linears named as the checkpoint names them."""


@dataclass
class LayoutState:
    """What :func:`to_checkpoint_layout` replaced, for :func:`restore_fused`."""

    swaps: list[tuple[nn.Module, str, ExpertModule, nn.ModuleList]] = field(default_factory=list)


@torch.no_grad()
def to_checkpoint_layout(model: nn.Module, modules: dict[str, ExpertModule],
                         weights: dict[str, Tensor] | None = None) -> LayoutState:
    """Replace each fused experts module of ``model`` (a plain, fused copy) by per-expert Linears.

    ``modules`` describes the experts (from the harness's model or this one); ``weights`` (harness names)
    gives each Linear its matrix, otherwise the fused parameter's is copied. Biases (gpt-oss) are copied.
    """
    state = LayoutState()
    dtype = next(model.parameters()).dtype
    for name, info in modules.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        fused_module = getattr(parent, attr)
        fused = FusedExperts(name, fused_module, info.num_experts, info.fused.transposed, info.fused.concatenated,
                             info.fused.has_gate)
        experts = nn.ModuleList()
        for expert in range(info.num_experts):
            holder = _CheckpointExpert()
            for proj in info.projections():
                harness_name = f"{name}.{expert}.{proj}"
                matrix = weights[harness_name] if weights is not None else fused.matrix(expert, proj)
                bias = fused.bias(expert, proj)
                linear = nn.Linear(matrix.shape[1], matrix.shape[0], bias=bias is not None, dtype=dtype)
                linear.weight.data.copy_(matrix.to(dtype))
                if bias is not None:
                    linear.bias.data.copy_(bias.to(dtype))
                linear.weight.requires_grad_(False)
                setattr(holder, info.checkpoint_projections[proj], linear)
            experts.append(holder)
        object.__setattr__(experts, "fused_module", fused_module)
        setattr(parent, attr, experts)
        state.swaps.append((parent, attr, ExpertModule(name, fused, info.checkpoint_projections), experts))
    return state


@torch.no_grad()
def restore_fused(state: LayoutState) -> None:
    """Write each per-expert Linear's (decompressed) weight back into its fused parameter; restore the module."""
    for parent, attr, info, experts in state.swaps:
        fused = info.fused
        for expert, holder in enumerate(experts):
            for proj in info.projections():
                linear = getattr(holder, info.checkpoint_projections[proj])
                target = fused.matrix(expert, proj)
                target.copy_(linear.weight.detach().to(device=target.device, dtype=target.dtype))
        setattr(parent, attr, fused.module)


def checkpoint_names(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """``model``'s state-dict keys → the names ``save_pretrained`` writes them under.

    transformers renames some modules on save (Mixtral's ``mlp`` → ``block_sparse_moe``, its
    conversion mapping reversed); applied here to placeholder tensors, one per key, so the result
    is exactly what ``save_pretrained`` does to the same keys. Keys a converter would merge or split
    (fused experts still in the model) are refused: the per-expert layout must be in place first.
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without conversion mappings saves keys as they are
        return {key: key for key in keys}
    placeholders = {key: torch.tensor(index) for index, key in enumerate(keys)}
    renamed = revert_weight_conversion(model, dict(placeholders))
    out: dict[str, str] = {}
    for new_key, value in renamed.items():
        value = value[0] if isinstance(value, list) else value
        if value.dim() != 0:
            raise ValueError(f"transformers converts {new_key} on save; put the experts in the per-expert layout first")
        out[keys[int(value)]] = new_key
    return out


def expert_selection(modules: dict[str, ExpertModule], targets: list[str], keep: list[str]
                     ) -> tuple[list[str], list[str], list[str]]:
    """(quantized, kept, partial) expert modules under a scheme's ``targets`` / ``keep`` patterns: a module is
    quantized when every expert matrix is selected, kept when none is, partial otherwise."""
    quantized, kept, partial = [], [], []
    for name, info in modules.items():
        selected = [name_matches(n, targets) and not name_matches(n, keep) for n in info.harness_names()]
        (quantized if all(selected) else kept if not any(selected) else partial).append(name)
    return quantized, kept, partial


def expert_checkpoint_names(model: nn.Module, modules: dict[str, ExpertModule] | None = None) -> dict[str, str]:
    """Each expert matrix's harness name (``….mlp.experts.3.gate_proj``) → its module name in a checkpoint
    (``….block_sparse_moe.experts.3.w1`` for Mixtral): the per-expert layout's name after transformers' save
    renamings. Needs no layout change: per-expert keys meet no converter, only renamings."""
    modules = expert_modules(model) if modules is None else modules
    layout = {name: info.layout_name(name) for info in modules.values() for name in info.harness_names()}
    saved = checkpoint_names(model, [f"{name}.weight" for name in layout.values()])
    return {name: saved[f"{target}.weight"].removesuffix(".weight") for name, target in layout.items()}
