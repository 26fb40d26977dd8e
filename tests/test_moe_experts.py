"""Fused mixture-of-experts experts (issue 33): found in every family, quantized per expert exactly as the
same matrix would be as a Linear, routers kept unless asked, shared experts and dense layers handled."""
from __future__ import annotations

import copy

import pytest
import torch

from harness import quant
from harness.config import QuantConfig, TensorQuantConfig
from harness.quant.experts import (MoEQuantConfig, UnfusedExperts, find_fused_experts, find_routers, fuse_experts,
                                   unfuse_experts)
from harness.quant.format_table import fake_quantize
from moe_models import MOE_TYPES, build, plain_expert_matrices

SPECS = {
    "int4_g32": TensorQuantConfig(format="int", bits=4, granularity="group", group_size=32),
    "int4_g32_asym": TensorQuantConfig(format="int", bits=4, symmetric=False, granularity="group", group_size=32),
    "int8_tensor": TensorQuantConfig(format="int", bits=8, granularity="tensor"),
    "fp8_channel": TensorQuantConfig(format="fp8_e4m3", granularity="channel", scale_bits=32),
    "nvfp4": TensorQuantConfig(format="nvfp4", granularity="group", group_size=16),
    "mxfp4": TensorQuantConfig(format="mxfp4", granularity="group", group_size=32),
}


def scheme(name: str, **kwargs) -> QuantConfig:
    return QuantConfig(name=name, weights=copy.deepcopy(SPECS[name]), **kwargs)


def tokens(count: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (count, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_every_family_is_found_with_its_router(model_type: str) -> None:
    model = build(model_type)
    found = find_fused_experts(model)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert sorted(found) == [f"model.layers.{i}.mlp.experts" for i in moe_layers] and found
    for name, fused in found.items():
        assert fused.router == name.rsplit(".", 1)[0] + (".router" if model_type == "gpt_oss" else ".gate")
        assert fused.num_experts == fused.module.down_proj.shape[0]
        assert fused.router in find_routers(model)


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_unfused_forward_matches_and_fusing_back_is_exact(model_type: str) -> None:
    model = build(model_type)
    x = tokens()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        reference = model(x).logits
        state = unfuse_experts(model)
        assert any(isinstance(m, UnfusedExperts) for m in model.modules())
        unfused_logits = model(x).logits
        assert fuse_experts(model, state) == len(find_fused_experts(model))
        fused_again = model(x).logits
    torch.testing.assert_close(unfused_logits, reference, rtol=1e-5, atol=1e-5)  # summation order differs
    assert torch.equal(fused_again, reference)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def _expert_plain(model: torch.nn.Module, model_type: str, name: str, expert: int) -> dict[str, torch.Tensor]:
    module = model.get_submodule(name)
    return plain_expert_matrices(model_type, module.gate_up_proj.detach(), module.down_proj.detach(), expert)


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_rtn_per_expert_equals_a_plain_loop(model_type: str, spec_name: str) -> None:
    """Each expert's gate, up and down matrix, cut by hand from the fused parameters, equals fake_quantize of
    the same plain matrix (as a Linear would be quantized); attention linears as before; routers untouched."""
    model = build(model_type)
    original = copy.deepcopy(model)
    report = quant.apply(model, scheme(spec_name))
    spec = SPECS[spec_name]
    fused = find_fused_experts(model)
    assert fused and not any(isinstance(m, UnfusedExperts) for m in model.modules())
    for name, info in fused.items():
        for e in range(info.num_experts):
            done, before = _expert_plain(model, model_type, name, e), _expert_plain(original, model_type, name, e)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert torch.equal(done[proj], fake_quantize(before[proj].contiguous(), spec)), (name, e, proj)
        router = info.router
        assert torch.equal(model.get_submodule(router).weight, original.get_submodule(router).weight)
    q = original.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, fake_quantize(q, spec))
    names = {layer.name for layer in report.layers}
    assert f"model.layers.0.mlp.experts.1.down_proj" in names
    if model_type != "gpt_oss":  # gpt-oss's expert biases are kept, by the bias rule
        assert report.coverage.uncovered_params == 0


def test_bf16_experts_quantize_as_bf16_linears() -> None:
    model = build("qwen3_moe").to(torch.bfloat16)
    original = copy.deepcopy(model)
    quant.apply(model, scheme("int4_g32"))
    name = "model.layers.1.mlp.experts"
    for e in range(8):
        done, before = _expert_plain(model, "qwen3_moe", name, e), _expert_plain(original, "qwen3_moe", name, e)
        for proj, matrix in before.items():
            assert done[proj].dtype == torch.bfloat16
            assert torch.equal(done[proj], fake_quantize(matrix.contiguous(), SPECS["int4_g32"]))


def test_router_option_quantizes_the_router_as_a_linear() -> None:
    model = build("qwen3_moe")
    router = model.model.layers[0].mlp.gate.weight.detach().clone()
    quant.apply(model, scheme("int4_g32", moe=MoEQuantConfig(quantize_router=True)))
    assert torch.equal(model.model.layers[0].mlp.gate.weight, fake_quantize(router, SPECS["int4_g32"]))


def test_shared_expert_and_dense_layers_are_quantized_and_the_shared_gate_kept() -> None:
    model = build("qwen2_moe")
    original = copy.deepcopy(model)
    report = quant.apply(model, scheme("int4_g32"))
    mlp, before = model.model.layers[0].mlp, original.model.layers[0].mlp
    assert torch.equal(mlp.shared_expert.up_proj.weight, fake_quantize(before.shared_expert.up_proj.weight,
                                                                       SPECS["int4_g32"]))
    assert torch.equal(mlp.shared_expert_gate.weight, before.shared_expert_gate.weight)
    assert report.coverage.kept_by_rule()["router"] == sum(
        m.weight.numel() for n, m in original.named_modules() if n.endswith(("mlp.gate", "shared_expert_gate")))
    deepseek = build("deepseek_v3", kv_lora_rank=32)
    dense = deepseek.model.layers[0].mlp.up_proj.weight.detach().clone()
    quant.apply(deepseek, scheme("int4_g32"))
    assert torch.equal(deepseek.model.layers[0].mlp.up_proj.weight, fake_quantize(dense, SPECS["int4_g32"]))


def test_w8a8_keeps_experts_unfused_with_quantized_inputs() -> None:
    """With activation quantization the experts stay as per-expert Linears that quantize their inputs."""
    from harness.quant.linear import ActQuantLinear

    model = build("mixtral")
    x = tokens()
    with torch.no_grad():
        reference = model(x).logits
    fp8 = QuantConfig(name="fp8", weights=copy.deepcopy(SPECS["fp8_channel"]),
                      activations=TensorQuantConfig(format="fp8_e4m3", granularity="token", dynamic=True,
                                                    scale_bits=32))
    quant.apply(model, fp8)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, UnfusedExperts) and isinstance(experts[0].down_proj, ActQuantLinear)
    with torch.no_grad():
        logits = model(x).logits
    assert torch.isfinite(logits).all() and not torch.equal(logits, reference)
