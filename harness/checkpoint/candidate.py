"""External candidates: judge a checkpoint someone else quantized against its reference.

``python -m harness model=llama8b quant=external candidate.path=RedHatAI/Llama-3.1-8B-Instruct-quantized.w4a16``
evaluates the checkpoint at ``candidate.path`` where the harness would otherwise quantize the
reference itself; everything else (items, reference cache, paired statistics, divergence,
MLflow, reports, sweeps over ``candidate.path=a,b``) is the same pipeline.

Each format is loaded by its own library through transformers, never re-implemented here:

=====================  ===========================================  ===================================
``quant_method``       loaded by                                    on a CPU
=====================  ===========================================  ===================================
compressed-tensors     ``compressed-tensors`` (transformers'         decompressed to dense weights on
                       CompressedTensorsHfQuantizer)                first use: pack-quantized int4/int8,
                                                                    float-quantized fp8, naive-quantized;
                                                                    asymmetric pack-quantized fails to
                                                                    load in transformers 5.24 +
                                                                    compressed-tensors 0.20 (#1618);
                                                                    nvfp4-pack-quantized in bfloat16
                                                                    only; kv_cache_scheme refused
gptq                   ``optimum`` + ``gptqmodel``                   gptqmodel's torch kernels (CPU ok
                                                                    once installed); without gptqmodel
                                                                    transformers needs CUDA
awq                    ``gptqmodel``                                 as gptq
gguf (a .gguf file)    transformers ``gguf_file`` (``gguf``)        dequantized to the model dtype
=====================  ===========================================  ===================================

:func:`describe` reads the candidate's ``quantization_config`` and its safetensors headers
(tensor shapes and dtypes only, nothing is loaded) to give the scheme that lands in the quant
report and MLflow: method, bits, group size, symmetry, what is kept in high precision, and the
*measured* storage bits per weight of the quantized linears (packed weights + scales + zero
points + indices, as written). :func:`check_architecture` refuses a candidate whose shapes differ
from the reference's (layers, hidden and intermediate sizes, heads, KV heads from config.json before
any weight loads; every linear's shape once loaded), :func:`check_compatible` one whose tokenizer or
vocabulary differs, both before any evaluation: paired items would not be paired, and a 70B checkpoint
is no quantization of an 8B reference.

Mixture-of-experts candidates: compressed-tensors checkpoints as llm-compressor writes them (one tensor set
per expert, ``….experts.<e>.gate_proj.weight_packed``), which transformers decompresses and fuses on load.
Their expert count and per-expert shapes are checked against the reference from config.json and the
safetensors headers before any weight loads (:func:`check_stored_experts`) and on the loaded model
(:func:`check_expert_shapes`); the weight report has one layer per expert matrix, and the coverage account
(:func:`candidate_coverage`) reads which expert weights the checkpoint stores quantized. GPTQ and AWQ
checkpoints of a mixture of experts are refused (:func:`check_moe_loadable`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from harness.config import CandidateConfig, ModelConfig
from harness.errors import UsageError, UserError

log = logging.getLogger(__name__)

# What each quant_method needs installed, and which device it runs on without it.
REQUIREMENTS: dict[str, tuple[tuple[str, ...], str]] = {
    "compressed-tensors": (("compressed_tensors",), "cpu or cuda"),
    "gptq": (("optimum", "gptqmodel"), "cuda (cpu through gptqmodel's torch kernels)"),
    "awq": (("gptqmodel",), "cuda (cpu through gptqmodel's torch kernels)"),
}
PIP_NAMES = {"compressed_tensors": "compressed-tensors", "optimum": "optimum", "gptqmodel": "gptqmodel"}
# compressed-tensors formats that need a GPU kernel (nothing decompresses them on a CPU).
GPU_ONLY_FORMATS = {"marlin-24", "sparse-24-bitmask"}
# compressed-tensors formats whose mixture-of-experts experts transformers cannot load (5.25), and why
MOE_UNLOADABLE_FORMATS = {"int-quantized": "reads no int8 expert weight and stops with a conversion error"}


class CandidateError(UserError, ValueError):
    """A candidate that cannot be compared with this reference; the message says why and what to do."""


@dataclass
class CandidateScheme:
    """What the candidate's checkpoint says about its quantization (lands in the quant report)."""

    name: str
    method: str  # compressed-tensors | gptq | awq | gguf | none
    bits: Optional[int] = None
    group_size: Optional[int] = None
    symmetric: Optional[bool] = None
    format: Optional[str] = None  # compressed-tensors format, GGUF tensor types, GPTQ checkpoint format
    kept: list[str] = field(default_factory=list)  # modules the config leaves in high precision
    activations: Optional[str] = None  # e.g. "fp8 dynamic per token"
    bits_per_weight: Optional[float] = None  # measured from the safetensors headers
    details: dict[str, Any] = field(default_factory=dict)
    # tensor name → (shape, dtype) from the safetensors headers of a local checkpoint (empty otherwise)
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict, repr=False)

    def as_params(self) -> dict[str, Any]:
        """Flat ``candidate.*`` parameters for MLflow and summary.json."""
        values = {"name": self.name, "method": self.method, "bits": self.bits, "group_size": self.group_size,
                  "symmetric": self.symmetric, "format": self.format, "activations": self.activations,
                  "bits_per_weight": self.bits_per_weight, "kept": ",".join(self.kept) or None}
        return {f"candidate.{k}": v for k, v in values.items() if v is not None}


