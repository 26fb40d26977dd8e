"""``python -m harness.export format=gguf gguf_type=Q8_0 out=FILE.gguf``: the reference as a GGUF for llama.cpp.

The reference model exactly as the harness loads it (a llama-architecture transformers model:
``model=tiny_random``, SmolLM2 dequantized from its packaged GGUF, any ``hf:`` llama) is written as an
F32 GGUF with the ``gguf`` package's :class:`gguf.GGUFWriter` and its tensor-name map
(:func:`gguf.get_tensor_name_map`), with the tokenizer's vocabulary, merges, special tokens and chat
template as metadata; then llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``, run in
``.venv-llamacpp`` by :mod:`harness.checkpoint.llamacpp_worker` when this venv has no ``llama_cpp``)
writes the asked type (:data:`GGUF_TYPES`: Q8_0, Q6_K, Q4_K_M, IQ4_XS, ...), so every GGUF type is one
command. ``gguf_type=F32`` / ``F16`` are written by the writer itself (norms stay F32 in F16, as
llama.cpp's converter keeps them).

Layout conventions (llama.cpp's, which transformers' GGUF loader undoes on load):

* the query and key projections are permuted from transformers' rotate-half RoPE layout to llama.cpp's
  interleaved one: per head, rows ``[0..d/2) , [d/2..d)`` become pairs ``(0, d/2), (1, d/2+1), ...``
  (:func:`rope_interleave`);
* numpy shapes are transformers' (out, in): the writer stores them reversed, as GGUF's (in, out);
* a tied output head (``tie_word_embeddings``) is not written: llama.cpp reads ``token_embd`` for it.

What is refused before any weight is read, in one line: another architecture (only ``llama``), RoPE
scaling (llama3/yarn/linear: not mapped here), attention or MLP biases, an unknown ``gguf_type``, a
tokenizer that is not a byte-level BPE, and a pre-tokenizer that cannot be named (``gguf_pre=`` names
it: llama.cpp's ``tokenizer.ggml.pre``). After writing, llama.cpp tokenizes a probe of texts with the
written file's vocabulary and the export is refused unless every token equals the reference
tokenizer's (a wrong pre-tokenizer name shows up there, not at serving time).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness import cli
from harness.errors import UsageError, UserError

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama",)  # transformers model_type values the writer maps
WRITER_TYPES = ("F32", "F16")  # written by gguf's writer directly
# llama.cpp file types its quantizer writes without an importance matrix (llama_cpp.LLAMA_FTYPE_MOSTLY_<name>;
# IQ1_*, IQ2_XXS/XS/S and Q2_K_S need one, which this export does not compute)
QUANTIZER_TYPES = ("BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0",
                   "IQ4_XS", "IQ4_NL", "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_S", "IQ3_XS", "Q2_K")
GGUF_TYPES = WRITER_TYPES + QUANTIZER_TYPES
# A byte-level BPE's pre-tokenizer, as transformers' tokenizer.json describes it -> llama.cpp's name for it
PRE_TOKENIZERS = {
    '{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}': "gpt-2",
}
WORKER = Path(__file__).with_name("llamacpp_worker.py")
# Texts whose tokens must be the reference's under llama.cpp's tokenizer of the written file
PROBE_TEXTS = ["Quelle est la capitale de la France ? Ünïcödé → 東京タワー 😀 12345 `def f(x): return x**2`",
               "  two spaces,\ttab\nnew line\n\n\nthree; don't they'll I'M 3.14159 1,000,000",
               "<|im_start|>user\nWhat is 7*8?<|im_end|>\n<|im_start|>assistant\n"]


class GGUFExportError(UserError, ValueError):
    """A model, tokenizer or option the GGUF export cannot write; one line with the fix."""


# ------------------------------------------------------------------------------ checks before work
def check_type(gguf_type: str) -> str:
    """The canonical name of ``gguf_type``; refused (one line, the valid names) when it is not one."""
    name = gguf_type.upper()
    if name not in GGUF_TYPES:
        raise UsageError(f"gguf_type={gguf_type!r} is not a GGUF type this export writes; valid: "
                         f"{', '.join(GGUF_TYPES)}")
    return name


def check_architecture(config: Any) -> None:
    """Refuse a model the writer does not map (one line), before any weight is read."""
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        raise GGUFExportError(f"format=gguf writes {', '.join(ARCHITECTURES)} models; this model is {kind!r} "
                              "(convert it with llama.cpp's convert_hf_to_gguf.py instead)")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in (None, "default"):
        raise GGUFExportError(f"format=gguf: RoPE scaling {rope_type!r} is not mapped by this writer (default RoPE "
                              "only); convert it with llama.cpp's convert_hf_to_gguf.py instead")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise GGUFExportError("format=gguf: attention or MLP biases are not mapped by this writer; convert it with "
                              "llama.cpp's convert_hf_to_gguf.py instead")


def tokenizer_json(tokenizer: Any) -> dict:
    """transformers' fast tokenizer as its tokenizer.json; refused unless it is a byte-level BPE."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GGUFExportError("format=gguf needs a fast (tokenizers) tokenizer to read its vocabulary and merges")
    data = json.loads(backend.to_str())
    if (data.get("model") or {}).get("type") != "BPE" or "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
        raise GGUFExportError("format=gguf writes byte-level BPE tokenizers (llama.cpp's 'gpt2' model); this one is "
                              f"{(data.get('model') or {}).get('type')!r} without a ByteLevel pre-tokenizer")
    return data


