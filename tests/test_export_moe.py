"""Mixture-of-experts checkpoints: the harness's MoE schemes exported to compressed-tensors with one tensor set
per expert under the names vLLM and llm-compressor read, loaded back through transformers + compressed-tensors
with every expert matrix equal to the harness's simulation bit for bit, and external MoE checkpoints checked
against the reference (expert count and shapes) before anything is evaluated."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("compressed_tensors")

from harness import quant  # noqa: E402
from harness.checkpoint import candidate  # noqa: E402
from harness.checkpoint import export as export_mod  # noqa: E402
from harness.checkpoint.expert_layout import expert_checkpoint_names  # noqa: E402
from harness.checkpoint.expert_load import check_loaded_experts  # noqa: E402
from harness.config import QuantConfig, TensorQuantConfig, compose  # noqa: E402
from harness.quant import target_linears  # noqa: E402
from harness.quant.experts import UnfusedExperts, find_fused_experts  # noqa: E402
from moe_models import build, plain_expert_matrices  # noqa: E402

SCHEMES = {
    # W4A16: symmetric int4, one scale per 32 inputs (the tiny experts' matrices are 32 or 64 wide)
    "int4_g32": dict(weights=TensorQuantConfig(format="int", bits=4, granularity="group", group_size=32)),
    # W8A8 INT8: channel weights, dynamic per-token activations (experts stay unfused in the harness)
    "int8_w8a8": dict(weights=TensorQuantConfig(format="int", bits=8, granularity="channel"),
                      activations=TensorQuantConfig(format="int", bits=8, granularity="token", dynamic=True)),
    # FP8 W8A8 ("FP8_DYNAMIC")
    "fp8": dict(weights=TensorQuantConfig(format="fp8_e4m3", granularity="channel", scale_bits=32),
                activations=TensorQuantConfig(format="fp8_e4m3", granularity="token", dynamic=True, scale_bits=32)),
}
# what compressed-tensors stores for each (leaf → safetensors dtype), and its format name
STORED = {"int4_g32": ("pack-quantized", {"weight_packed": "I32", "weight_scale": "F32", "weight_shape": "I64"}),
          "int8_w8a8": ("int-quantized", {"weight": "I8", "weight_scale": "F32"}),
          "fp8": ("float-quantized", {"weight": "F8_E4M3", "weight_scale": "F32"})}
# the per-expert module names each family's hub checkpoints use (and vLLM's loaders read), written out by hand
NAMES = {"qwen3_moe": ("mlp", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
         "mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})}
EXPERTS = {"qwen3_moe": 8, "mixtral": 4}


def scheme(name: str) -> QuantConfig:
    return QuantConfig(name=name, **copy.deepcopy(SCHEMES[name]))


def _header(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    return candidate.stored_tensors(directory)


def _simulated(model: torch.nn.Module, model_type: str) -> dict[str, torch.Tensor]:
    """The harness's quantized expert matrices by harness name, cut by hand: from the fused parameters (weight-only
    schemes fuse the experts back), or the per-expert Linears an activation-quantized scheme leaves."""
    out = {}
    for layer, block in enumerate(model.model.layers):
        experts = block.mlp.experts
        for e in range(EXPERTS[model_type]):
            if isinstance(experts, UnfusedExperts):
                mats = {p: getattr(experts[e], p).weight.detach() for p in ("gate_proj", "up_proj", "down_proj")}
            else:
                mats = plain_expert_matrices(model_type, experts.gate_up_proj.detach(), experts.down_proj.detach(), e)
            out.update({f"model.layers.{layer}.mlp.experts.{e}.{p}": w for p, w in mats.items()})
    return out


def _export(model_type: str, name: str, out: Path, **build_args):
    model = build(model_type, **build_args)
    reference = copy.deepcopy(model)
    spec = scheme(name)
    quant.apply(model, spec)
    targets, kept = target_linears(model, spec)
    result = export_mod.export(model, None, spec, out, targets=targets, kept=kept)
    return model, reference, result


def test_expert_names_are_read_from_transformers_mapping():
    """Qwen3-MoE keeps gate_proj/up_proj/down_proj under mlp; Mixtral's hub names are block_sparse_moe and w1/w3/w2."""
    for model_type, (block, projections) in NAMES.items():
        names = expert_checkpoint_names(build(model_type))
        assert len(names) == 2 * EXPERTS[model_type] * 3
        for proj, stored in projections.items():
            assert names[f"model.layers.1.mlp.experts.3.{proj}"] == f"model.layers.1.{block}.experts.3.{stored}"


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("model_type", sorted(NAMES))
def test_moe_export_round_trip_is_exact_per_expert(model_type: str, name: str, tmp_path: Path):
    """Export → the checkpoint holds one tensor set per expert under the hub names (no fused tensor), routers dense
    and ignored → transformers + compressed-tensors load it, and every expert matrix equals the harness's own."""
    from transformers import AutoModelForCausalLM

    model, reference, result = _export(model_type, name, tmp_path / "ct")
    fmt, leaves = STORED[name]
    assert result.format == fmt and result.max_abs_weight_error == 0.0
    block, projections = NAMES[model_type]
    stored = _header(tmp_path / "ct")
    assert not [key for key in stored if "gate_up_proj" in key or key.endswith("experts.down_proj")]
    simulated = _simulated(model, model_type)
    assert len(simulated) == len(result.expert_names) == 2 * EXPERTS[model_type] * 3
    for harness_name, weight in simulated.items():
        layer, e, proj = harness_name.split(".")[2], harness_name.split(".")[5], harness_name.split(".")[6]
        saved = f"model.layers.{layer}.{block}.experts.{e}.{projections[proj]}"
        assert result.expert_names[harness_name] == saved
        for leaf, dtype in leaves.items():
            assert stored[f"{saved}.{leaf}"][1] == dtype, (saved, leaf)
        if "weight" in leaves:
            assert stored[f"{saved}.weight"][0] == tuple(weight.shape)
    ignore = result.quantization_config["ignore"]
    for layer in range(2):
        router = f"model.layers.{layer}.{block}.gate"
        assert stored[f"{router}.weight"] == ((EXPERTS[model_type], 64), "F32") and router in ignore
    assert "lm_head" in ignore
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    if name == "int8_w8a8":  # transformers 5.25's expert conversion reads no int8 weight and gives up
        with pytest.raises(RuntimeError, match="conversion of the weights"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32)
        loaded = export_mod.load_compressed(tmp_path / "ct", model)  # compressed-tensors' own load path
    else:  # through transformers, as a candidate is loaded: experts decompressed and fused on load
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = loaded(ids).logits  # compressed-tensors decompresses the dense linears on the first forward
    # each expert decompressed once more by compressed-tensors' own decompressor, as candidate.load does
    library = check_loaded_experts(loaded, tmp_path / "ct")
    assert library.matrices == len(simulated) and library.rewritten == []
    fused = find_fused_experts(loaded)
    for harness_name, weight in simulated.items():
        prefix, e, proj = harness_name.rsplit(".", 2)
        got = fused[prefix].matrix(int(e), proj)
        assert torch.equal(got, weight), harness_name
        original = plain_expert_matrices(model_type, reference.get_submodule(prefix).gate_up_proj.detach(),
                                         reference.get_submodule(prefix).down_proj.detach(), int(e))[proj]
        assert not torch.equal(got, original)  # really quantized
    targets, _ = target_linears(model, scheme(name))
    modules = dict(loaded.named_modules())
    for linear, module in targets.items():
        if linear not in simulated:
            assert torch.equal(modules[linear].weight, module.weight), linear
    if name == "int4_g32":  # weight-only: the loaded model computes exactly what the harness simulated
        with torch.no_grad():
            assert torch.equal(theirs, model(ids).logits)
            assert torch.equal(loaded(ids).logits, theirs)