def requested(cfg: CandidateConfig, scheme_name: str) -> bool:
    """Whether the job evaluates an external checkpoint (in process, or served: ``candidate.endpoint`` /
    ``candidate.serve``, harness.engines.served); a contradictory config is refused."""
    if cfg.endpoint or cfg.serve:
        from harness.engines.served_config import check_config

        check_config(cfg, scheme_name)
        return True
    if cfg.path and scheme_name not in ("external", "none"):
        raise UsageError(f"candidate.path={cfg.path} is an external checkpoint, so the harness does not quantize "
                         f"anything itself; use quant=external (got quant={scheme_name})")
    if scheme_name == "external" and not cfg.path:
        raise UsageError("quant=external evaluates an external checkpoint: set candidate.path=<hub id or directory> "
                         "(and candidate.gguf_file=<file> for a GGUF)")
    return bool(cfg.path)


def candidate_name(cfg: CandidateConfig) -> str:
    if cfg.name:
        return cfg.name
    if cfg.endpoint or cfg.serve:
        from harness.engines.served_config import served_name

        return served_name(cfg)
    assert cfg.path
    base = cfg.gguf_file or cfg.path.rstrip("/").split("/")[-1]
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", base)


def model_config(cfg: CandidateConfig, reference: ModelConfig) -> ModelConfig:
    """The candidate as a model source, inheriting the reference's device, dtype and eval settings."""
    if not cfg.path:
        raise CandidateError("candidate.path is empty: give the quantized checkpoint's hub id or local directory")
    return ModelConfig(name=candidate_name(cfg), source="hf", path=cfg.path, gguf_file=cfg.gguf_file,
                       revision=cfg.revision, dtype=reference.dtype, device=reference.device,
                       chat_template=reference.chat_template, max_length=reference.max_length,
                       batch_size=reference.batch_size, trust_remote_code=cfg.trust_remote_code)


# --------------------------------------------------------------------------- reading the scheme
def _method(quant_config: dict[str, Any] | None) -> str:
    if not quant_config:
        return "none"
    method = str(quant_config.get("quant_method", "unknown")).lower()
    return {"compressed_tensors": "compressed-tensors"}.get(method, method)


def _describe_compressed_tensors(qc: dict[str, Any], scheme: CandidateScheme) -> None:
    groups = list((qc.get("config_groups") or {}).values())
    scheme.format = qc.get("format")
    scheme.kept = list(qc.get("ignore") or [])
    if qc.get("kv_cache_scheme"):
        scheme.details["kv_cache"] = qc["kv_cache_scheme"]
    if not groups:
        return
    weights = groups[0].get("weights") or {}
    scheme.bits = weights.get("num_bits")
    scheme.group_size = weights.get("group_size")
    scheme.symmetric = weights.get("symmetric")
    kind = weights.get("type", "int")
    scheme.details.update({"weight_type": kind, "strategy": weights.get("strategy"), "n_config_groups": len(groups)})
    acts = groups[0].get("input_activations")
    if acts:
        scheme.activations = (f"{acts.get('type', 'int')}{acts.get('num_bits')} "
                              f"{'dynamic' if acts.get('dynamic') else 'static'} per {acts.get('strategy')}")


def _describe_gptq_awq(qc: dict[str, Any], scheme: CandidateScheme) -> None:
    scheme.bits = qc.get("bits") or qc.get("w_bit")
    scheme.group_size = qc.get("group_size") or qc.get("q_group_size")
    if scheme.method == "gptq":
        scheme.symmetric = qc.get("sym")
        scheme.format = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        scheme.details = {"desc_act": qc.get("desc_act"), "damp_percent": qc.get("damp_percent")}
    else:
        zero_point = qc.get("zero_point")
        scheme.symmetric = None if zero_point is None else not zero_point
        scheme.format = qc.get("version") or qc.get("backend") or "awq"
    scheme.kept = list(qc.get("modules_to_not_convert") or [])


def describe(config: dict[str, Any], *, name: str, directory: Path | None = None,
             linear_shapes: dict[str, tuple[int, int]] | None = None) -> CandidateScheme:
    """The candidate's scheme from its ``config.json`` dict (and its files, when ``directory`` is local).

    ``linear_shapes`` (module name → [out, in] of the reference's linears) lets the measured bits per
    weight count the stored bytes of each quantized linear against its dense element count.
    """
    qc = config.get("quantization_config")
    scheme = CandidateScheme(name=name, method=_method(qc))
    if scheme.method == "compressed-tensors":
        _describe_compressed_tensors(qc, scheme)
    elif scheme.method in ("gptq", "awq"):
        _describe_gptq_awq(qc, scheme)
    elif qc:
        scheme.details = {"quantization_config": qc}
    if directory is not None:
        scheme.tensors = stored_tensors(directory)
    if directory is not None and linear_shapes:
        scheme.bits_per_weight = measured_bits_per_weight(directory, linear_shapes, set(scheme.kept))
    return scheme


