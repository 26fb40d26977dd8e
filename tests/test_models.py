"""Model sources and the dequantized-weight cache."""
from __future__ import annotations

import time

import pytest
import torch

from harness.models import loading as models
from harness.config import load_model_config


@pytest.mark.slow
def test_tiny_random_is_a_pure_function_of_its_seed(shared_model_cache, tmp_path):
    (tmp_path / "models").symlink_to(shared_model_cache)
    cfg = load_model_config("tiny_random")
    a = models.load(cfg, tmp_path)
    b = models.load(cfg, tmp_path)
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), name
    cfg.tiny.seed = 1
    c = models.load(cfg, tmp_path)
    assert not torch.equal(next(a.model.parameters()), next(c.model.parameters()))
    assert a.key == b.key != c.key


@pytest.mark.slow
def test_dtype_and_device_come_from_config(shared_model_cache, tmp_path):
    (tmp_path / "models").symlink_to(shared_model_cache)
    cfg = load_model_config("tiny_random")
    cfg.dtype = "bfloat16"
    loaded = models.load(cfg, tmp_path)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(models.ModelLoadError, match="not one of"):
        cfg.dtype = "float13"
        models.load(cfg, tmp_path)


@pytest.mark.slow
def test_gguf_is_dequantized_once_then_loaded_from_the_cache(tmp_path):
    """Cold load dequantizes the packaged GGUF; the warm load reads safetensors and matches."""
    cfg = load_model_config("smollm2_135m")
    start = time.perf_counter()
    cold = models.load(cfg, tmp_path)
    cold_s = time.perf_counter() - start
    assert "dequantize_gguf_s" in cold.timings
    entries = list((tmp_path / "models").iterdir())
    assert any((e / "COMPLETE").exists() and (e / "model.safetensors").exists() for e in entries)
    start = time.perf_counter()
    warm = models.load(cfg, tmp_path)
    warm_s = time.perf_counter() - start
    assert "dequantize_gguf_s" not in warm.timings
    assert warm_s < cold_s
    ids = cold.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    assert torch.equal(ids, warm.tokenizer("The capital of France is", return_tensors="pt")["input_ids"])
    with torch.no_grad():
        assert torch.equal(cold.model(ids).logits, warm.model(ids).logits)
    assert cold.identity["sha256"] == warm.identity["sha256"]


@pytest.mark.slow
def test_a_cold_gguf_load_parses_the_file_once_and_equals_transformers_own_load(tmp_path, monkeypatch):
    """transformers parses a GGUF for the config, the weights and the tokenizer; the cold load memoizes the
    parse (models.gguf_parsed_once): one parse, and the same weights and token ids as transformers' own
    unmemoized load, which parses the file again after the block (the memo ends with it)."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parses = []
    reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *args, **kwargs: parses.append(str(path))
                        or reader(path, *args, **kwargs))
    cfg = load_model_config("smollm2_135m")
    cold = models.load(cfg, tmp_path)
    assert "dequantize_gguf_s" in cold.timings
    assert len(parses) == 1, parses
    path, _ = models._gguf_source(cfg)
    own = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    own_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert len(parses) >= 3  # outside the block every read parses again
    ours, theirs = cold.model.state_dict(), own.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    text = "Déjà vu: 12,345 naïve cafés — 東京 🚀\n\tdef f(x): return x**2"
    assert cold.tokenizer(text)["input_ids"] == own_tokenizer(text)["input_ids"]
    assert gguf.get_tensor_name_map.__name__ == "get_tensor_name_map"  # the block restored it


@pytest.mark.slow
def test_gemma_package_loads_through_the_same_path(shared_model_cache, tmp_path):
    (tmp_path / "models").symlink_to(shared_model_cache)
    loaded = models.load(load_model_config("gemma3_270m"), tmp_path)
    ids = loaded.tokenizer("Bonjour, je m'appelle", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = loaded.model(ids).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] >= 262_000


@pytest.mark.slow
def test_a_gguf_tokenizer_is_built_once_then_read_from_its_cache_entry(tmp_path, monkeypatch):
    """Without the model's entry (tiny_random borrows SmolLM2's tokenizer) the tokenizer is rebuilt
    from the GGUF's metadata once, saved to its own entry, and read from there after: same ids,
    same chat markup, and no second pass over the GGUF."""
    from transformers import AutoTokenizer

    from harness.infra.cache import Cache

    cfg = load_model_config("smollm2_135m")
    cache = Cache(tmp_path)
    built = models.load_tokenizer(cfg, cache)
    [entry] = [e for e in (tmp_path / "models").iterdir() if e.is_dir()]
    assert entry.name.endswith("-tokenizer") and (entry / "COMPLETE").exists()
    assert not list(entry.glob("*.safetensors"))
    calls = []
    original = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda *args, **kwargs: calls.append(kwargs) or original(*args, **kwargs))
    cached = models.load_tokenizer(cfg, cache)
    assert calls == [{}]  # the saved files, not gguf_file=...
    text = "Déjà vu: 12,345 naïve cafés — 東京 🚀\n\tdef f(x): return x**2"
    assert built(text)["input_ids"] == cached(text)["input_ids"]
    chat = [{"role": "user", "content": text}]
    assert (built.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == cached.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert (built.eos_token_id, built.pad_token_id, len(built)) == (cached.eos_token_id, cached.pad_token_id,
                                                                   len(cached))