def test_an_int4_moe_export_counts_bits_as_written(tmp_path: Path):
    """Bits per weight as written, by hand: int32-packed 4-bit codes, an fp32 scale per 32 and an int64 [2]
    weight_shape per stored matrix (attention and every expert); routers at 16 bits."""
    model, _, result = _export("qwen3_moe", "int4_g32", tmp_path / "ct")
    matrices = 2 * (2 * [(64, 64)] + 2 * [(32, 64)] + 8 * [(32, 64), (32, 64), (64, 32)])  # q o k v, experts
    quantized = sum(o * i for o, i in matrices)
    stored = sum(4 * o * i + 32 * o * i // 32 + 64 * 2 for o, i in matrices)
    routers = 2 * 8 * 64
    assert result.bits_per_weight == pytest.approx((stored + 16 * routers) / (quantized + routers), rel=1e-12)


# ------------------------------------------------------------------------------ external MoE candidates
def _tokenizer(directory: Path):
    """A 256-token word-level tokenizer (the tiny models' vocabulary), saved where transformers finds it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(256)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="t1", eos_token="t2", pad_token="t3",
                                        unk_token="t0")
    tokenizer.save_pretrained(directory)
    return tokenizer


@pytest.fixture(scope="module")
def moe_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_candidate")
    model, reference, result = _export("qwen3_moe", "int4_g32", root / "ct")
    tokenizer = _tokenizer(root / "ct")
    cfg = OmegaConf.to_object(compose(["model=tiny_random", f"paths.cache_dir={root / 'cache'}"]))
    return model, reference, result, tokenizer, cfg, root


def _load(path: Path, moe_export):
    _, reference, _, tokenizer, cfg, _ = moe_export
    return candidate.load(candidate.CandidateConfig(path=str(path)), cfg.model, cfg.paths.cache_dir,
                          reference_model=reference, reference_tokenizer=tokenizer)


def test_a_moe_export_loads_as_a_candidate_with_its_experts_counted(moe_export):
    model, reference, result, _, _, root = moe_export
    loaded, described = _load(root / "ct", moe_export)
    for name, weight in _simulated(model, "qwen3_moe").items():
        prefix, e, proj = name.rsplit(".", 2)
        assert torch.equal(find_fused_experts(loaded.model)[prefix].matrix(int(e), proj), weight), name
    report = candidate.weight_report(reference, loaded.model, described, sum(p.numel() for p in reference.parameters()))
    assert len(report.layers) == 2 * 4 + 2 * 8 * 3  # q k v o per layer, every expert's gate, up and down
    assert "model.layers.1.mlp.experts.7.down_proj" in {layer.name for layer in report.layers}
    account = report.coverage.to_dict()
    attention = 2 * (2 * 64 * 64 + 2 * 32 * 64)
    experts = 2 * 8 * 3 * 32 * 64
    assert account["uncovered_params"] == 0 and account["quantized_params"] == attention + experts
    assert account["kept_by_rule"]["router"] == 2 * 8 * 64 and "output_head" in account["kept_by_rule"]
    summary = report.summary()
    assert summary["bits_per_weight"] == pytest.approx(result.bits_per_weight, rel=1e-12)


def test_a_checkpoint_with_dense_experts_is_counted_as_the_checkpoint_keeps_them(moe_export, tmp_path):
    """The coverage account reads what the checkpoint stores: experts stored dense are kept (by its targets)."""
    _, reference, _, _, _, _ = moe_export
    described = candidate.CandidateScheme(name="attention_only", method="compressed-tensors", bits=4, group_size=32,
                                          symmetric=True, format="pack-quantized", kept=["lm_head"],
                                          details={"weight_type": "int", "strategy": "group"})
    names = expert_checkpoint_names(reference)
    described.tensors = {f"model.layers.{i}.self_attn.{p}.weight_packed": ((64, 8), "I32")
                         for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    described.tensors.update({f"{saved}.weight": ((32, 64), "F32") for saved in names.values()})
    account = candidate.candidate_coverage(reference, described).to_dict()
    assert account["quantized_params"] == 2 * (2 * 64 * 64 + 2 * 32 * 64)
    assert account["kept_by_rule"]["checkpoint.targets"] == 2 * 8 * 3 * 32 * 64
    assert account["uncovered_params"] == 0


def _copy(root: Path, name: str) -> Path:
    target = root.parent / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(root, target)
    return target


def test_a_wrong_expert_count_in_the_config_is_refused_in_one_line_before_loading(moe_export):
    _, _, _, _, _, root = moe_export
    wrong = _copy(root / "ct", "six_experts")
    config = json.loads((wrong / "config.json").read_text())
    config["num_local_experts" if "num_local_experts" in config else "num_experts"] = 6
    (wrong / "config.json").write_text(json.dumps(config))
    for weights in wrong.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")  # the check comes before any weight is read
    with pytest.raises(candidate.CandidateError) as info:
        _load(wrong, moe_export)
    message = str(info.value)
    assert "\n" not in message and "'six_experts' is not a quantization of reference 'tiny_random'" in message
    assert "experts 6 vs 8" in message and "Fix: pick the reference model" in message


def test_a_checkpoint_storing_fewer_experts_than_its_config_says_is_refused_before_loading(moe_export):
    from safetensors.torch import load_file, save_file

    _, _, _, _, _, root = moe_export
    fewer = _copy(root / "ct", "fewer_experts")
    for path in fewer.glob("*.safetensors"):
        state = load_file(path)
        state = {k: v for k, v in state.items() if not any(f".experts.{e}." in k for e in (6, 7))}
        save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(candidate.CandidateError) as info:
        _load(fewer, moe_export)
    message = str(info.value)
    assert "\n" not in message
    assert "it stores 6 experts in model.layers.0.mlp.experts (indices 0..5), the reference 8" in message


def test_a_dense_candidate_against_a_moe_reference_is_refused():
    dense = build("qwen3_moe").config.to_dict()
    other = {k: v for k, v in dense.items() if k not in candidate.EXPERT_COUNT_FIELDS}
    with pytest.raises(candidate.CandidateError, match="experts none vs 8"):
        candidate.check_architecture(dense, other, name="dense", reference_name="moe")


def test_gptq_awq_and_int8_w8a8_checkpoints_of_a_moe_are_refused_in_one_line():
    reference = build("mixtral")
    for method in ("gptq", "awq"):
        with pytest.raises(candidate.CandidateError, match=f"is a {method} checkpoint of a mixture-of-experts"):
            candidate.check_moe_loadable(candidate.CandidateScheme(name="x", method=method, bits=4), reference)
    w8a8 = candidate.CandidateScheme(name="x", method="compressed-tensors", bits=8, format="int-quantized")
    with pytest.raises(candidate.CandidateError, match="int-quantized.*transformers.*cannot load") as info:
        candidate.check_moe_loadable(w8a8, reference)
    assert "\n" not in str(info.value)
    asym = candidate.CandidateScheme(name="x", method="compressed-tensors", bits=4, symmetric=False,
                                     format="pack-quantized")
    with pytest.raises(candidate.CandidateError, match="pack-quantized asymmetric.*no zero point"):
        candidate.check_moe_loadable(asym, reference)
    candidate.check_moe_loadable(candidate.CandidateScheme(name="x", method="gptq", bits=4), build("gpt2"))


def test_a_group_size_that_splits_an_expert_matrix_is_refused_before_quantizing():
    from harness.quant.experts import expert_shapes

    spec = QuantConfig(name="int4_g64", weights=TensorQuantConfig(format="int", bits=4, granularity="group",
                                                                  group_size=64))
    model = build("qwen3_moe")
    targets, _ = target_linears(model, spec)
    with pytest.raises(export_mod.ExportError, match=r"leaves a shorter last group in 16 of 56 linears \(input sizes "
                                                      r"\[32\], e.g. model.layers.0.mlp.experts.0.down_proj.*Fix: "
                                                      r"quant.weights.group_size=32"):
        export_mod.check_whole_groups(targets, spec, expert_shapes(model, spec))


def test_nvfp4_moe_candidate_experts_are_the_librarys_not_transformers(tmp_path: Path):
    """transformers 5.25 loads NVFP4 experts without their global scale (values off by orders of magnitude);
    the candidate loader decompresses each expert with compressed-tensors and uses that, saying so."""
    spec = QuantConfig(name="nvfp4_w4a16", weights=TensorQuantConfig(format="nvfp4", granularity="group",
                                                                     group_size=16))
    model = build("qwen3_moe").to(torch.bfloat16)
    reference = copy.deepcopy(model)
    quant.apply(model, spec)
    targets, kept = target_linears(model, spec)
    result = export_mod.export(model, None, spec, tmp_path / "ct", targets=targets, kept=kept)
    assert result.format == "nvfp4-pack-quantized" and result.max_abs_weight_error == 0.0
    tokenizer = _tokenizer(tmp_path / "ct")
    cfg = OmegaConf.to_object(compose(["model=tiny_random", "model.dtype=bfloat16",
                                       f"paths.cache_dir={tmp_path / 'cache'}"]))
    loaded, described = candidate.load(candidate.CandidateConfig(path=str(tmp_path / "ct")), cfg.model,
                                       cfg.paths.cache_dir, reference_model=reference, reference_tokenizer=tokenizer)
    assert described.details["experts_from_library"]["rewritten"] == 2 * 8 * 3
    for name, weight in _simulated(model, "qwen3_moe").items():
        prefix, e, proj = name.rsplit(".", 2)
        assert torch.equal(find_fused_experts(loaded.model)[prefix].matrix(int(e), proj), weight), name
    report = candidate.weight_report(reference, loaded.model, described, sum(p.numel() for p in reference.parameters()))
    assert any("compressed-tensors decompresses them" in note for note in report.notes)


def test_mixtral_experts_named_as_llm_compressor_writes_them_load_through_compressed_tensors(tmp_path: Path):
    """llm-compressor 0.14 (on transformers 5.17) writes Mixtral's experts as ``block_sparse_moe.experts.<e>.gate_proj``
    / ``up_proj`` / ``down_proj`` (seen on its own output for this tiny model), not the ``w1`` / ``w3`` / ``w2`` that
    transformers fuses: transformers leaves those experts at their random initialisation, and the candidate loader
    reads them through compressed-tensors under that name instead."""
    from safetensors.torch import load_file, save_file

    model, reference, _ = _export("mixtral", "int4_g32", tmp_path / "ct")
    renames = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
    for path in (tmp_path / "ct").glob("*.safetensors"):
        state = load_file(path)
        renamed = {}
        for key, value in state.items():
            for old, new in renames.items():
                key = key.replace(old, new) if ".experts." in key else key
            renamed[key] = value
        assert any(".experts.0.gate_proj.weight_packed" in key for key in renamed)
        save_file(renamed, path, metadata={"format": "pt"})
    tokenizer = _tokenizer(tmp_path / "ct")
    cfg = OmegaConf.to_object(compose(["model=tiny_random", f"paths.cache_dir={tmp_path / 'cache'}"]))
    loaded, described = candidate.load(candidate.CandidateConfig(path=str(tmp_path / "ct")), cfg.model,
                                       cfg.paths.cache_dir, reference_model=reference, reference_tokenizer=tokenizer)
    assert described.details["experts_from_library"]["rewritten"] == 2 * 4 * 3
    for name, weight in _simulated(model, "mixtral").items():
        prefix, e, proj = name.rsplit(".", 2)
        assert torch.equal(find_fused_experts(loaded.model)[prefix].matrix(int(e), proj), weight), name
    report = candidate.weight_report(reference, loaded.model, described, sum(p.numel() for p in reference.parameters()))
    assert report.coverage.to_dict()["uncovered_params"] == 0
    assert report.coverage.to_dict()["quantized_params"] == 2 * (2 * 64 * 64 + 2 * 32 * 64 + 4 * 3 * 128 * 64)
