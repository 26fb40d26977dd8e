"""Mixture-of-experts models: finding fused experts, and quantizing each expert as a Linear.

transformers 5 stores a MoE layer's experts as fused 3-D parameters of one module
(``Qwen3MoeExperts``, ``MixtralExperts``, ``OlmoeExperts``, ``GptOssExperts``, ``DeepseekV3Experts``…):
``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], or transposed ([E, H, 2I], [E, I, H]) with
gate and up interleaved (gpt-oss), optionally with biases. The harness's methods work on
``nn.Linear``; rather than teach each of them a second kind of weight, :func:`unfuse_experts`
replaces each fused module by :class:`UnfusedExperts`: a ModuleList of per-expert
``gate_proj``/``up_proj``/``down_proj`` Linears whose weights are *views* of the fused parameters
(no copy), named ``<experts>.<e>.<proj>`` as vLLM and llm-compressor name them. Then:

* every method sees each expert's matrix exactly as it would see the same matrix as a Linear
  (RTN, FP8, NVFP4, MXFP4 grids, GPTQ, AWQ, SmoothQuant, activation quantization);
* the unfused forward routes each token to its top-k experts as the fused one does, so each
  expert's Linears see only the tokens the router sends to them: the calibration statistics
  (GPTQ's Hessians, AWQ's means) are per expert from routed tokens. With
  ``quant.moe.calibrate_all_experts`` every expert runs on every token during calibration
  (llm-compressor's option) while the block's output still uses only the routed experts;
* :func:`fuse_experts` writes the Linears' (quantized) weights back into the fused parameters
  and restores the original module, so the quantized model keeps its class and fast kernels.

The router (``mlp.gate`` / ``mlp.router``, a ``…TopKRouter`` with ``weight`` [E, H]) is found as
the experts' sibling; it stays in full precision unless ``quant.moe.quantize_router``.
"""
from __future__ import annotations

import contextlib
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from harness.config import MoEQuantConfig
from harness.models.hooks import forward_pre_hooks, run_batches

__all__ = ["FusedExperts", "MoEQuantConfig", "UnfusedExperts", "find_fused_experts", "find_routers", "fuse_experts",
           "moe_settings", "unfuse_experts", "unfused", "expert_token_counts"]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_FUSED_PARAMS = {"gate_up_proj", "up_proj", "down_proj"}


def name_matches(name: str, patterns: list[str]) -> bool:
    """Whether a module name matches one of ``quant.targets``/``quant.keep``'s fnmatch patterns, whole or by its
    last component (``lm_head`` matches ``model.lm_head``). The one rule every target selection uses."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name.rsplit(".", 1)[-1], p) for p in patterns)


def moe_settings(scheme: Any) -> MoEQuantConfig:
    """The scheme's ``quant.moe`` section, or the defaults when it has none."""
    settings = getattr(scheme, "moe", None)
    return settings if settings is not None else MoEQuantConfig()


@dataclass
class FusedExperts:
    """One fused experts module and the layout of its 3-D parameters."""

    name: str  # module name in model.named_modules()
    module: nn.Module
    num_experts: int
    transposed: bool  # parameters stored [E, in, out] (gpt-oss) instead of [E, out, in]
    concatenated: bool  # gate_up rows are [gate; up] (True) or interleaved gate0, up0, gate1, … (False)
    has_gate: bool  # gate_up_proj (gated MLP) rather than up_proj alone
    router: str | None = None  # the sibling router's module name

    def fused_param(self, proj: str) -> str:
        return "down_proj" if proj == "down_proj" else ("gate_up_proj" if self.has_gate else "up_proj")

    def projections(self) -> tuple[str, ...]:
        return PROJECTIONS if self.has_gate else ("up_proj", "down_proj")

    def _rows(self, proj: str, rows: int) -> slice:
        if proj == "down_proj" or not self.has_gate:
            return slice(None)
        half = rows // 2
        if self.concatenated:
            return slice(0, half) if proj == "gate_proj" else slice(half, rows)
        return slice(0, None, 2) if proj == "gate_proj" else slice(1, None, 2)

    def matrix(self, expert: int, proj: str) -> Tensor:
        """Expert ``expert``'s ``[out, in]`` matrix of ``proj``: a view of the fused parameter."""
        weight = getattr(self.module, self.fused_param(proj)).data[expert]
        weight = weight.t() if self.transposed else weight
        return weight[self._rows(proj, weight.shape[0])]

    def bias(self, expert: int, proj: str) -> Tensor | None:
        bias = getattr(self.module, f"{self.fused_param(proj)}_bias", None)
        if not isinstance(bias, Tensor):
            return None
        row = bias.data[expert]
        return row[self._rows(proj, row.shape[0])]

    def shape(self, proj: str) -> tuple[int, int]:
        return tuple(self.matrix(0, proj).shape)  # type: ignore[return-value]

    def expert_names(self) -> list[str]:
        """Per-expert matrix names, ``<module>.<e>.<proj>`` (vLLM's and llm-compressor's names)."""
        return [f"{self.name}.{e}.{p}" for e in range(self.num_experts) for p in self.projections()]


