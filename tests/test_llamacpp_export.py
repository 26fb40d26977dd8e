"""The GGUF writer (``python -m harness.export format=gguf``) against an independent reader: transformers' own GGUF
loader (``from_pretrained(dir, gguf_file=...)``, which undoes llama.cpp's q/k layout itself) must give back the
source model's logits and tokens exactly. Runs without llama.cpp (the F32 file is the writer's alone); what needs
llama.cpp's quantizer and server is tests/test_llamacpp.py."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harness.checkpoint import export_gguf
from harness.cli import compose_run
from harness.export import main as export_main

TEXTS = export_gguf.PROBE_TEXTS + ["The quick brown fox jumps over the lazy dog. 1234567890 !@#$%^&*()"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, shared_model_cache):
    """The tiny random llama as the harness loads it (SmolLM2's tokenizer), and its F32 GGUF."""
    from harness.models.loading import load

    root = tmp_path_factory.mktemp("gguf")
    (root / "cache").mkdir()
    (root / "cache" / "models").symlink_to(shared_model_cache)
    cfg = compose_run(["model=tiny_random", f"paths.cache_dir={root / 'cache'}"])
    loaded = load(cfg.model, cfg.paths.cache_dir)
    path = export_gguf.write_gguf(loaded.model, loaded.tokenizer, root / "tiny_f32.gguf", dtype="F32",
                                  source_gguf=export_gguf._source_gguf(cfg.model), name="tiny")
    return loaded, path


def test_the_f32_gguf_loads_back_in_transformers_with_the_same_logits_and_tokens(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded, path = tiny
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == loaded.tokenizer(text)["input_ids"], text
    ids = torch.tensor([loaded.tokenizer(" ".join(TEXTS))["input_ids"]])
    with torch.no_grad():
        ours, theirs = loaded.model(ids).logits, model.eval()(ids).logits
    assert ours.shape == theirs.shape and ours.abs().max() > 1.0  # a real, peaked distribution
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)  # the same float32 weights, the same graph
    assert tokenizer.chat_template == loaded.tokenizer.chat_template


def test_the_gguf_metadata_is_the_models_config(tiny):
    import gguf

    loaded, path = tiny
    reader = gguf.GGUFReader(str(path))
    config = loaded.model.config

    def field(name):
        return reader.fields[name].contents()

    assert field("general.architecture") == "llama"
    assert field("llama.block_count") == config.num_hidden_layers
    assert field("llama.attention.head_count_kv") == config.num_key_value_heads
    assert field("llama.rope.dimension_count") == config.hidden_size // config.num_attention_heads
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "smollm"  # the source GGUF's
    assert len(field("tokenizer.ggml.tokens")) == config.vocab_size
    assert field("tokenizer.ggml.bos_token_id") == loaded.tokenizer.bos_token_id
    names = {tensor.name for tensor in reader.tensors}
    assert "output.weight" in names  # tie_word_embeddings=False: the head is its own tensor
    assert len(names) == 2 + 1 + 9 * config.num_hidden_layers  # embed, output norm, head; 9 per block


def test_rope_interleave_is_llamacpps_pair_order_by_hand():
    # one head of 4 rows (rotate-half pairs (0,2), (1,3)) -> llama.cpp's adjacent pairs: rows 0, 2, 1, 3
    weight = np.arange(8, dtype=np.float32).reshape(4, 2)
    assert export_gguf.rope_interleave(weight, 1)[:, 0].tolist() == [0, 4, 2, 6]
    # two heads of 4 rows each: the order is kept per head
    weight = np.arange(8, dtype=np.float32).reshape(8, 1)
    assert export_gguf.rope_interleave(weight, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize("config, words", [
    (SimpleNamespace(model_type="qwen3"), "'qwen3'"),
    (SimpleNamespace(model_type="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), "'llama3'"),
    (SimpleNamespace(model_type="llama", attention_bias=True), "biases"),
])
def test_an_architecture_the_writer_does_not_map_is_refused_in_one_line(config, words):
    with pytest.raises(export_gguf.GGUFExportError) as caught:
        export_gguf.check_architecture(config)
    assert words in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("args, words", [
    (["gguf_type=Q9_9", "out=x.gguf"], "gguf_type='Q9_9' is not a GGUF type"),
    (["gguf_type=Q8_0", "out=x.safetensors"], "names a .gguf file"),
    (["gguf_type=Q8_0", "out=x.gguf", "quant=int8"], "drop quant=int8"),
])
def test_bad_options_are_refused_before_the_model_loads(args, words, capsys, monkeypatch):
    import harness.models.loading as loading

    monkeypatch.setattr(loading, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert export_main(["format=gguf", "model=tiny_random", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
