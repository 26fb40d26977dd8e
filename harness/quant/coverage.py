"""The coverage account: what a scheme does to every parameter of a model, and a refusal of silent skips.

Every parameter is classified as exactly one of

* ``quantized`` with its format (target Linears, and fused MoE experts, each expert's matrix as a Linear);
* ``kept`` by a rule that names itself: ``embedding``, ``output_head``, ``norm``, ``router``, ``bias`` (other
  1-D vectors: biases, attention sinks), ``quant.keep`` (a Linear the scheme's keep patterns name),
  ``quant.targets`` (a Linear its target patterns leave out), or ``no_weight_format`` (the scheme has no
  weight grid: the reference, KV-cache-only schemes);
* ``not_covered``: anything else. A matrix-shaped (>= 2-D) weight here is one the scheme claims and silently
  skips: a module kind the quantizers do not know (gpt2's ``Conv1D``, an unrecognised experts layout).

:func:`check_coverage` refuses such a scheme before any evaluation, in one line naming the modules, their
share of the weights and the fix (``quant.allow_uncovered=true``). Bits per weight is computed from the
account: quantized matrices at their storage rate, every other matrix-shaped weight but the embeddings
and the output head at 16 bits (the convention of :func:`harness.quant.report.bits_per_weight`).
The account is static: it reads the model's modules and the scheme, not the weights, so it works on a
meta-device model before loading and on a fused MoE model before its experts are unfused.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from harness.quant.experts import UnfusedExperts, find_fused_experts, find_routers, moe_settings, name_matches
from harness.quant.format_table import SchemeError, label, storage_bits

__all__ = ["CoverageAccount", "ParamEntry", "check_coverage", "coverage_account"]

QUANTIZED, KEPT, NOT_COVERED = "quantized", "kept", "not_covered"
HIGH_PRECISION_BITS = 16.0
_MAX_NAMED = 4  # module names in the refusal's one line


@dataclass(frozen=True)
class ParamEntry:
    name: str  # as in model.named_parameters()
    kind: str  # the owning module's class name
    numel: int
    dims: int
    status: str  # quantized | kept | not_covered
    rule: str  # the format label (quantized), the rule's name (kept), or "" (not covered)
    bits: float  # storage bits per element (16 for everything unquantized)
    counted: bool  # counts in bits per weight: matrix-shaped, neither embedding nor output head


@dataclass
class CoverageAccount:
    scheme: str
    entries: list[ParamEntry] = field(default_factory=list)

    @property
    def total_params(self) -> int:
        return sum(e.numel for e in self.entries)

    def _matrix(self) -> list[ParamEntry]:
        """Matrix-shaped weights other than the embeddings: the denominator of the shares."""
        return [e for e in self.entries if e.dims >= 2 and e.rule != "embedding"]

    @property
    def matrix_params(self) -> int:
        return sum(e.numel for e in self._matrix())

    @property
    def quantized_params(self) -> int:
        return sum(e.numel for e in self.entries if e.status == QUANTIZED)

    def uncovered(self) -> list[ParamEntry]:
        """Matrix-shaped weights that no rule keeps and the scheme does not quantize."""
        return [e for e in self.entries if e.status == NOT_COVERED and e.dims >= 2]

    @property
    def uncovered_params(self) -> int:
        return sum(e.numel for e in self.uncovered())

    def share(self, params: int) -> float:
        return params / self.matrix_params if self.matrix_params else 0.0

    @property
    def quantized_share(self) -> float:
        """Quantized share of the matrix-shaped non-embedding parameters (the output head included)."""
        return self.share(self.quantized_params)

    @property
    def uncovered_share(self) -> float:
        return self.share(self.uncovered_params)

    @property
    def bits_per_weight(self) -> float:
        counted = [e for e in self.entries if e.counted]
        params = sum(e.numel for e in counted)
        return sum(e.numel * e.bits for e in counted) / params if params else HIGH_PRECISION_BITS

    def kept_by_rule(self) -> dict[str, int]:
        kept: dict[str, int] = defaultdict(int)
        for e in self.entries:
            if e.status == KEPT:
                kept[e.rule] += e.numel
        return dict(sorted(kept.items()))

    def rows(self) -> list[dict[str, Any]]:
        """One row per (status, rule or format, module kind): tensors, parameters and share of all."""
        groups: dict[tuple[str, str, str], list[int]] = {}
        for e in self.entries:
            row = groups.setdefault((e.status, e.rule, e.kind), [0, 0])
            row[0] += 1
            row[1] += e.numel
        total = max(self.total_params, 1)
        order = {QUANTIZED: 0, KEPT: 1, NOT_COVERED: 2}
        return [{"status": s, "rule": r, "kind": k, "tensors": n, "params": p, "share_of_all": p / total}
                for (s, r, k), (n, p) in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], -kv[1][1]))]

    def headline(self) -> str:
        """A short phrase for the run's headline: what share is quantized, and any uncovered share."""
        text = f"{self.quantized_share:.1%} of matrix weights quantized"
        if self.uncovered_params:
            text += f", {self.uncovered_share:.1%} NOT COVERED (quant.allow_uncovered=true)"
        return text

    def to_dict(self) -> dict[str, Any]:
        """The account as summary.json and the quant report store it."""
        return {
            "scheme": self.scheme,
            "total_params": self.total_params,
            "matrix_params": self.matrix_params,
            "quantized_params": self.quantized_params,
            "quantized_share": self.quantized_share,
            "uncovered_params": self.uncovered_params,
            "uncovered_share": self.uncovered_share,
            "bits_per_weight": self.bits_per_weight,
            "kept_by_rule": self.kept_by_rule(),
            "uncovered": sorted({e.name.rsplit(".", 1)[0] for e in self.uncovered()}),
            "rows": self.rows(),
        }

    def metrics(self) -> dict[str, float]:
        """Flat numbers for MLflow (``coverage_*``)."""
        out = {"coverage_quantized_share": self.quantized_share, "coverage_uncovered_share": self.uncovered_share,
               "coverage_bits_per_weight": self.bits_per_weight, "coverage_quantized_params": self.quantized_params,
               "coverage_uncovered_params": self.uncovered_params}
        for rule, params in self.kept_by_rule().items():
            out[f"coverage_kept_{rule.replace('.', '_')}_params"] = params
        return out


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "norm" in type(module).__name__.lower()