def _is_fused(module: nn.Module) -> bool:
    params = {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
    return "down_proj" in params and ("gate_up_proj" in params or "up_proj" in params) \
        and len({p.shape[0] for p in params.values()}) == 1


def _describe(name: str, module: nn.Module) -> FusedExperts:
    has_gate = isinstance(getattr(module, "gate_up_proj", None), Tensor) and module.gate_up_proj.dim() == 3
    first = module.gate_up_proj if has_gate else module.up_proj
    down = module.down_proj
    transposed = getattr(module, "is_transposed", None)
    if transposed is None:  # not decorated by transformers: [E, out, in] when first's input is down's output
        transposed = not (first.shape[2] == down.shape[1])
    return FusedExperts(name, module, int(first.shape[0]), bool(transposed),
                        bool(getattr(module, "is_concatenated", True)), has_gate)


def _router_of(parent: nn.Module, prefix: str, experts_attr: str, num_experts: int) -> str | None:
    for attr, child in parent.named_children():
        weight = getattr(child, "weight", None)
        if attr == experts_attr or any(True for _ in child.children()) or not isinstance(weight, Tensor):
            continue
        if weight.dim() == 2 and weight.shape[0] == num_experts:
            return f"{prefix}{attr}"
    return None


def find_fused_experts(model: nn.Module) -> dict[str, FusedExperts]:
    """Every fused experts module of ``model`` by name, with its router when one is found."""
    found: dict[str, FusedExperts] = {}
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if not _is_fused(child):
                continue
            name = f"{parent_name}.{attr}" if parent_name else attr
            fused = _describe(name, child)
            fused.router = _router_of(parent, f"{parent_name}." if parent_name else "", attr, fused.num_experts)
            found[name] = fused
    return found


def find_routers(model: nn.Module) -> dict[str, int]:
    """Router module name → number of experts, for fused and unfused experts alike.

    Also counts a sibling gate with one output (Qwen2-MoE's ``shared_expert_gate``): a gating scalar that
    llm-compressor's recipes keep in full precision with the routers.
    """
    routers: dict[str, int] = {}
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if isinstance(child, UnfusedExperts):
                experts = child.fused.num_experts
            elif _is_fused(child):
                experts = _describe("", child).num_experts
            else:
                continue
            prefix = f"{parent_name}." if parent_name else ""
            for sibling, module in parent.named_children():
                weight = getattr(module, "weight", None)
                if sibling == attr or any(True for _ in module.children()) or not isinstance(weight, Tensor):
                    continue
                if weight.dim() == 2 and weight.shape[0] in (experts, 1):
                    routers[f"{prefix}{sibling}"] = experts
    return routers


class ExpertMLP(nn.Module):
    """One expert's projections as Linears (weights are views of the fused parameters)."""

    def __init__(self, fused: FusedExperts, expert: int):
        super().__init__()
        for proj in fused.projections():
            weight = fused.matrix(expert, proj)
            bias = fused.bias(expert, proj)
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
            linear.weight = nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                linear.bias = nn.Parameter(bias, requires_grad=False)
            setattr(self, proj, linear)


class UnfusedExperts(nn.ModuleList):
    """Drop-in replacement of a fused experts module: same forward signature, one ExpertMLP per expert.

    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` runs every expert in
    order 0..E-1, each on the tokens routed to it (possibly none: calibration hooks then see an empty
    input, so the stages of a staged forward come in a fixed order), or on every token when
    ``all_tokens`` (only routed tokens contribute to the output either way).
    """

    def __init__(self, fused: FusedExperts, all_tokens: bool = False):
        super().__init__([ExpertMLP(fused, e) for e in range(fused.num_experts)])
        object.__setattr__(self, "fused", fused)  # not a submodule: its parameters are the views' storage
        self.all_tokens = all_tokens
        # While calibrating every expert runs, also on no token (fixed stage order); afterwards experts no token
        # reaches are skipped (a quantizer of the empty input, e.g. NVFP4's per-tensor scale, needs one element).
        self.calibrating = True

    def _gate_up(self, expert: ExpertMLP, x: Tensor) -> Tensor:
        """The expert's hidden activation: act(gate(x)) * up(x) in the module's own layout and gating."""
        fused = self.fused
        if not fused.has_gate:
            return fused.module.act_fn(expert.up_proj(x))
        gate, up = expert.gate_proj(x), expert.up_proj(x)
        if fused.concatenated:
            gate_up = torch.cat([gate, up], dim=-1)
        else:
            gate_up = torch.stack([gate, up], dim=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])
        return fused.module._apply_gate(gate_up)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Every expert's gate/up first (0..E-1), then every expert's down: the order GPTQ's stages follow
        (:func:`expert_stages`), so that down's inputs come from the already quantized gate/up."""
        out = torch.zeros_like(hidden_states)
        routed = [torch.where(top_k_index == index) for index in range(len(self))]
        hidden = []
        for expert, (tokens, _slot) in zip(self, routed):
            if not self.calibrating and not len(tokens):
                hidden.append(None)
                continue
            hidden.append(self._gate_up(expert, hidden_states if self.all_tokens else hidden_states[tokens]))
        for expert, (tokens, slot), h in zip(self, routed, hidden):
            if h is None:
                continue
            y = expert.down_proj(h)
            y = y[tokens] if self.all_tokens else y
            out.index_add_(0, tokens, (y * top_k_weights[tokens, slot, None]).to(out.dtype))
        return out


