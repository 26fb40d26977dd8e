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

    def as_params(self) -> dict[str, Any]:
        """Flat ``candidate.*`` parameters for MLflow and summary.json."""
        values = {"name": self.name, "method": self.method, "bits": self.bits, "group_size": self.group_size,
                  "symmetric": self.symmetric, "format": self.format, "activations": self.activations,
                  "bits_per_weight": self.bits_per_weight, "kept": ",".join(self.kept) or None}
        return {f"candidate.{k}": v for k, v in values.items() if v is not None}


def requested(cfg: CandidateConfig, scheme_name: str) -> bool:
    """Whether the job evaluates an external checkpoint (in process, or served: ``candidate.endpoint`` /
    ``candidate.serve``, harness.checkpoint.served); a contradictory config is refused."""
    if cfg.endpoint or cfg.serve:
        from harness.checkpoint.served_config import check_config

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
        from harness.checkpoint.served_config import served_name

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
    if directory is not None and linear_shapes:
        scheme.bits_per_weight = measured_bits_per_weight(directory, linear_shapes, set(scheme.kept))
    return scheme


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
                       "num_key_value_heads": "KV heads", "head_dim": "head dim"}


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
    if problems:
        raise CandidateError(f"candidate {name!r} is not a quantization of reference {reference_name!r}: "
                             + ", ".join(problems) + " (candidate vs reference). Fix: pick the reference model the "
                             "candidate was made from (model=...)")


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
    shapes = linear_shapes(reference_model)
    reference_config = reference_model.config.to_dict()
    if cfg.gguf_file:
        file = gguf_path(cfg)
        scheme = describe_gguf(file, name)
    else:
        config, directory = read_config(cfg)
        check_architecture(reference_config, config, name=name, reference_name=reference.name)
        scheme = describe(config, name=name, directory=directory, linear_shapes=shapes)
    check_loadable(scheme, reference.device, reference.dtype)
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
    check_compatible(reference_tokenizer, loaded.tokenizer, reference_model.config.vocab_size,
                     loaded.model.config.vocab_size, name=name)
    with torch.no_grad():  # compressed-tensors decompresses on the first forward; do it before timing
        loaded.model(torch.zeros(1, 1, dtype=torch.long, device=next(loaded.model.parameters()).device))
    log.info("candidate %s: %s %s-bit, group %s, %.3f bits/weight measured", name, scheme.method, scheme.bits,
             scheme.group_size, scheme.bits_per_weight or float("nan"))
    return loaded, scheme


def weight_report(reference_model: Any, candidate_model: Any, scheme: CandidateScheme, total_params: int):
    """Per-linear SQNR of the candidate's (dequantized) weights against the reference's.

    A :class:`harness.quant.base.QuantReport`, so the candidate lands in the same quant report as
    the harness's own schemes. Linears whose weights are identical are the ones kept (counted in bits
    per weight at 16, as the harness's own kept linears). A candidate none of whose linears could be
    compared (no reference linear's name and shape in it) is refused: its report would be empty.
    """
    from harness.quant.base import QuantReport, linear_census

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
    if not report.layers and not report.kept:
        raise CandidateError(f"candidate {scheme.name!r}: none of the reference's {linears} linears is in it with the "
                             "same name and dense weight shape, so its weights cannot be compared (a weight report "
                             "over 0 layers); load it with a library that dequantizes it (see harness/candidate.py) "
                             "or pick the reference it was made from")
    report.kept_params, report.output_head, report.input_embedding = linear_census(reference_model, report.kept)
    report.notes.append(f"external candidate ({scheme.method}, {scheme.format}); bits per weight measured from "
                        "the checkpoint's stored tensors" if scheme.bits_per_weight else
                        f"external candidate ({scheme.method}); bits per weight from its config")
    return report