def source_pre(source_gguf: Path | None) -> str | None:
    """``tokenizer.ggml.pre`` of the GGUF the model (or its tokenizer) was loaded from, when there is one."""
    if source_gguf is None or not source_gguf.is_file():
        return None
    import gguf

    reader = gguf.GGUFReader(str(source_gguf))
    found = reader.fields.get("tokenizer.ggml.pre")
    return str(found.contents()) if found is not None else None


def pre_tokenizer_name(data: dict, requested: str, from_source: str | None) -> str:
    """llama.cpp's pre-tokenizer name: ``gguf_pre`` when given, the source GGUF's, else one this module maps."""
    if requested != "auto":
        return requested
    if from_source:
        return from_source
    described = json.dumps(data.get("pre_tokenizer"))
    if described in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[described]
    raise GGUFExportError(f"format=gguf cannot name this tokenizer's pre-tokenizer for llama.cpp ({described[:120]}); "
                          "give it with gguf_pre=<llama.cpp name> (e.g. llama-bpe, qwen2, smollm); the export then "
                          "checks llama.cpp's tokens against the reference's")


# ------------------------------------------------------------------------------ the writer
def rope_interleave(weight: np.ndarray, n_head: int) -> np.ndarray:
    """A q/k projection's rows from transformers' rotate-half layout to llama.cpp's interleaved one, per head."""
    rows, cols = weight.shape
    head_dim = rows // n_head
    return weight.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _token_types(data: dict, n_vocab: int) -> list[int]:
    import gguf

    types = [int(gguf.TokenType.NORMAL)] * n_vocab
    for added in data.get("added_tokens") or []:
        if added["id"] < n_vocab:
            types[added["id"]] = int(gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED)
    return types


def _merges(data: dict) -> list[str]:
    merges = data["model"].get("merges") or []
    return [" ".join(pair) if isinstance(pair, (list, tuple)) else str(pair) for pair in merges]