def served_params(directory: Path | None, name: str, reference_model: Any) -> dict[str, Any]:
    """A served checkpoint's scheme and *stored* bits per weight as ``candidate.*`` parameters, read from the local
    ``directory`` its server names (vLLM's ``/v1/models`` ``root``); {} without one. ``candidate.name`` and
    ``candidate.method`` (``served``) stay the served candidate's; its checkpoint's method is
    ``candidate.checkpoint_method``."""
    if directory is None:
        return {}
    scheme = describe(json.loads((directory / "config.json").read_text()), name=name, directory=directory,
                      linear_shapes=linear_shapes(reference_model))
    params = {k: v for k, v in scheme.as_params().items() if k not in ("candidate.name", "candidate.method")}
    params["candidate.checkpoint_method"] = scheme.method
    return params


def stored_tensors(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor's (shape, dtype) in ``directory``'s safetensors headers; nothing is loaded."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        for tensor, info in _safetensors_header(file).items():
            out[tensor] = (tuple(int(d) for d in info["shape"]), str(info["dtype"]))
    return out


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    return header


_DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U8": 8,
               "F8_E4M3": 8, "F8_E5M2": 8, "BOOL": 8}


def measured_bits_per_weight(directory: Path, linear_shapes: dict[str, tuple[int, int]],
                             kept: set[str] = frozenset()) -> Optional[float]:
    """Stored bits per weight of the quantized linears, from the safetensors headers.

    Every tensor named ``<linear>.<anything>`` (``weight_packed``, ``weight_scale``, ``qweight``,
    ``scales``, ``qzeros``, ``g_idx``, ...) counts towards its linear at its stored dtype's width, except
    the bias; linears stored densely (a plain ``.weight`` of the full shape in a 16- or 32-bit float, or
    named in ``kept``) are left out. A full-shape ``.weight`` stored in 8 bits (FP8 ``F8_E4M3``, INT8
    ``I8``: compressed-tensors' float-/int-quantized formats, most shipped FP8 checkpoints) is
    quantized: 8 bits plus its scales. None when the directory holds no safetensors (hub checkpoints
    not downloaded, GGUF).
    """
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    per_linear: dict[str, float] = {}
    dense: set[str] = set()
    for file in files:
        for tensor, info in _safetensors_header(file).items():
            module, _, leaf = tensor.rpartition(".")
            if module not in linear_shapes or leaf == "bias" or module in kept:
                continue
            numel = 1
            for dim in info["shape"]:
                numel *= int(dim)
            if leaf == "weight" and tuple(info["shape"]) == tuple(linear_shapes[module]) \
                    and _DTYPE_BITS.get(info["dtype"], 32) >= 16:
                dense.add(module)
            per_linear[module] = per_linear.get(module, 0.0) + numel * _DTYPE_BITS.get(info["dtype"], 32)
    quantized = [m for m in per_linear if m not in dense]
    if not quantized:
        return None
    elements = sum(linear_shapes[m][0] * linear_shapes[m][1] for m in quantized)
    return sum(per_linear[m] for m in quantized) / elements


# --------------------------------------------------------------------------- checks
def check_loadable(scheme: CandidateScheme, device: str, dtype: str | None = None) -> None:
    """Refuse, before loading, a candidate whose library is missing or that needs a GPU kernel.

    Also refused (transformers 5.24 + compressed-tensors 0.20, what ``harness.checkpoint.export`` writes):
    ``nvfp4-pack-quantized`` in any dtype but bfloat16 (the library decompresses NVFP4 into
    bfloat16 weights whatever the model's dtype, and the first forward fails on the mismatch), and a
    ``kv_cache_scheme`` (the library does not attach it to transformers 5.24's attention, whose
    forward takes ``cache=``: the loaded ``k_scale``/``v_scale`` are dropped and the KV cache would
    run unquantized, so the run would not measure what the checkpoint serves).
    """
    import importlib.util

    needs, runs_on = REQUIREMENTS.get(scheme.method, ((), "cpu or cuda"))
    missing = [module for module in needs if importlib.util.find_spec(module) is None]
    if missing:
        packages = " ".join(PIP_NAMES.get(m, m) for m in missing)
        raise CandidateError(f"candidate {scheme.name!r} is a {scheme.method} checkpoint; transformers loads it "
                             f"through {', '.join(needs)}, which runs on {runs_on}. Fix: pip install {packages}")
    if scheme.format in GPU_ONLY_FORMATS and not device.startswith("cuda"):
        raise CandidateError(f"candidate {scheme.name!r} uses the compressed-tensors format {scheme.format!r}, "
                             "which only a GPU kernel runs; use model.device=cuda on a GPU machine")
    if scheme.format == "nvfp4-pack-quantized" and dtype is not None and dtype != "bfloat16":
        raise CandidateError(f"candidate {scheme.name!r} is nvfp4-pack-quantized: compressed-tensors decompresses "
                             f"NVFP4 into bfloat16 weights, which a {dtype} model cannot run (float != BFloat16); "
                             "set model.dtype=bfloat16 (or serve it with vLLM on a Blackwell/Hopper GPU)")
    if scheme.method == "compressed-tensors" and scheme.details.get("kv_cache"):
        raise CandidateError(f"candidate {scheme.name!r} has a kv_cache_scheme (fp8 k_scale/v_scale); "
                             "compressed-tensors 0.20 does not attach it to transformers 5.24's attention, so the KV "
                             "cache would run unquantized and the run would not measure it. Evaluate it through "
                             "vLLM (kv_cache_dtype=fp8, GPU), or export the weights scheme without the KV cache")