def coverage_account(model: nn.Module, scheme: Any, targets: dict[str, nn.Module], *,
                     experts_supported: bool = True) -> CoverageAccount:
    """Classify every parameter of ``model`` under ``scheme`` (see the module docstring).

    ``targets``: the Linears the scheme's method quantizes (``harness.quant.targets.target_linears``; passed in
    so that this module sits below ``harness.quant.validation``, which refuses uncovered schemes with it).

    ``experts_supported``: whether fused MoE experts are quantized per expert (the harness does;
    False reproduces a Linear-only quantizer, whose experts are then not covered).
    """

    account = CoverageAccount(scheme=str(getattr(scheme, "name", "")))
    spec = getattr(scheme, "weights", None)
    modules = dict(model.named_modules())
    owner = {}
    for module_name, module in modules.items():
        for param_name, param in module.named_parameters(recurse=False):
            owner.setdefault(id(param), (module_name, module, param_name))
    targets = targets if spec is not None else {}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    fused = find_fused_experts(model)
    routers = find_routers(model)
    quantize_router = moe_settings(scheme).quantize_router
    keep, patterns = list(getattr(scheme, "keep", [])), list(getattr(scheme, "targets", ["*"]))

    def classify(module_name: str, module: nn.Module, param_name: str, param: Any) -> tuple[str, str, float]:
        dims = param.dim()
        if spec is None:
            return KEPT, "no_weight_format", HIGH_PRECISION_BITS
        if module_name in targets and param_name == "weight":
            out, inp = param.shape[0], param.shape[-1]
            return QUANTIZED, label(spec), storage_bits(spec, out, inp)
        if module is embedding or isinstance(module, nn.Embedding):
            return KEPT, "embedding", HIGH_PRECISION_BITS
        if module is head and head is not None:
            return KEPT, "output_head", HIGH_PRECISION_BITS
        if module_name in routers:
            if dims >= 2 and quantize_router:
                return QUANTIZED, label(spec), storage_bits(spec, param.shape[0], param.shape[-1])
            return KEPT, "router", HIGH_PRECISION_BITS
        if dims < 2:
            return KEPT, "norm" if _is_norm(module) else "bias", HIGH_PRECISION_BITS
        if module_name in fused and param_name.endswith("_bias"):  # per-expert biases [E, out] (gpt-oss)
            return KEPT, "bias", HIGH_PRECISION_BITS
        if module_name in fused and experts_supported and param.dim() == 3:
            info = fused[module_name]
            proj = next((p for p in info.projections() if info.fused_param(p) == param_name), None)
            if proj is not None:
                names = [f"{module_name}.{e}.{p}" for e in range(info.num_experts) for p in info.projections()
                         if info.fused_param(p) == param_name]
                if all(name_matches(n, keep) for n in names):
                    return KEPT, "quant.keep", HIGH_PRECISION_BITS
                if all(name_matches(n, patterns) and not name_matches(n, keep) for n in names):
                    out, inp = info.shape(proj)
                    return QUANTIZED, label(spec), storage_bits(spec, out, inp)
                return NOT_COVERED, "", HIGH_PRECISION_BITS  # a partial expert selection is not supported
        if isinstance(module, nn.Linear):
            if name_matches(module_name, keep):
                return KEPT, "quant.keep", HIGH_PRECISION_BITS
            return KEPT, "quant.targets", HIGH_PRECISION_BITS
        if isinstance(module, UnfusedExperts):  # never owns parameters itself; listed for completeness
            return NOT_COVERED, "", HIGH_PRECISION_BITS
        if name_matches(module_name, keep):
            return KEPT, "quant.keep", HIGH_PRECISION_BITS
        return NOT_COVERED, "", HIGH_PRECISION_BITS

    for name, param in model.named_parameters():
        module_name, module, param_name = owner.get(id(param), (name.rpartition(".")[0], None, name.rpartition(".")[2]))
        if module is None:
            module = modules.get(module_name, model)
        status, rule, bits = classify(module_name, module, param_name, param)
        counted = param.dim() >= 2 and rule not in ("embedding", "output_head")
        account.entries.append(ParamEntry(name, type(module).__name__, param.numel(), param.dim(), status, rule,
                                          bits, counted))
    return account


def check_coverage(account: CoverageAccount, allow_uncovered: bool) -> None:
    """Refuse (SchemeError, one line) a scheme that leaves matrix-shaped weights unquantized with no rule."""
    uncovered = account.uncovered()
    if not uncovered or allow_uncovered:
        return
    modules: dict[str, str] = {}
    for entry in uncovered:
        modules.setdefault(entry.name.rsplit(".", 1)[0], entry.kind)
    kinds = sorted(set(modules.values()))
    named = ", ".join(f"{name} ({kind})" for name, kind in list(modules.items())[:_MAX_NAMED])
    more = f" and {len(modules) - _MAX_NAMED} more" if len(modules) > _MAX_NAMED else ""
    raise SchemeError(
        f"quant={account.scheme} would leave {len(modules)} modules of kind {', '.join(kinds)} unquantized with no "
        f"rule keeping them: {named}{more}, {account.uncovered_share:.1%} of the matrix weights. Fix: "
        "quant.allow_uncovered=true runs anyway (the share goes in the headline), or name them in quant.keep")