@dataclass
class _Swap:
    parent: nn.Module
    attr: str
    unfused: UnfusedExperts


@dataclass
class UnfuseState:
    swaps: list[_Swap] = field(default_factory=list)


def unfuse_experts(model: nn.Module, all_tokens: bool = False) -> UnfuseState:
    """Replace every fused experts module by :class:`UnfusedExperts` (in place; no weight is copied)."""
    state = UnfuseState()
    for name, fused in find_fused_experts(model).items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        unfused = UnfusedExperts(fused, all_tokens)
        setattr(parent, attr, unfused)
        state.swaps.append(_Swap(parent, attr, unfused))
    return state


@torch.no_grad()
def fuse_experts(model: nn.Module, state: UnfuseState | None = None) -> int:
    """Write each expert Linear's current weight back into its fused parameter and restore the module.

    Needed because methods may rebind ``linear.weight.data`` (RTN does) or move a block between devices,
    which ends the view. Returns the number of modules restored. Without ``state`` every
    :class:`UnfusedExperts` in ``model`` is fused back.
    """
    swaps = state.swaps if state is not None else [
        _Swap(parent, attr, child) for parent in model.modules() for attr, child in parent.named_children()
        if isinstance(child, UnfusedExperts)]
    for swap in swaps:
        fused = swap.unfused.fused
        for index, expert in enumerate(swap.unfused):
            for proj in fused.projections():
                linear = getattr(expert, proj)
                target = fused.matrix(index, proj)
                if linear.weight.data_ptr() != target.data_ptr():
                    target.copy_(linear.weight.detach().to(device=target.device, dtype=target.dtype))
                bias = fused.bias(index, proj)
                if bias is not None and linear.bias.data_ptr() != bias.data_ptr():
                    bias.copy_(linear.bias.detach().to(device=bias.device, dtype=bias.dtype))
        setattr(swap.parent, swap.attr, fused.module)
    return len(swaps)


@contextlib.contextmanager
def unfused(model: nn.Module, all_tokens: bool = False) -> Iterator[UnfuseState]:
    """Run a block of code on the unfused model; the experts are fused back afterwards (also on error)."""
    state = unfuse_experts(model, all_tokens)
    try:
        yield state
    finally:
        fuse_experts(model, state)


@torch.no_grad()
def expert_token_counts(model: nn.Module, batches: list[Tensor]) -> dict[str, list[int]]:
    """Tokens each expert receives from the router over ``batches``, by fused experts module name."""
    counts: dict[str, Tensor] = {}
    hooks = []
    for name, fused in find_fused_experts(model).items():
        def record(_module: nn.Module, args: tuple, kwargs: dict, name: str = name,
                   experts: int = fused.num_experts) -> None:
            index = args[1] if len(args) > 1 else next(v for k, v in kwargs.items() if "ind" in k)
            hits = torch.bincount(index.reshape(-1).cpu(), minlength=experts + 1)[:experts]
            counts[name] = hits if name not in counts else counts[name] + hits
        hooks.append((fused.module, record))
    with forward_pre_hooks(hooks, with_kwargs=True):
        run_batches(model, batches)
    return {name: [int(c) for c in value] for name, value in counts.items()}