def write_tokenizer(writer: Any, tokenizer: Any, data: dict, pre: str, n_vocab: int) -> None:
    """The tokenizer's vocabulary (ids in order, padded to the embedding's rows), merges, special tokens and chat
    template as GGUF metadata (``tokenizer.ggml.*``, llama.cpp's 'gpt2' byte-level BPE)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    tokens = [str(t) for t in tokens] + [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens[:n_vocab])
    writer.add_token_types(_token_types(data, n_vocab))
    writer.add_token_merges(_merges(data))
    for attribute, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                           ("unk_token_id", writer.add_unk_token_id), ("pad_token_id", writer.add_pad_token_id)):
        value = getattr(tokenizer, attribute, None)
        if value is not None:
            add(int(value))
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    writer.add_add_bos_token(bool(probe) and tokenizer.bos_token_id is not None and probe[0] == tokenizer.bos_token_id)
    writer.add_add_eos_token(bool(probe) and tokenizer.eos_token_id is not None and probe[-1] == tokenizer.eos_token_id
                             and len(probe) > 1)
    writer.add_add_space_prefix(False)
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(str(tokenizer.chat_template))


def write_gguf(model: Any, tokenizer: Any, path: Path, *, dtype: str = "F32", pre: str = "auto",
               source_gguf: Path | None = None, name: str | None = None) -> Path:
    """``model`` (a llama-architecture transformers model) and ``tokenizer`` as a GGUF file at ``path``, its
    2-D weights in ``dtype`` (F32 or F16; 1-D norms always F32)."""
    import gguf

    config = model.config
    check_architecture(config)
    data = tokenizer_json(tokenizer)
    pre_name = pre_tokenizer_name(data, pre, source_pre(source_gguf))
    n_layers, n_head = int(config.num_hidden_layers), int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_head)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // n_head)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    state = {key: value.detach().to("cpu").float().numpy() for key, value in model.state_dict().items()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    n_vocab = int(state["model.embed_tokens.weight"].shape[0])

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name or str(getattr(config, "_name_or_path", "") or "model"))
    writer.add_context_length(int(getattr(config, "max_position_embeddings", 2048)))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(head_dim)
    if head_dim * n_head != int(config.hidden_size):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "F32" else gguf.LlamaFileType.MOSTLY_F16)
    write_tokenizer(writer, tokenizer, data, pre_name, n_vocab)
    for key, value in state.items():
        if tied and key == "lm_head.weight":
            continue
        if key.endswith("rotary_emb.inv_freq"):
            continue
        gguf_name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise GGUFExportError(f"format=gguf: no GGUF name for tensor {key!r} of this llama model")
        if key.endswith("self_attn.q_proj.weight"):
            value = rope_interleave(value, n_head)
        elif key.endswith("self_attn.k_proj.weight"):
            value = rope_interleave(value, n_kv)
        value = np.ascontiguousarray(value, dtype=np.float16 if dtype == "F16" and value.ndim == 2 else np.float32)
        writer.add_tensor(gguf_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ------------------------------------------------------------------------------ llama.cpp (its own venv)
def llamacpp_python() -> str:
    """A Python with ``llama_cpp``: this one when it has it, else ``.venv-llamacpp``'s (refused when absent)."""
    try:
        import llama_cpp  # noqa: F401

        return sys.executable
    except ImportError:
        pass
    root = Path(os.environ.get("HARNESS_LLAMACPP_VENV", Path(__file__).resolve().parents[2] / ".venv-llamacpp"))
    python = root / "bin" / "python"
    if not python.exists() or not any(root.glob("lib/python*/site-packages/llama_cpp/__init__.py")):
        raise UsageError(f"llama.cpp is not installed ({python} missing): create it with "
                         "`bash scripts/llamacpp_venv.sh`, or use gguf_type=F32/F16 (no quantizer needed)")
    return str(python)


