"""``python -m harness.ledger model=llama70b quant=fp8 [gpus=[H100,H200] context=32768 reserve_gb=4]`` — capacity.

What a scheme buys on a GPU, from shapes alone (no weights are loaded): weight bytes (quantized
linears at the scheme's bits per weight, scales included, the rest at 16 bits); KV-cache bytes per
token, ``2 × layers × KV heads × head dim × bytes per element`` (the 2: keys and values) for BF16,
FP8 and INT4 KV with their scale overhead; and per GPU, with a runtime reserve (activations, CUDA
context, fragmentation; default 4 GB): the memory left for KV, the tokens of KV that fit, the largest
batch at ``context`` tokens per sequence, and the batch-1 decode floor (the bytes one decode step
reads ÷ bandwidth: every weight once, except an untied input embedding, of which decode gathers one
row per token; a tied one is read whole as the output head). A model whose weights plus reserve
exceed the GPU's memory "does not fit". GB are 10⁹ bytes; a GPU's memory is what the driver reports
(``nvidia-smi``'s total: an "80 GB" H100 has 81,559 MiB = 85.5e9 bytes, not 80e9).

KV formats: ``bf16`` (16 bits), or a ``conf/quant/kv_cache/<name>.yaml`` (``fp8``: static per-tensor
scales, 8 bits; ``fp8_dynamic``: one scale per token and head; ``int4``: KIVI keys per channel over
groups of tokens, values per token, asymmetric). Per-tensor scales and KIVI's few full-precision
residual tokens per sequence are not counted (bytes per sequence, not per token).

Shapes come from, in order: the tool's ``arch.*`` options; the model's config.json (a local
directory, the hub cache, or the tiny model's config); ``conf/ledger/architectures.yaml``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import pandas as pd
from omegaconf import OmegaConf

from harness import cli
from harness.config import (
    CONF_DIR,
    KVCacheQuantConfig,
    ModelConfig,
    QuantConfig,
    TensorQuantConfig,
)
from harness.errors import UsageError

__all__ = ["DEFAULT_GPUS", "GPU", "GPU_BANDWIDTH", "GPU_BF16_FLOPS", "GPU_MEMORY_BYTES", "Architecture", "Ledger",
           "capacity_rows", "decode_floor_metrics", "decode_floor_ms", "decode_floor_table", "decode_read_bytes",
           "kv_bits_per_element", "kv_bytes_per_token", "ledger_for_run", "resolve_gpus"]

if TYPE_CHECKING:
    from harness.quant import QuantReport

log = logging.getLogger("harness.ledger")
ARCHITECTURES_FILE = CONF_DIR / "ledger" / "architectures.yaml"
DEFAULT_KV = ("bf16", "fp8", "int4")
DEFAULT_RESERVE_GB = 4.0
DEFAULT_CONTEXT = 8192

MIB = 2**20
# Peak HBM bandwidth in bytes/s (vendor datasheets, SXM parts).
GPU_BANDWIDTH: dict[str, float] = {
    "A100": 2.039e12,  # A100 80GB SXM
    "H100": 3.35e12,  # H100 SXM
    "H200": 4.8e12,
    "B200": 8.0e12,
    "MI300X": 5.3e12,
}
# Memory in bytes as the driver reports it (what a process can allocate from, before the reserve).
# Datasheets round: "80 GB" (H100) is 80 GiB of HBM3 of which the driver exposes 81,559 MiB.
GPU_MEMORY_BYTES: dict[str, int] = {
    "A100": 81_920 * MIB,  # A100-SXM4-80GB, nvidia-smi memory.total (modal-labs/modal-client#2797)
    "H100": 81_559 * MIB,  # H100 80GB HBM3, nvidia-smi memory.total (modal-labs/modal-client#2797)
    "H200": 143_771 * MIB,  # H200 141GB HBM3e, nvidia-smi memory.total (nvidia-smi outputs in public issues)
    "B200": 183_359 * MIB,  # B200, nvidia-smi memory.total (NVIDIA/TensorRT-LLM#10278)
    "MI300X": 206_141_652_992,  # MI300X 192GB, rocm-smi "VRAM Total Memory (B)" (ROCm/legacy-rocm-build#4750)
}
GPU_MEMORY_GB: dict[str, float] = {name: size / 1e9 for name, size in GPU_MEMORY_BYTES.items()}
# Peak dense BF16 tensor FLOP/s (vendor datasheets, no sparsity): what harness.planning.plan's roofline assumes.
GPU_BF16_FLOPS: dict[str, float] = {
    "A100": 312e12,  # A100 SXM
    "H100": 989e12,  # H100 SXM (1,979 TFLOPS is with 2:4 sparsity)
    "H200": 989e12,  # H200 SXM: the H100's tensor cores
    "B200": 2.25e15,  # B200 (HGX B200 per GPU, dense)
    "MI300X": 1307.4e12,  # MI300X (dense BF16)
}
DEFAULT_GPUS = ("H100", "H200", "B200")
# Nominal sizes of the decode-floor extrapolation rows (all parameters at the scheme's bits per weight).
EXTRAPOLATE_PARAMS: dict[str, float] = {"8B": 8e9, "70B": 70e9}
REFERENCE_BITS = 16  # the unquantized deployment: BF16


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float  # 1e9 bytes, as the driver reports the total (GPU_MEMORY_BYTES)
    bandwidth_tbs: float  # peak HBM bandwidth, 1e12 bytes/s


def resolve_gpus(specs: list[str]) -> list[GPU]:
    """Names from the GPU table or ``NAME:memory_GB:bandwidth_TBps`` (e.g. ``L40S:48:0.864``)."""
    gpus = []
    for spec in specs:
        parts = str(spec).split(":")
        if len(parts) == 3:
            try:
                gpus.append(GPU(parts[0], float(parts[1]), float(parts[2])))
            except ValueError:
                raise UsageError(f"gpus: {spec!r} must be NAME:memory_GB:bandwidth_TBps, e.g. L40S:48:0.864") from None
        elif spec in GPU_MEMORY_GB:
            gpus.append(GPU(spec, GPU_MEMORY_GB[spec], GPU_BANDWIDTH[spec] / 1e12))
        else:
            raise UsageError(f"unknown GPU {spec!r}; known: {', '.join(sorted(GPU_MEMORY_GB))}, or give "
                                 "NAME:memory_GB:bandwidth_TBps (e.g. gpus=[H100,L40S:48:0.864])")
        if gpus[-1].memory_gb <= 0 or gpus[-1].bandwidth_tbs <= 0:
            raise UsageError(f"gpus: {spec!r} needs a positive memory and bandwidth")
    if not gpus:
        raise UsageError("gpus=[] selects no GPU; e.g. gpus=[H100,H200,B200]")
    return gpus


# ----------------------------------------------------------------------- decode floor
def decode_floor_ms(weight_bytes: float, bandwidth: float) -> float:
    """Batch-1 decode floor in ms/token: ``weight_bytes`` (those one step reads) ÷ bandwidth."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive bytes/s, got {bandwidth}")
    return weight_bytes / bandwidth * 1e3