def _check_experts_as_stored(model: Any, directory: Path, scheme: CandidateScheme) -> None:
    """The loaded experts equal compressed-tensors' own decompression of the checkpoint's expert tensors
    (harness.checkpoint.expert_load); where transformers loaded them otherwise, the library's values are
    written and the quant report says so."""
    from harness.checkpoint.expert_load import check_loaded_experts

    result = check_loaded_experts(model, directory)
    if result.rewritten:
        log.warning("candidate %s: transformers loaded %d of %d expert matrices otherwise than compressed-tensors "
                    "decompresses them (max |Δ| %.3g); using compressed-tensors' values", scheme.name,
                    len(result.rewritten), result.matrices, result.max_abs_difference)
    if result.matrices:
        scheme.details["experts_from_library"] = {"matrices": result.matrices, "rewritten": len(result.rewritten),
                                                  "max_abs_difference": result.max_abs_difference}


def check_moe_loadable(scheme: CandidateScheme, reference_model: Any) -> None:
    """Refuse, before loading, a mixture-of-experts checkpoint whose experts transformers would not load as
    stored: GPTQ and AWQ (their loaders replace ``nn.Linear``s; transformers 5 keeps experts as fused 3-D
    parameters, so the experts would not be read; not verified here either: gptqmodel is not installed), and
    the compressed-tensors forms transformers 5.25's expert conversion stops on (INT8 W8A8 ``int-quantized``,
    asymmetric ``pack-quantized``). NVFP4 experts load, with wrong values (it drops the global scale):
    :func:`_check_experts_as_stored` replaces them by compressed-tensors' own decompression.
    """
    from harness.quant.experts import find_fused_experts

    if not find_fused_experts(reference_model):
        return
    if scheme.method in ("gptq", "awq"):
        raise CandidateError(f"candidate {scheme.name!r} is a {scheme.method} checkpoint of a mixture-of-experts "
                             "model; the harness does not load those (transformers 5 stores experts as fused 3-D "
                             f"parameters, which {scheme.method} loaders do not read). Fix: use a compressed-tensors "
                             "checkpoint of it (llm-compressor), or serve it with vLLM (candidate.serve=...)")
    if scheme.method != "compressed-tensors":
        return
    why = MOE_UNLOADABLE_FORMATS.get(str(scheme.format))
    if why is None and scheme.symmetric is False:
        why = "passes no zero point to the decompressor, which stops on asymmetric weights"
    if why is not None:
        kind = f"{scheme.format}{'' if scheme.symmetric is not False else ' asymmetric'}"
        raise CandidateError(f"candidate {scheme.name!r} is a {kind} mixture-of-experts checkpoint, which transformers "
                             f"{_transformers_version()} cannot load (its expert conversion {why}). Fix: serve it "
                             "with vLLM (candidate.serve=... or candidate.endpoint=...)")


