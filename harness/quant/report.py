"""The quant report: each quantized layer's error and storage, and the scheme's bits per weight.

``harness.quant.apply`` fills a :class:`QuantReport` (a method adds its layers, apply the census of what
stays in high precision and the coverage account); the run summary, the ledger, the export and the
candidates read their bits per weight from :func:`bits_per_weight`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from torch import Tensor, nn


@dataclass
class LayerReport:
    name: str
    out_features: int
    in_features: int
    bits_per_weight: float
    sqnr_db: float  # 10 log10(|W|^2 / |W - Q(W)|^2); inf when exact
    rel_rms: float  # |W - Q(W)| / |W|


@dataclass
class QuantReport:
    scheme: str
    method: str
    layers: list[LayerReport] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # linears left in high precision by `keep`
    total_params: int = 0
    high_precision_bits: int = 16  # bits of weights that stay unquantized (bf16 deployment)
    kept_params: int = 0  # parameters of the kept linears that count in bits per weight (all but the output head)
    output_head: str | None = None  # the output head's name: not counted in bits per weight (see bits_per_weight)
    input_embedding: tuple[int, int] | None = None  # (vocab, hidden) of an untied input embedding: decode gathers it
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    coverage: Any = None  # harness.quant.coverage.CoverageAccount: every parameter's status
    moe: dict[str, Any] = field(default_factory=dict)  # experts: fused modules, fallback_experts, routers
    bits_known: bool = True  # False: a served candidate whose stored bits are not known (summary leaves them out)

    def add_stored_layer(self, name: str, out_features: int, in_features: int, bits_per_weight: float) -> None:
        """A layer whose stored bits are known but whose weights were not seen (a served checkpoint): no SQNR."""
        self.layers.append(LayerReport(name, out_features, in_features, bits_per_weight, math.nan, math.nan))

    def add_layer(self, name: str, original: Tensor, quantized: Tensor, bits_per_weight: float) -> None:
        original, quantized = original.detach().float(), quantized.detach().float()
        signal = original.pow(2).sum().item()
        noise = (original - quantized).pow(2).sum().item()
        sqnr = math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-30) / noise)
        rel = 0.0 if signal == 0 else math.sqrt(noise / signal)
        self.layers.append(LayerReport(name, original.shape[0], original.shape[-1], bits_per_weight, sqnr, rel))

    @property
    def quantized_params(self) -> int:
        return sum(l.out_features * l.in_features for l in self.layers)

    @property
    def weight_bits(self) -> float:
        """Total storage bits of all parameters: quantized layers at their rate, the rest at 16."""
        quantized = sum(l.out_features * l.in_features * l.bits_per_weight for l in self.layers)
        return quantized + (self.total_params - self.quantized_params) * self.high_precision_bits

    def summary(self) -> dict[str, float]:
        params = max(self.total_params, 1)
        finite = [l.sqnr_db for l in self.layers if math.isfinite(l.sqnr_db)]
        coverage = self.coverage.metrics() if self.coverage is not None else {}
        return {
            # from the coverage account when there is one: every matrix-shaped weight (experts and routers
            # included), the embeddings and the output head out; on a dense model the same number as below
            "bits_per_weight": coverage["coverage_bits_per_weight"] if coverage else
            bits_per_weight([(l.out_features * l.in_features, l.bits_per_weight)
                             for l in self.layers if l.name != self.output_head],
                            self.kept_params, self.high_precision_bits),
            **coverage,
            # the whole account (rows by status, rule and module kind; uncovered modules) for summary.json
            **({"coverage": self.coverage.to_dict()} if self.coverage is not None else {}),
            **({"moe_fallback_experts": self.moe.get("fallback_experts", 0)} if self.moe else {}),
            **self._router_summary(),
            "bits_per_param_total": self.weight_bits / params,
            "weight_gb": self.weight_bits / 8 / 1e9,
            "quantized_fraction": self.quantized_params / params,
            # no finite SQNR: every layer exact (inf), or none measured (nan: a served checkpoint's stored layers)
            "sqnr_db_mean": sum(finite) / len(finite) if finite else self._no_sqnr(),
            "sqnr_db_min": min(finite) if finite else self._no_sqnr(),
            "layers_quantized": len(self.layers),
            "quantize_s": self.seconds,
        }

    def _no_sqnr(self) -> float:
        return math.nan if any(math.isnan(l.sqnr_db) for l in self.layers) else math.inf

    def to_records(self) -> list[dict[str, Any]]:
        return [asdict(l) for l in self.layers]

    def _router_summary(self) -> dict[str, Any]:
        """Router agreement with the reference on each slice's divergence texts (mixture of experts only):
        ``router`` per slice (per layer in its detail), and means over the slices as flat metrics."""
        if not self.moe.get("router"):
            return {}
        from harness.divergence.router import slice_summaries
        slices = slice_summaries(self, self.moe.get("experts"))
        scored = [s for s in slices.values() if "identical_mean" in s]
        flat = {f"router_{key}": sum(s[key] for s in scored) / len(scored) if "mean" in key else
                (min if key == "identical_min" else max)(s[key] for s in scored)
                for key in ("identical_mean", "overlap_mean", "identical_min", "load_shift_max")} if scored else {}
        return {"router": slices, **flat}


def bits_per_weight(quantized: Iterable[tuple[float, float]], kept_params: float = 0.0,
                    kept_bits: float = 16.0) -> float:
    """Bits per weight of a scheme: its linears' mean storage bits, kept ones at their own precision.

    ``quantized``: (parameters, bits per weight with scales) of each quantized linear; ``kept_params``:
    the linears left in high precision, at ``kept_bits``. The output head is left out by the callers
    (kept or not): by convention it stays at 16 bits, small models tie it to the embedding, and a 70B
    extrapolation is about the decoder blocks; its bytes are in the weight size all the same. Every
    number called bits per weight (run summary, ledger, recommend, candidates) is this one.
    """
    quantized = list(quantized)
    params = sum(p for p, _ in quantized) + kept_params
    if params <= 0:
        return float(kept_bits)
    return (sum(p * b for p, b in quantized) + kept_params * kept_bits) / params


def linear_census(model: nn.Module, kept: list[str]) -> tuple[int, str | None, tuple[int, int] | None]:
    """(parameters of the kept linears but the output head, the output head's name, an untied input
    embedding's shape) of ``model``: what :class:`QuantReport` needs beyond the quantized layers."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head_name = next((name for name, module in model.named_modules() if module is head), None) if head is not None \
        else None
    modules = dict(model.named_modules())
    kept_params = sum(modules[name].weight.numel() for name in kept if name != head_name and name in modules)
    weight = getattr(embedding, "weight", None)
    tied = weight is not None and head is not None and getattr(head, "weight", None) is weight
    shape = (int(weight.shape[0]), int(weight.shape[1])) if weight is not None and weight.dim() == 2 and not tied \
        else None
    return kept_params, head_name, shape