def decode_read_bytes(weight_bytes: float, untied_embedding: tuple[int, int] | None,
                      embedding_bits: float = REFERENCE_BITS) -> float:
    """Bytes one batch-1 decode step reads: every weight once, but of an untied input embedding
    ``(vocab, hidden)`` only the row of the token (a gather); a tied one is read whole as the head."""
    if untied_embedding is None:
        return weight_bytes
    vocab, hidden = untied_embedding
    return weight_bytes - (vocab - 1) * hidden * embedding_bits / 8


def decode_floor_table(report: "QuantReport", gpus: dict[str, float], *, model_name: str = "this model",
                       sizes: dict[str, float] | None = None) -> pd.DataFrame:
    """Weight size and decode floor of this model and of nominal larger ones, BF16 vs the scheme.

    Rows: this model in BF16 and as quantized (kept layers at 16 bits, ``report.weight_bits``;
    the decode floor gathers an untied input embedding, :func:`decode_read_bytes`); then each of
    ``sizes`` (default 8B, 70B) in BF16 and with *all* parameters at the scheme's bits per weight
    (:func:`harness.quant.report.bits_per_weight`: kept linears at 16, scales included), as the
    primers' tables count (every parameter read per token: nominal sizes have no embedding shape).
    One column ``ms_per_token_<GPU>`` per entry of ``gpus`` (name → bytes/s).
    """
    sizes = EXTRAPOLATE_PARAMS if sizes is None else sizes
    summary = report.summary()
    scheme_bits = float(summary["bits_per_weight"])
    embedding = report.input_embedding
    rows: list[dict[str, Any]] = [
        {"model": model_name, "precision": "bf16", "params": report.total_params,
         "bits_per_weight": float(REFERENCE_BITS), "weight_bits": report.total_params * REFERENCE_BITS,
         "embedding": embedding},
        {"model": model_name, "precision": report.scheme, "params": report.total_params,
         "bits_per_weight": report.weight_bits / max(report.total_params, 1), "weight_bits": report.weight_bits,
         "embedding": embedding},
    ]
    for size, params in sizes.items():
        rows.append({"model": size, "precision": "bf16", "params": params, "bits_per_weight": float(REFERENCE_BITS),
                     "weight_bits": params * REFERENCE_BITS, "embedding": None})
        rows.append({"model": size, "precision": report.scheme, "params": params, "bits_per_weight": scheme_bits,
                     "weight_bits": params * scheme_bits, "embedding": None})
    for row in rows:
        weight_bytes = row.pop("weight_bits") / 8
        read = decode_read_bytes(weight_bytes, row.pop("embedding"))
        row["weight_gb"] = weight_bytes / 1e9
        for gpu, bandwidth in gpus.items():
            row[f"ms_per_token_{gpu}"] = decode_floor_ms(read, bandwidth)
    return pd.DataFrame(rows)