def _vocab_digest(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def check_compatible(reference_tokenizer: Any, candidate_tokenizer: Any, reference_vocab_size: int,
                     candidate_vocab_size: int, *, name: str) -> None:
    """Same tokenizer and output vocabulary, or a clear error: paired items must see the same tokens."""
    problems = []
    if reference_vocab_size != candidate_vocab_size:
        problems.append(f"output vocabulary {candidate_vocab_size} vs the reference's {reference_vocab_size}")
    if _vocab_digest(reference_tokenizer) != _vocab_digest(candidate_tokenizer):
        problems.append(f"tokenizer vocabulary differs ({len(candidate_tokenizer)} vs {len(reference_tokenizer)} "
                        "tokens)")
    for special in ("bos_token", "eos_token"):
        ours, theirs = getattr(reference_tokenizer, special, None), getattr(candidate_tokenizer, special, None)
        if ours != theirs:
            problems.append(f"{special} {theirs!r} vs the reference's {ours!r}")
    if problems:
        raise CandidateError(f"candidate {name!r} is not a quantization of this reference: " + "; ".join(problems)
                             + ". Fix: pick the reference model the candidate was made from (model=...)")


# config.json fields that fix a decoder's shapes, with the words the refusal uses.
ARCHITECTURE_FIELDS = {"num_hidden_layers": "layers", "hidden_size": "hidden size",
                       "intermediate_size": "intermediate size", "num_attention_heads": "attention heads",
                       "num_key_value_heads": "KV heads", "head_dim": "head dim",
                       # mixture of experts (the expert count is compared apart: its field's name differs by
                       # family and by transformers version, num_experts / num_local_experts / n_routed_experts)
                       "num_experts_per_tok": "experts per token", "moe_intermediate_size": "expert intermediate size",
                       "n_shared_experts": "shared experts",
                       "shared_expert_intermediate_size": "shared expert intermediate size",
                       "first_k_dense_replace": "leading dense layers", "decoder_sparse_step": "MoE layer step"}
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def _decoder_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields (multimodal wrappers keep them in ``text_config``)."""
    if not config.get("num_hidden_layers") and isinstance(config.get("text_config"), dict):
        return config["text_config"]
    return config


def check_architecture(reference_config: dict[str, Any], candidate_config: dict[str, Any], *, name: str,
                       reference_name: str) -> None:
    """Same decoder shapes in both config.json dicts, or one line naming both (fields either lacks are skipped)."""
    ours, theirs = _decoder_config(reference_config), _decoder_config(candidate_config)
    problems = [f"{words} {theirs[key]} vs {ours[key]}" for key, words in ARCHITECTURE_FIELDS.items()
                if ours.get(key) is not None and theirs.get(key) is not None and ours[key] != theirs[key]]
    experts = [_expert_count(config) for config in (ours, theirs)]
    if experts[0] != experts[1]:  # also a dense model against a mixture of experts
        problems.insert(0, f"experts {'none' if experts[1] is None else experts[1]} vs "
                           f"{'none' if experts[0] is None else experts[0]}")
    if problems:
        raise CandidateError(f"candidate {name!r} is not a quantization of reference {reference_name!r}: "
                             + ", ".join(problems) + " (candidate vs reference). Fix: pick the reference model the "
                             "candidate was made from (model=...)")


def _expert_count(config: dict[str, Any]) -> int | None:
    return next((int(config[key]) for key in EXPERT_COUNT_FIELDS if config.get(key)), None)


def _refuse(name: str, reference_name: str, what: str) -> CandidateError:
    return CandidateError(f"candidate {name!r} is not a quantization of reference {reference_name!r}: {what}. Fix: "
                          "pick the reference model the candidate was made from (model=...)")


def check_stored_experts(reference_model: Any, tensors: dict[str, tuple[tuple[int, ...], str]], *, name: str,
                         reference_name: str) -> None:
    """Before the weights load: every MoE layer of the reference stored with as many experts, each matrix of
    the reference's shape where the headers show it, under the per-expert names engines read.

    Read from the safetensors headers (``scheme.tensors``); skipped for a checkpoint without local files, and
    for a layer the checkpoint stores fused (``experts.gate_up_proj``) — the loaded model's shapes are
    compared then (:func:`check_expert_shapes`).
    """
    from harness.checkpoint.expert_layout import expert_checkpoint_names, expert_modules
    from harness.checkpoint.expert_load import stored_name

    experts = expert_modules(reference_model)
    if not tensors or not experts:
        return
    names = expert_checkpoint_names(reference_model, experts)
    modules = {tensor.rpartition(".")[0] for tensor in tensors}
    for module_name, info in experts.items():
        first = names[info.harness_names()[0]]  # ….experts.0.<proj>
        prefix = first.rpartition(".")[0].rpartition(".")[0]
        stored = {m for m in modules if m.startswith(prefix + ".")}
        if not stored or any(m.count(".") == prefix.count(".") + 1 for m in stored):
            continue  # stored fused, or not at all under this name: the loaded model is checked
        indices = {m[len(prefix) + 1:].split(".", 1)[0] for m in stored}
        found = sorted(int(i) for i in indices if i.isdigit())
        if found != list(range(info.num_experts)):
            raise _refuse(name, reference_name, f"it stores {len(found)} experts in {prefix} (indices "
                          f"{found[0] if found else '-'}..{found[-1] if found else '-'}), the reference "
                          f"{info.num_experts}")
        for harness_name, target in names.items():
            if not harness_name.startswith(module_name + "."):
                continue
            target = stored_name(harness_name, target, tensors)
            out, inp = info.shape(harness_name.rsplit(".", 1)[1])
            weight = tensors.get(f"{target}.weight") or tensors.get(f"{target}.weight_packed")
            if weight is None:
                raise _refuse(name, reference_name, f"expert matrix {target} is missing from the checkpoint")
            shape = weight[0]
            dense = f"{target}.weight" in tensors
            if (dense and tuple(shape) != (out, inp)) or (not dense and shape[0] != out):
                raise _refuse(name, reference_name, f"expert matrix {target} is stored as {list(shape)}, the "
                              f"reference's is [{out}, {inp}]")


def check_expert_shapes(reference_model: Any, candidate_model: Any, *, name: str, reference_name: str) -> None:
    """Once loaded: every fused experts module of the reference in the candidate, with as many experts and
    the same [out, in] per projection."""
    from harness.quant.experts import find_fused_experts

    ours, theirs = find_fused_experts(reference_model), find_fused_experts(candidate_model)
    problems = []
    for module_name, info in ours.items():
        other = theirs.get(module_name)
        if other is None:
            problems.append(f"{module_name} missing")
            continue
        if other.num_experts != info.num_experts:
            problems.append(f"{module_name} {other.num_experts} experts vs {info.num_experts}")
            continue
        for proj in info.projections():
            if proj not in other.projections() or other.shape(proj) != info.shape(proj):
                found = list(other.shape(proj)) if proj in other.projections() else "missing"
                problems.append(f"{module_name}.{proj} {found} vs {list(info.shape(proj))}")
    if problems:
        raise _refuse(name, reference_name, f"{len(problems)} experts module(s) differ (candidate vs reference), e.g. "
                      + "; ".join(problems[:3]))


def check_linear_shapes(reference_model: Any, candidate_model: Any, *, name: str, reference_name: str) -> None:
    """Every linear of the reference present in the candidate with the same (out, in) features."""
    theirs = dict(candidate_model.named_modules())
    problems = []
    for module_name, shape in linear_shapes(reference_model).items():
        other = theirs.get(module_name)
        if other is None:
            problems.append(f"{module_name} missing")
            continue
        found = _features(other)
        if found != shape:
            problems.append(f"{module_name} {list(found) if found else '?'} vs {list(shape)}")
    if problems:
        raise CandidateError(f"candidate {name!r} is not a quantization of reference {reference_name!r}: "
                             f"{len(problems)} linear(s) differ (candidate vs reference [out, in]), e.g. "
                             + "; ".join(problems[:3]) + ". Fix: pick the reference model the candidate was made "
                             "from (model=...)")


def _features(module: Any) -> tuple[int, int] | None:
    """(out, in) features of a linear, also of a library's quantized linear (GPTQ's ``outfeatures``)."""
    for out_name, in_name in (("out_features", "in_features"), ("outfeatures", "infeatures")):
        if hasattr(module, out_name) and hasattr(module, in_name):
            return int(getattr(module, out_name)), int(getattr(module, in_name))
    weight = getattr(module, "weight", None)
    return (int(weight.shape[0]), int(weight.shape[-1])) if weight is not None and weight.dim() == 2 else None


def linear_shapes(model: Any) -> dict[str, tuple[int, int]]:
    import torch

    return {name: (module.out_features, module.in_features) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)}


def checkpoint_shapes(model: Any) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """(module name in a checkpoint → (out, in), harness name → checkpoint name) of every Linear and every
    mixture-of-experts expert matrix of ``model``: experts are stored one Linear per expert matrix
    (``….mlp.experts.3.gate_proj``, ``….block_sparse_moe.experts.3.w1``; harness.checkpoint.expert_layout),
    however the model holds them (fused, or unfused by an activation-quantized scheme)."""
    from harness.checkpoint.expert_layout import checkpoint_names, expert_checkpoint_names, expert_modules

    experts = expert_modules(model)
    inside = tuple(f"{name}." for name in experts)
    dense = {name: shape for name, shape in linear_shapes(model).items() if not name.startswith(inside)}
    saved = checkpoint_names(model, [f"{name}.weight" for name in dense]) if experts else {}
    names = {name: saved.get(f"{name}.weight", f"{name}.weight").removesuffix(".weight") for name in dense}
    shapes = {names[name]: shape for name, shape in dense.items()}
    expert_names = expert_checkpoint_names(model, experts) if experts else {}
    for name, target in expert_names.items():
        prefix, _, proj = name.rpartition(".")
        shapes[target] = experts[prefix.rpartition(".")[0]].shape(proj)
    return shapes, {**names, **expert_names}


def read_config(cfg: CandidateConfig) -> tuple[dict[str, Any], Path | None]:
    """The candidate's config.json as a dict (local directory, or the hub through transformers)."""
    if cfg.path is None:
        raise CandidateError("candidate.path is empty")
    local = Path(cfg.path).expanduser()
    if cfg.gguf_file:
        return {"quantization_config": {"quant_method": "gguf", "file": cfg.gguf_file}}, None
    if local.is_dir():
        config_file = local / "config.json"
        if not config_file.exists():
            raise CandidateError(f"candidate.path={cfg.path} has no config.json; is it a transformers checkpoint?")
        return json.loads(config_file.read_text()), local
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(cfg.path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise CandidateError(f"cannot read the config of candidate.path={cfg.path!r}: {exc}") from exc
    return config.to_dict(), None


def describe_gguf(path: Path, name: str) -> CandidateScheme:
    """Tensor types and the measured bits per weight of the 2-D tensors of a GGUF file."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    counts: dict[str, int] = {}
    bits = elements = 0
    for tensor in reader.tensors:
        if len(tensor.shape) != 2:
            continue
        kind = tensor.tensor_type.name
        counts[kind] = counts.get(kind, 0) + 1
        bits += int(tensor.n_bytes) * 8
        elements += int(tensor.n_elements)
    fmt = ", ".join(f"{kind}×{n}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return CandidateScheme(name=name, method="gguf", format=fmt, bits_per_weight=bits / max(elements, 1),
                           details={"file": path.name, "tensor_types": counts})


def gguf_path(cfg: CandidateConfig) -> Path:
    """The candidate's .gguf file: ``path`` a local directory or an installed package holding ``gguf_file``."""
    import importlib.util

    assert cfg.path and cfg.gguf_file
    local = Path(cfg.path).expanduser()
    if not local.is_dir():
        spec = importlib.util.find_spec(cfg.path)
        if spec is None or not spec.submodule_search_locations:
            raise CandidateError(f"candidate.path={cfg.path!r} is neither a local directory nor an installed package "
                                 f"holding {cfg.gguf_file}")
        local = Path(list(spec.submodule_search_locations)[0])
    file = local / cfg.gguf_file
    if not file.exists():
        available = sorted(p.name for p in local.glob("*.gguf"))
        raise CandidateError(f"candidate.gguf_file={cfg.gguf_file!r} is not in {local}; found {available}")
    return file


def load(cfg: CandidateConfig, reference: ModelConfig, cache_dir: str, *, reference_model: Any,
         reference_tokenizer: Any) -> tuple[Any, CandidateScheme]:
    """Check, load and describe the candidate; returns (``harness.models.loading.LoadedModel``, its scheme).

    Everything that can fail cheaply (missing library, GPU-only format, unreadable config) fails
    before the weights load; a tokenizer or vocabulary mismatch fails before any evaluation.
    """
    import torch

    from harness.models import loading as models

    name = candidate_name(cfg)
    directory: Path | None = None
    shapes, _ = checkpoint_shapes(reference_model)
    reference_config = reference_model.config.to_dict()
    if cfg.gguf_file:
        file = gguf_path(cfg)
        scheme = describe_gguf(file, name)
    else:
        config, directory = read_config(cfg)
        check_architecture(reference_config, config, name=name, reference_name=reference.name)
        scheme = describe(config, name=name, directory=directory, linear_shapes=shapes)
        check_stored_experts(reference_model, scheme.tensors, name=name, reference_name=reference.name)
    check_loadable(scheme, reference.device, reference.dtype)
    check_moe_loadable(scheme, reference_model)
    if cfg.gguf_file:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                     dtype=models.torch_dtype(reference.dtype)).to(reference.device)
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        loaded = models.LoadedModel(model=model.eval(), tokenizer=tokenizer,
                                    identity={"source": "gguf_file", "file": str(file), "name": name})
    else:
        loaded = models.load(model_config(cfg, reference), cache_dir)
    check_architecture(reference_config, loaded.model.config.to_dict(), name=name, reference_name=reference.name)
    check_linear_shapes(reference_model, loaded.model, name=name, reference_name=reference.name)
    check_expert_shapes(reference_model, loaded.model, name=name, reference_name=reference.name)
    if scheme.method == "compressed-tensors" and not cfg.gguf_file and directory is not None:
        _check_experts_as_stored(loaded.model, directory, scheme)
    check_compatible(reference_tokenizer, loaded.tokenizer, reference_model.config.vocab_size,
                     loaded.model.config.vocab_size, name=name)
    with torch.no_grad():  # compressed-tensors decompresses on the first forward; do it before timing
        loaded.model(torch.zeros(1, 1, dtype=torch.long, device=next(loaded.model.parameters()).device))
    log.info("candidate %s: %s %s-bit, group %s, %.3f bits/weight measured", name, scheme.method, scheme.bits,
             scheme.group_size, scheme.bits_per_weight or float("nan"))
    return loaded, scheme