def run_worker(request: dict, timeout_s: float = 3600.0) -> dict:
    """One :mod:`harness.checkpoint.llamacpp_worker` call (JSON in, JSON out) in llama.cpp's Python."""
    done = subprocess.run([llamacpp_python(), str(WORKER)], input=json.dumps(request), capture_output=True,
                          text=True, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    answer = json.loads(lines[-1]) if lines else {}
    if done.returncode != 0 or not answer.get("ok"):
        tail = " | ".join((answer.get("error") or done.stderr or "(no output)").strip().splitlines()[-4:])
        raise GGUFExportError(f"llama.cpp's {request.get('op')} failed (exit {done.returncode}): {tail}")
    return answer


def quantize(source: Path, out: Path, gguf_type: str, threads: int = 0) -> dict:
    """``source`` (an F32/F16 GGUF) quantized by llama.cpp to ``gguf_type`` at ``out``."""
    return run_worker({"op": "quantize", "source": str(source), "out": str(out), "type": gguf_type,
                       "threads": threads})


def check_tokens(path: Path, tokenizer: Any, texts: list[str] = PROBE_TEXTS) -> None:
    """Refuse ``path`` unless llama.cpp (vocabulary of the written file) tokenizes each text as ``tokenizer``."""
    answer = run_worker({"op": "tokenize", "model": str(path), "texts": texts})
    for text, theirs in zip(texts, answer["tokens"]):
        ours = tokenizer(text, add_special_tokens=True)["input_ids"]
        if list(theirs) != list(ours):
            first = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
            raise GGUFExportError(f"{path.name}: llama.cpp tokenizes {text[:40]!r} as {len(theirs)} tokens, the "
                                  f"reference as {len(ours)} (first difference at token {first}); the pre-tokenizer "
                                  "name is wrong: give gguf_pre=<llama.cpp name>")


def tensor_census(path: Path) -> dict[str, Any]:
    """The written file's tensor types (count of each) and bits per weight of its 2-D tensors."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    types: dict[str, int] = {}
    bits = weights = 0
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
        if len(tensor.shape) == 2:
            bits += int(tensor.n_bytes) * 8
            weights += int(tensor.n_elements)
    return {"types": types, "bits_per_weight": bits / weights if weights else 0.0}


# ------------------------------------------------------------------------------ CLI
@dataclass
class GGUFOptions:
    out: str = field(default="", metadata={"help": "output file (.gguf, new), required"})
    format: str = field(default="gguf", metadata={"help": "gguf (this tool); compressed-tensors is the default export"})
    gguf_type: str = field(default="F32", metadata={"help": f"GGUF type: {', '.join(GGUF_TYPES)}"})
    gguf_pre: str = field(default="auto", metadata={"help": "llama.cpp pre-tokenizer name; auto: the source GGUF's, "
                                                             "or one mapped from the tokenizer"})
    threads: int = field(default=0, metadata={"help": "quantizer threads (0: llama.cpp's default)"})


TOOL = cli.Tool(prog="python -m harness.export format=gguf", options=GGUFOptions, run_config=True,
                summary="Write the reference model (no quant=) as a GGUF for llama.cpp: F32/F16 by gguf's writer, "
                        "any other gguf_type by llama.cpp's own quantizer (in .venv-llamacpp).")


def _source_gguf(model_cfg: Any) -> Path | None:
    """The packaged GGUF the model (or the tiny model's borrowed tokenizer) comes from, if any."""
    from harness.config import load_model_config
    from harness.models.loading import _gguf_source

    cfg = model_cfg
    if cfg.source == "tiny_random" and cfg.tiny is not None:
        cfg = load_model_config(cfg.tiny.tokenizer)
    if cfg.source != "gguf_package":
        return None
    try:
        return _gguf_source(cfg)[0]
    except Exception:  # noqa: BLE001 - a package that assembles its file: no name to copy, map it instead
        return None


def _body(parsed: cli.Parsed[GGUFOptions]) -> int:
    options = parsed.options
    assert options is not None
    if options.format != "gguf":
        raise UsageError(f"format={options.format!r}: this tool writes format=gguf")
    gguf_type = check_type(options.gguf_type)
    out = Path(options.out) if options.out else None
    if out is None or out.suffix != ".gguf":
        raise UsageError("out= is required and names a .gguf file, e.g. out=exports/smollm2_q8_0.gguf")
    if out.exists():
        raise UsageError(f"out={out} exists; choose a new file")
    given = [arg for arg in parsed.overrides if arg.split("=", 1)[0].lstrip("+~") == "quant"]
    if given and given[-1].split("=", 1)[-1] not in ("none", "external"):
        raise UsageError(f"format=gguf writes the reference's own weights and lets llama.cpp quantize them "
                         f"(gguf_type=); drop {given[-1]}")
    cfg = parsed.run
    if gguf_type not in WRITER_TYPES:
        llamacpp_python()  # refuse a missing llama.cpp before loading the model
    from harness.models.loading import load

    loaded = load(cfg.model, cfg.paths.cache_dir)
    check_architecture(loaded.model.config)
    out.parent.mkdir(parents=True, exist_ok=True)
    source = _source_gguf(cfg.model)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".gguf-") as tmp:
        plain = out if gguf_type in WRITER_TYPES else Path(tmp) / "f32.gguf"
        write_gguf(loaded.model, loaded.tokenizer, plain, dtype=gguf_type if gguf_type in WRITER_TYPES else "F32",
                   pre=options.gguf_pre, source_gguf=source, name=cfg.model.name)
        if gguf_type not in WRITER_TYPES:
            quantize(plain, out, gguf_type, options.threads)
    checked = ""
    try:
        check_tokens(out, loaded.tokenizer)
        checked = f"; llama.cpp's tokens equal the reference's on {len(PROBE_TEXTS)} probe texts"
    except UsageError:
        if gguf_type not in WRITER_TYPES:
            raise
        checked = "; tokens not checked (llama.cpp not installed: bash scripts/llamacpp_venv.sh)"
    except GGUFExportError:
        out.unlink(missing_ok=True)
        raise
    census = tensor_census(out)
    types = ", ".join(f"{count} {name}" for name, count in sorted(census["types"].items()))
    print(f"wrote {out} (GGUF {gguf_type}; tensors: {types}; {census['bits_per_weight']:.4f} bits/weight over the "
          f"2-D tensors){checked}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _body, argv)