def decode_floor_metrics(table: pd.DataFrame) -> dict[str, float]:
    """Flat metrics of a :func:`decode_floor_table` for MLflow, e.g. ``decode_floor/70B/H100_ms``."""
    metrics: dict[str, float] = {}
    quantized = table[table["precision"] != "bf16"]
    for row in quantized.to_dict("records"):
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(row["model"]))
        metrics[f"decode_floor/{name}/weight_gb"] = float(row["weight_gb"])
        for column, value in row.items():
            if column.startswith("ms_per_token_"):
                metrics[f"decode_floor/{name}/{column.removeprefix('ms_per_token_')}_ms"] = float(value)
    return metrics


# ----------------------------------------------------------------------------- shapes
@dataclass
class Architecture:
    """The shapes the ledger needs (0 / None: not given; filled from config.json or the table)."""

    layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    heads: int = 0
    vocab_size: int = 0
    tied_embeddings: Optional[bool] = None
    params: float = 0.0  # total parameters; 0: counted from the shapes (llama-style blocks)
    # Mixture of experts; 0: a dense model. Every parameter counts for memory; a decode step reads
    # only the experts its tokens are routed to (active_params at batch 1, expected_experts at batch B).
    num_experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's MLP width
    shared_intermediate_size: int = 0  # total MLP width of a MoE layer's shared expert(s); 0: none
    dense_layers: int = 0  # leading layers with a dense MLP (DeepSeek-V3's first_k_dense_replace)
    attention_params: float = 0.0  # per layer when attention is not llama-shaped (DeepSeek's MLA); 0: from heads

    def merged(self, fallback: "Architecture") -> "Architecture":
        return Architecture(**{f.name: getattr(self, f.name) if getattr(self, f.name) not in (0, 0.0, None)
                               else getattr(fallback, f.name) for f in dataclasses.fields(self)})

    def linears(self) -> dict[str, tuple[int, int]]:
        """Linear name → (out, in) of a llama-style decoder (attention q/k/v/o, gated MLP, output head).

        A MoE layer has ``mlp.experts.<e>.{gate,up,down}_proj`` per expert (the names vLLM reads) and
        ``mlp.shared_experts.*``; attention given as ``attention_params`` is one ``self_attn.proj`` matrix.
        """
        q, kv, hidden = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden_size
        attention = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden),
                     "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, q)}
        if self.attention_params:
            attention = {"self_attn.proj": (round(self.attention_params / hidden), hidden)}

        def mlp(prefix: str, width: int) -> dict[str, tuple[int, int]]:
            return {f"{prefix}.gate_proj": (width, hidden), f"{prefix}.up_proj": (width, hidden),
                    f"{prefix}.down_proj": (hidden, width)}

        dense, moe = {**attention, **mlp("mlp", self.intermediate_size)}, dict(attention)
        for expert in range(self.num_experts):
            moe.update(mlp(f"mlp.experts.{expert}", self.moe_intermediate_size))
        if self.shared_intermediate_size:
            moe.update(mlp("mlp.shared_experts", self.shared_intermediate_size))
        out = {f"model.layers.{i}.{name}": shape for i in range(self.layers)
               for name, shape in (moe if self.is_moe_layer(i) else dense).items()}
        out["lm_head"] = (self.vocab_size, hidden)
        return out

    def is_moe_layer(self, index: int) -> bool:
        return bool(self.num_experts) and index >= self.dense_layers

    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    def expert_params(self) -> float:
        """Parameters of one routed expert (gate, up and down)."""
        return 3.0 * self.hidden_size * self.moe_intermediate_size

    def expected_experts(self, batch: int) -> float:
        """Expected distinct experts a MoE layer reads for ``batch`` tokens routed independently and uniformly,
        each to ``experts_per_token`` distinct experts: ``E · (1 − (1 − k/E)^B)``. Real routers are not uniform
        (fewer distinct experts); this is the upper bound a decode step's bytes are planned with."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.experts_per_token / self.num_experts) ** batch)

    def inactive_params(self, batch: int = 1) -> float:
        """Expert parameters a decode step at ``batch`` does not read (0 for a dense model)."""
        return self.moe_layers() * (self.num_experts - self.expected_experts(batch)) * self.expert_params()

    def active_params(self) -> float:
        """Parameters one token reads: every non-expert weight plus ``experts_per_token`` experts per layer."""
        return self.total_params() - self.inactive_params(1)

    def untied_embedding(self) -> tuple[int, int] | None:
        """(vocab, hidden) of the input embedding when it is not the output head's matrix."""
        return None if self.tied_embeddings or not (self.vocab_size and self.hidden_size) else \
            (self.vocab_size, self.hidden_size)

    def shape_problem(self) -> str | None:
        needed = ["layers", "hidden_size", "intermediate_size", "heads", "kv_heads", "head_dim", "vocab_size"]
        missing = [n for n in needed if not getattr(self, n)]
        return f"missing {', '.join('arch.' + n for n in missing)}" if missing else None

    def total_params(self) -> float:
        if self.params:
            return float(self.params)
        linear = sum(o * i for name, (o, i) in self.linears().items() if name != "lm_head" or not self.tied_embeddings)
        routers = self.moe_layers() * self.num_experts * self.hidden_size
        return float(linear + routers + self.vocab_size * self.hidden_size + self.hidden_size * (2 * self.layers + 1))