# ------------------------------------------------------------------------ calibrated methods on experts
_EXPERT_INDEX = re.compile(r"(?:^|\.)experts\.(\d+)\.")
def expert_index(name: str) -> int | None:
    """The expert number in a per-expert Linear's name (``…experts.3.gate_proj`` → 3), else None."""
    match = _EXPERT_INDEX.search(name)
    return int(match.group(1)) if match else None


def expert_stages(stages: list[list[str]]) -> list[list[str]]:
    """Split each GPTQ stage (linears sharing one input) so that each expert's linears form their own stage.

    Expert e's gate/up read only the tokens routed to e, so they share a Hessian with each other and with
    no other expert. Sub-stages keep the order of first appearance, which is :class:`UnfusedExperts`'s order
    of execution (all gate/up, then all down).
    """
    out: list[list[str]] = []
    for names in stages:
        parts: dict[int | None, list[str]] = {}
        for name in names:
            parts.setdefault(expert_index(name), []).append(name)
        out.extend(part for part in parts.values() if part)
    return out


def expert_shapes(model: nn.Module, scheme: Any) -> dict[str, tuple[int, int]]:
    """``<experts>.<e>.<proj>`` → (out, in) of every fused expert matrix the scheme selects (targets minus
    keep): the Linears they become once unfused, for checks that run on the fused model."""
    keep, targets = list(getattr(scheme, "keep", [])), list(getattr(scheme, "targets", ["*"]))
    out = {}
    for info in find_fused_experts(model).values():
        shapes = {proj: info.shape(proj) for proj in info.projections()}
        for name in info.expert_names():
            if name_matches(name, targets) and not name_matches(name, keep):
                out[name] = shapes[name.rsplit(".", 1)[1]]
    return out


@torch.no_grad()
def quantize_routers(model: nn.Module, scheme: Any, report: Any) -> list[str]:
    """Round every router that is not an ``nn.Linear`` (``…TopKRouter``) to nearest on the weight grid, as a
    Linear of the same shape (``quant.moe.quantize_router``); Linear routers are the method's targets then.
    Returns the changed parameter names."""
    from harness.quant.format_table import fake_quantize, storage_bits

    changed = []
    for name in find_routers(model):
        module = model.get_submodule(name)
        if isinstance(module, nn.Linear):
            continue
        original = module.weight.data
        quantized = fake_quantize(original, scheme.weights)
        report.add_layer(name, original, quantized, storage_bits(scheme.weights, *original.shape))
        module.weight.data = quantized
        changed.append(f"{name}.weight")
    return changed


def record_fallback(report: Any, prefix: str, linear: str, method: str, min_tokens: int) -> None:
    """Count one expert (block ``prefix``, a Linear ``linear`` of it) that fell back to round-to-nearest."""
    expert = f"{prefix}.{linear.rsplit('.', 1)[0]}"
    fallen = report.moe.setdefault("fallback", [])
    if not fallen:
        report.notes.append(f"{method}: experts with fewer than quant.moe.min_tokens={min_tokens} routed calibration "
                            "tokens are rounded to nearest on the same grid (moe.fallback lists them)")
    if expert not in fallen:
        fallen.append(expert)
    report.moe.update(fallback_experts=len(fallen), fallback_method="rtn")


@torch.no_grad()
def expert_fallback(block: nn.Module, prefix: str, names: list[str], tokens: int, scheme: Any, report: Any
                    ) -> list[str]:
    """GPTQ's fallback for an expert stage with too few routed tokens: round its Linears to nearest on the
    scheme's grid; returns the changed parameter names."""
    from harness.quant.format_table import fake_quantize, storage_bits

    changed = []
    for name in names:
        module = block.get_submodule(name)
        quantized = fake_quantize(module.weight.data, scheme.weights)
        report.add_layer(f"{prefix}.{name}", module.weight.data, quantized,
                         storage_bits(scheme.weights, module.out_features, module.in_features))
        module.weight.data.copy_(quantized.to(module.weight.dtype))
        changed.append(f"{prefix}.{name}.weight")
    record_fallback(report, prefix, names[0], "gptq", moe_settings(scheme).min_tokens)
    return changed