def weight_report(reference_model: Any, candidate_model: Any, scheme: CandidateScheme, total_params: int):
    """Per-linear SQNR of the candidate's (dequantized) weights against the reference's.

    A :class:`harness.quant.report.QuantReport`, so the candidate lands in the same quant report as
    the harness's own schemes. Linears whose weights are identical are the ones kept (counted in bits
    per weight at 16, as the harness's own kept linears). A candidate none of whose linears could be
    compared (no reference linear's name and shape in it) is refused: its report would be empty.
    """
    from harness.quant import QuantReport, linear_census

    report = QuantReport(scheme=scheme.name, method=f"external:{scheme.method}", total_params=total_params)
    theirs = dict(candidate_model.named_modules())
    bits = scheme.bits_per_weight or float(scheme.bits or 16)
    linears = 0
    for name, module in reference_model.named_modules():
        if not hasattr(module, "out_features"):
            continue
        linears += 1
        other = theirs.get(name)
        weight = getattr(other, "weight", None)
        if weight is None or weight.shape != module.weight.shape:
            continue
        if bool((weight.detach().to(module.weight.dtype) == module.weight.detach()).all()):
            report.kept.append(name)
            continue
        report.add_layer(name, module.weight, weight.to(module.weight.device), bits)
    _expert_layers(reference_model, candidate_model, report, bits)
    if not report.layers and not report.kept:
        raise CandidateError(f"candidate {scheme.name!r}: none of the reference's {linears} linears is in it with the "
                             "same name and dense weight shape, so its weights cannot be compared (a weight report "
                             "over 0 layers); load it with a library that dequantizes it (see docs/guides/checkpoints-and-export.md) "
                             "or pick the reference it was made from")
    report.kept_params, report.output_head, report.input_embedding = linear_census(reference_model, report.kept)
    report.coverage = candidate_coverage(reference_model, scheme)
    experts = scheme.details.get("experts_from_library")
    if experts and experts["rewritten"]:
        report.notes.append(f"experts: {experts['rewritten']} of {experts['matrices']} expert matrices were loaded "
                            "by transformers otherwise than compressed-tensors decompresses them (max |Δ| "
                            f"{experts['max_abs_difference']:.3g}); the library's values are used")
    report.notes.append(f"external candidate ({scheme.method}, {scheme.format}); bits per weight measured from "
                        "the checkpoint's stored tensors" if scheme.bits_per_weight else
                        f"external candidate ({scheme.method}); bits per weight from its config")
    return report