def _from_hf_dict(config: dict[str, Any]) -> Architecture:
    heads = int(config.get("num_attention_heads") or 0)
    hidden = int(config.get("hidden_size") or 0)
    experts = int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)
    moe_width = int(config.get("moe_intermediate_size") or (config.get("intermediate_size") or 0 if experts else 0))
    shared = int(config.get("shared_expert_intermediate_size") or (config.get("n_shared_experts") or 0) * moe_width)
    moe = dict(num_experts=experts, experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
               moe_intermediate_size=moe_width if experts else 0, shared_intermediate_size=shared if experts else 0,
               dense_layers=int(config.get("first_k_dense_replace") or 0) if experts else 0)
    return Architecture(**moe, layers=int(config.get("num_hidden_layers") or 0),
                        kv_heads=int(config.get("num_key_value_heads") or heads),
                        head_dim=int(config.get("head_dim") or (hidden // heads if heads else 0)),
                        hidden_size=hidden, intermediate_size=int(config.get("intermediate_size") or 0), heads=heads,
                        vocab_size=int(config.get("vocab_size") or 0),
                        tied_embeddings=bool(config.get("tie_word_embeddings", False)))


def known_architectures() -> dict[str, Architecture]:
    raw = OmegaConf.to_container(OmegaConf.load(ARCHITECTURES_FILE))
    return {name: Architecture(**fields) for name, fields in raw.items()}  # type: ignore[union-attr]


def _config_json(model: ModelConfig) -> dict[str, Any] | None:
    """The model's config.json without touching the network or any weight file."""
    if model.source != "hf" or not model.path:
        return None
    local = Path(model.path).expanduser() / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    try:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(model.path, "config.json", revision=model.revision)
    except Exception:  # an unusual hub id or cache layout: fall back to the table
        return None
    return json.loads(Path(found).read_text()) if isinstance(found, str) else None


def architecture(model: ModelConfig, given: Architecture | None = None) -> Architecture:
    """Shapes of ``model``: ``given`` fields first, then its config.json, then the ledger's table."""
    given = given or Architecture()
    known = known_architectures()
    fallback = Architecture()
    if model.source == "tiny_random" and model.tiny is not None:
        tiny = model.tiny
        vocab = tiny.vocab_size or known.get(tiny.tokenizer, Architecture()).vocab_size
        fallback = Architecture(layers=tiny.num_hidden_layers, kv_heads=tiny.num_key_value_heads,
                                head_dim=tiny.hidden_size // tiny.num_attention_heads, hidden_size=tiny.hidden_size,
                                intermediate_size=tiny.intermediate_size, heads=tiny.num_attention_heads,
                                vocab_size=vocab, tied_embeddings=False)
    elif (config := _config_json(model)) is not None:
        fallback = _from_hf_dict(config)
    elif model.name in known:
        fallback = known[model.name]
    arch = given.merged(fallback)
    if not (arch.layers and arch.kv_heads and arch.head_dim) or (not arch.params and arch.shape_problem()):
        problem = arch.shape_problem()
        raise UsageError(f"no architecture known for model {model.name!r} ({problem}); give them, e.g. "
                             "arch.layers=32 arch.kv_heads=8 arch.head_dim=128 arch.hidden_size=4096 "
                             "arch.intermediate_size=14336 arch.heads=32 arch.vocab_size=128256 (or arch.params=8e9 "
                             f"for the weights), or add the model to {ARCHITECTURES_FILE}")
    return arch


def scheme_weight_bytes(arch: Architecture, scheme: QuantConfig) -> tuple[float, float]:
    """(weight bytes, bits per weight) of ``scheme`` on ``arch``'s shapes; bits per weight as
    :func:`harness.quant.report.bits_per_weight` counts it (kept linears at 16, the output head out)."""
    from harness.quant import bits_per_weight
    from harness.quant.experts import name_matches
    from harness.quant.format_table import storage_bits

    params = arch.total_params()
    quantized: dict[str, tuple[float, float]] = {}  # linear -> (parameters, bits per weight)
    kept_params = 0.0
    for name, (out_features, in_features) in arch.linears().items():
        if arch.tied_embeddings and name == "lm_head":
            continue
        size = out_features * in_features
        kept = name_matches(name, list(scheme.keep)) or not name_matches(name, list(scheme.targets))
        if scheme.weights is None or kept:
            kept_params += 0 if name == "lm_head" else size
        else:
            quantized[name] = (size, storage_bits(scheme.weights, out_features, in_features))
    quantized_params = sum(p for p, _ in quantized.values())
    quantized_bits = sum(p * b for p, b in quantized.values())
    rest = max(params - quantized_params, 0.0) * REFERENCE_BITS
    counted = [value for name, value in quantized.items() if name != "lm_head"]
    return (quantized_bits + rest) / 8, bits_per_weight(counted, kept_params)


# -------------------------------------------------------------------------------- KV
def kv_bits_per_element(kv: KVCacheQuantConfig | None, head_dim: int) -> float:
    """Mean storage bits of one cached key or value element, scales and zero points included."""
    if kv is None:
        return float(REFERENCE_BITS)
    from harness.quant.format_table import kv_bits

    sides = [REFERENCE_BITS if spec is None else kv_bits(spec, head_dim, kv.group_tokens) for spec in (kv.keys, kv.values)]
    return float(sum(sides)) / 2


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bits_per_element: float = 16.0) -> float:
    """2 (keys and values) × layers × KV heads × head dim × bytes per element."""
    return 2 * layers * kv_heads * head_dim * bits_per_element / 8


def load_kv_format(name: str) -> KVCacheQuantConfig | None:
    """``bf16`` (None: unquantized) or conf/quant/kv_cache/<name>.yaml."""
    if name == "bf16":
        return None
    path = CONF_DIR / "quant" / "kv_cache" / f"{name}.yaml"
    if not path.exists():
        options = ["bf16", *sorted(p.stem for p in path.parent.glob("*.yaml"))]
        raise UsageError(f"unknown KV format {name!r}; available: {', '.join(options)}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(KVCacheQuantConfig), OmegaConf.load(path)))


# ---------------------------------------------------------------------------- ledger
def capacity_rows(model: str, weights: dict[str, float], kv_per_token: dict[str, float], gpus: list[GPU], *,
                  reserve_gb: float = DEFAULT_RESERVE_GB, context: int = DEFAULT_CONTEXT,
                  bits: dict[str, float] | None = None, untied_embedding: tuple[int, int] | None = None,
                  unread: dict[str, float] | None = None) -> pd.DataFrame:
    """One row per (weights, GPU, KV format): memory left for KV, tokens that fit, batch, decode floor.

    ``weights``: precision name → weight bytes; ``kv_per_token``: KV format → bytes per token;
    ``untied_embedding``: (vocab, hidden) of an input embedding decode gathers (:func:`decode_read_bytes`);
    ``unread``: precision → bytes of the experts a batch-1 decode step does not read (mixture of experts).
    """
    if reserve_gb < 0 or context < 1:
        raise UsageError(f"reserve_gb={reserve_gb} must be >= 0 and context={context} >= 1")
    rows = []
    for precision, weight_bytes in weights.items():
        for gpu in gpus:
            left = gpu.memory_gb * 1e9 - weight_bytes - reserve_gb * 1e9
            for kv, per_token in kv_per_token.items():
                tokens = math.floor(left / per_token) if left > 0 else 0
                rows.append({"model": model, "weights": precision, "bits_per_weight": (bits or {}).get(precision),
                             "weight_gb": weight_bytes / 1e9, "gpu": gpu.name, "memory_gb": gpu.memory_gb,
                             "bandwidth_tbs": gpu.bandwidth_tbs, "reserve_gb": reserve_gb, "fits": left > 0,
                             "kv_left_gb": left / 1e9, "kv": kv, "kv_bytes_per_token": per_token,
                             "kv_tokens": tokens, "context": context, "max_batch": tokens // context,
                             "decode_floor_ms": decode_floor_ms(
                                 decode_read_bytes(weight_bytes - (unread or {}).get(precision, 0.0),
                                                   untied_embedding), gpu.bandwidth_tbs * 1e12)})
    return pd.DataFrame(rows)


@dataclass
class Ledger:
    table: pd.DataFrame  # capacity_rows
    scheme: str
    moe: Optional[Architecture] = None  # a mixture-of-experts model's shapes (its line in the markdown)

    def metrics(self) -> dict[str, float]:
        """``ledger/<GPU>/<kv>/tokens`` etc. for the scheme's weights (MLflow metric names)."""
        out: dict[str, float] = {}
        for row in self.table[self.table["weights"] == self.scheme].to_dict("records"):
            gpu = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(row["gpu"]))
            out[f"ledger/{gpu}/kv_left_gb"] = float(row["kv_left_gb"])
            out[f"ledger/{gpu}/decode_floor_ms"] = float(row["decode_floor_ms"])
            out[f"ledger/{gpu}/{row['kv']}/kv_tokens"] = float(row["kv_tokens"])
            out[f"ledger/{gpu}/{row['kv']}/max_batch"] = float(row["max_batch"])
        for row in self.table.drop_duplicates("kv").to_dict("records"):
            out[f"ledger/kv_bytes_per_token/{row['kv']}"] = float(row["kv_bytes_per_token"])
        return out

    def wide(self) -> pd.DataFrame:
        """One row per (weights, GPU); tokens and batch per KV format; "does not fit" spelled out."""
        rows = []
        keys = ["model", "weights", "weight_gb", "gpu", "kv_left_gb", "decode_floor_ms"]
        for key, group in self.table.groupby(["weights", "gpu"], sort=False):
            first = group.iloc[0]
            row = {k: first[k] for k in keys}
            row["weight_gb"], row["kv_left_gb"] = round(first["weight_gb"], 2), round(first["kv_left_gb"], 2)
            row["decode_floor_ms"] = round(first["decode_floor_ms"], 2)
            for kv_row in group.to_dict("records"):
                fits = kv_row["fits"]
                row[f"tokens_{kv_row['kv']}"] = f"{kv_row['kv_tokens']:,}" if fits else "does not fit"
                row[f"batch@{kv_row['context']}_{kv_row['kv']}"] = kv_row["max_batch"] if fits else "does not fit"
            if not first["fits"]:
                row["kv_left_gb"] = "does not fit"
            rows.append(row)
        return pd.DataFrame(rows)

    def markdown(self) -> str:
        per_token = ", ".join(f"{r['kv']} {r['kv_bytes_per_token']:,.0f}"
                              for r in self.table.drop_duplicates("kv").to_dict("records"))
        first = self.table.iloc[0]
        return "\n".join([
            "## Capacity ledger", "",
            f"KV-cache bytes per token: {per_token}. Runtime reserve {first['reserve_gb']:g} GB; batch at "
            f"{first['context']:,} tokens per sequence; decode floor = bytes read per token ÷ bandwidth (batch 1; "
            "an untied input embedding gathered, one row per token).", "", *self._moe_lines(),
            self.wide().to_markdown(index=False), ""])

    def write_csv(self, path: Path) -> None:
        self.table.to_csv(path, index=False)

    def _moe_lines(self) -> list[str]:
        arch = self.moe
        if arch is None:
            return []
        batches = ", ".join(f"{b}: {arch.expected_experts(b):.1f}" for b in (1, 8, 64, 256))
        return [f"Mixture of experts: {arch.num_experts} experts, {arch.experts_per_token} per token, "
                f"{arch.total_params() / 1e9:.2f}B parameters in memory, {arch.active_params() / 1e9:.2f}B read "
                f"per token at batch 1 (the decode floor counts these); expected distinct experts per MoE layer "
                f"at batch {batches} (uniform routing: an upper bound).", ""]


def build_ledger(model_name: str, arch: Architecture, scheme: QuantConfig, *, weight_bytes: float | None = None,
                 gpus: list[str] | None = None, kv: list[str] | None = None, reserve_gb: float = DEFAULT_RESERVE_GB,
                 context: int = DEFAULT_CONTEXT, bits: float | None = None) -> Ledger:
    """BF16 and ``scheme`` weights on each GPU, for each KV format (the scheme's own KV cache added)."""
    gpu_list = resolve_gpus(list(gpus or DEFAULT_GPUS))
    formats = {name: load_kv_format(name) for name in (kv or DEFAULT_KV)}
    if scheme.kv_cache is not None:
        formats["scheme_kv"] = scheme.kv_cache  # the KV cache the scheme itself quantizes
    per_token = {name: kv_bytes_per_token(arch.layers, arch.kv_heads, arch.head_dim,
                                          kv_bits_per_element(spec, arch.head_dim)) for name, spec in formats.items()}
    computed, computed_bits = scheme_weight_bytes(arch, scheme)
    weights = {"bf16": arch.total_params() * REFERENCE_BITS / 8}
    weights[scheme.name] = computed if weight_bytes is None else weight_bytes
    unread = {"bf16": arch.inactive_params(1) * REFERENCE_BITS / 8,
              scheme.name: arch.inactive_params(1) * expert_bits(arch, scheme) / 8}
    table = capacity_rows(model_name, weights, per_token, gpu_list, reserve_gb=reserve_gb, context=context,
                          bits={"bf16": float(REFERENCE_BITS), scheme.name: computed_bits if bits is None else bits},
                          untied_embedding=arch.untied_embedding(), unread=unread)
    return Ledger(table, scheme.name, arch if arch.num_experts else None)


def expert_bits(arch: Architecture, scheme: QuantConfig) -> float:
    """Storage bits per weight of one routed expert under ``scheme`` (16 when it keeps the experts)."""
    from harness.quant.experts import name_matches
    from harness.quant.format_table import storage_bits

    if not arch.num_experts or scheme.weights is None:
        return float(REFERENCE_BITS)
    layer = arch.dense_layers
    shapes = {p: (arch.moe_intermediate_size, arch.hidden_size) for p in ("gate_proj", "up_proj")}
    shapes["down_proj"] = (arch.hidden_size, arch.moe_intermediate_size)
    total = 0.0
    for proj, (out_features, in_features) in shapes.items():
        name = f"model.layers.{layer}.mlp.experts.0.{proj}"
        kept = name_matches(name, list(scheme.keep)) or not name_matches(name, list(scheme.targets))
        total += out_features * in_features * (REFERENCE_BITS if kept else
                                               storage_bits(scheme.weights, out_features, in_features))
    return total / arch.expert_params()


def ledger_for_run(model: Any, quant_report: "QuantReport", cfg: Any) -> Ledger:
    """The pipeline's call: shapes from the loaded model's config, weight bytes from the quantization report."""
    config = model.config.to_dict()
    if not config.get("num_hidden_layers") and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # multimodal wrappers keep the decoder's shapes there
    arch = _from_hf_dict(config)
    if not (arch.layers and arch.kv_heads and arch.head_dim):
        arch = architecture(cfg.model)
    arch = dataclasses.replace(arch, params=float(quant_report.total_params))
    if quant_report.input_embedding is not None:  # the loaded model's own embedding, untied
        arch = dataclasses.replace(arch, tied_embeddings=False, vocab_size=quant_report.input_embedding[0],
                                   hidden_size=quant_report.input_embedding[1])
    return build_ledger(cfg.model.name, arch, cfg.quant, weight_bytes=quant_report.weight_bits / 8,
                        bits=float(quant_report.summary()["bits_per_weight"]))

# ------------------------------------------------------------------------------- CLI
@dataclass
class LedgerOptions:
    gpus: list[str] = field(default_factory=lambda: list(DEFAULT_GPUS),
                            metadata={"help": f"{sorted(GPU_MEMORY_GB)} or NAME:memory_GB:bandwidth_TBps"})
    kv: list[str] = field(default_factory=lambda: list(DEFAULT_KV), metadata={"help": "bf16 or conf/quant/kv_cache/*"})
    reserve_gb: float = field(default=DEFAULT_RESERVE_GB, metadata={"help": "runtime reserve per GPU, GB"})
    context: int = field(default=DEFAULT_CONTEXT, metadata={"help": "tokens per sequence for the batch column"})
    arch: Architecture = field(default_factory=Architecture, metadata={"help": "shape overrides (arch.layers=...)"})
    out: Optional[str] = field(default=None, metadata={"help": "output dir (default results/ledger/<model>__<scheme>)"})


TOOL = cli.Tool(prog="python -m harness.ledger", options=LedgerOptions, run_config=True,
                summary="Capacity ledger: weight bytes, KV bytes per token, memory left for KV, tokens and batch that "
                        "fit, and the batch-1 decode floor per GPU, from the model's shapes (no weights loaded).")


def _body(parsed: cli.Parsed[LedgerOptions]) -> int:
    from harness import quant

    options = parsed.options
    assert options is not None
    gpus = resolve_gpus(list(options.gpus))  # bad GPU names fail before the config is composed
    cfg = parsed.run
    scheme = quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups)
    quant.validate_scheme(scheme)
    arch = architecture(cfg.model, options.arch)
    ledger = build_ledger(cfg.model.name, arch, scheme, gpus=[f"{g.name}:{g.memory_gb}:{g.bandwidth_tbs}" for g in gpus],
                          kv=list(options.kv), reserve_gb=options.reserve_gb, context=options.context)
    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", f"{cfg.model.name}__{cfg.quant.name}")
    out = Path(options.out) if options.out else Path(cfg.paths.results_dir) / "ledger" / safe
    out.mkdir(parents=True, exist_ok=True)
    ledger.write_csv(out / "ledger.csv")
    (out / "ledger.md").write_text(ledger.markdown())
    print(f"# {cfg.model.name} · {cfg.quant.name}: {arch.total_params() / 1e9:.3g}B parameters, {arch.layers} layers, "
          f"{arch.kv_heads} KV heads × {arch.head_dim}\n")
    print(ledger.markdown())
    print(f"wrote {out / 'ledger.csv'} and {out / 'ledger.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