def _expert_layers(reference_model: Any, candidate_model: Any, report: Any, bits: float) -> None:
    """Each expert matrix of the reference against the candidate's (both fused, as transformers loads them):
    one layer of the weight report per expert and projection, ``<experts>.<e>.<proj>``; identical ones kept."""
    from harness.quant.experts import find_fused_experts

    theirs = find_fused_experts(candidate_model)
    for module_name, info in find_fused_experts(reference_model).items():
        other = theirs.get(module_name)
        if other is None or other.num_experts != info.num_experts:
            continue
        for expert in range(info.num_experts):
            for proj in info.projections():
                ours, candidate_matrix = info.matrix(expert, proj), other.matrix(expert, proj)
                if candidate_matrix.shape != ours.shape:
                    continue
                name = f"{module_name}.{expert}.{proj}"
                if bool((candidate_matrix.to(ours.dtype) == ours).all()):
                    report.kept.append(name)
                else:
                    report.add_layer(name, ours, candidate_matrix.to(ours.device), bits)


def _ignored(name: str, ignore: list[str]) -> bool:
    """Whether a compressed-tensors ``ignore`` entry (a module name, a ``re:`` pattern, a name's last part)
    or a GPTQ/AWQ ``modules_to_not_convert`` entry names module ``name``."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif name == entry or name.endswith("." + entry):
            return True
    return False


def _weight_spec(scheme: CandidateScheme) -> Any:
    """The candidate's weight format as the harness's spec (for the coverage account's format label)."""
    from harness.config import TensorQuantConfig

    strategy = scheme.details.get("strategy") or ("group" if (scheme.group_size or 0) > 0 else "channel")
    if scheme.format == "nvfp4-pack-quantized":
        return TensorQuantConfig(format="nvfp4", granularity="group", group_size=16)
    if scheme.details.get("weight_type") == "float" and scheme.bits == 8:
        return TensorQuantConfig(format="fp8_e4m3", granularity="tensor" if strategy == "tensor" else "channel")
    granularity = strategy if strategy in ("group", "channel", "tensor") else "group"
    return TensorQuantConfig(format="int", bits=int(scheme.bits or 8), symmetric=scheme.symmetric is not False,
                             granularity=granularity, group_size=int(scheme.group_size or 128))


def candidate_coverage(reference_model: Any, scheme: CandidateScheme) -> Any:
    """The coverage account of an external checkpoint (harness.quant.coverage), parameter by parameter of
    the reference: what the checkpoint stores quantized, read from its tensors (a ``weight_packed``,
    ``weight_scale`` or ``qweight`` beside the module's name; expert matrices under their per-expert names),
    or, without local files, from its config (quantized unless ``ignore`` / ``modules_to_not_convert`` names
    it). Kept matrices name the checkpoint's rule: ``checkpoint.ignore`` when its ignore list names them,
    else ``checkpoint.targets``. A fused experts parameter whose experts are partly quantized is not covered.
    Quantized matrices count at the bits per weight measured from the checkpoint. None for formats without
    per-module names (GGUF) or a checkpoint with no quantization."""
    import dataclasses
    from types import SimpleNamespace

    from torch import nn

    from harness.checkpoint.expert_load import stored_name
    from harness.quant.coverage import KEPT, NOT_COVERED, QUANTIZED, coverage_account
    from harness.quant.experts import find_fused_experts

    if scheme.method not in ("compressed-tensors", "gptq", "awq") or not scheme.bits:
        return None
    _, names = checkpoint_shapes(reference_model)

    def stored_quantized(module: str) -> bool:
        saved = names.get(module, module)
        if scheme.tensors and module in names and "experts." in module:
            saved = stored_name(module, saved, scheme.tensors)
        if scheme.tensors:
            return any(f"{saved}.{leaf}" in scheme.tensors for leaf in ("weight_packed", "weight_scale", "qweight"))
        return not _ignored(saved, scheme.kept)

    def kept_rule(module: str) -> str:
        return "checkpoint.ignore" if _ignored(names.get(module, module), scheme.kept) else "checkpoint.targets"

    targets = {name: module for name, module in reference_model.named_modules()
               if isinstance(module, nn.Linear) and stored_quantized(name)}
    spec = _weight_spec(scheme)
    pseudo = SimpleNamespace(name=scheme.name, weights=spec, keep=[], targets=["*"], moe=None)
    account = coverage_account(reference_model, pseudo, targets)
    fused = find_fused_experts(reference_model)
    entries = []
    for entry in account.entries:
        module, _, param = entry.name.rpartition(".")
        if module in fused and entry.status == QUANTIZED and entry.dims == 3:
            info = fused[module]
            flags = [stored_quantized(f"{module}.{e}.{proj}") for e in range(info.num_experts)
                     for proj in info.projections() if info.fused_param(proj) == param]
            if not any(flags):
                rule = kept_rule(f"{module}.0.{next(p for p in info.projections() if info.fused_param(p) == param)}")
                entry = dataclasses.replace(entry, status=KEPT, rule=rule, bits=16.0)
            elif not all(flags):
                entry = dataclasses.replace(entry, status=NOT_COVERED, rule="", bits=16.0)
        elif entry.status == KEPT and entry.rule in ("quant.keep", "quant.targets"):
            entry = dataclasses.replace(entry, rule=kept_rule(module))
        if entry.status == QUANTIZED and scheme.bits_per_weight:
            entry = dataclasses.replace(entry, bits=float(scheme.bits_per_weight))
        entries.append(entry)
    account.entries = entries
    return account


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
