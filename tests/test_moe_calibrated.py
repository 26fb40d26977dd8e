"""GPTQ and AWQ per expert (issue 33): statistics from the tokens the router sends to each expert, checked
against Hessians and means computed independently from a plain forward's routed tokens."""
from __future__ import annotations

import copy

import pytest
import torch

from harness.config import QuantConfig, TensorQuantConfig
from harness.quant import gptq
from harness.quant import QuantReport
from harness.quant.awq import AWQSettings, candidate_scales, quantize_awq
from harness.quant.experts import MoEQuantConfig, fuse_experts, unfuse_experts
from harness.quant.gptq import gptq_quantize_weight, quantize_gptq
from harness.quant.format_table import fake_quantize
from moe_models import build, plain_expert_matrices

SPEC = TensorQuantConfig(format="int", bits=4, granularity="group", group_size=32)
EXPERTS = "model.layers.0.mlp.experts"


def calibration(count: int = 4, length: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (count, length), generator=torch.Generator().manual_seed(7))


def scheme(method: str, **moe) -> QuantConfig:
    settings = {"clip": False, "search_samples": 0} if method == "awq" else {}
    return QuantConfig(name=f"{method}_w4g32", method=method, weights=copy.deepcopy(SPEC), targets=["*experts*"],
                       settings=settings, moe=MoEQuantConfig(**moe))


@torch.no_grad()
def routed_inputs(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's experts input [N, H] and top-k selections [N, k] in a plain full-precision forward."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    module = model.get_submodule(EXPERTS)
    hook = module.register_forward_pre_hook(lambda _m, args: seen.append((args[0].clone(), args[1].clone())))
    try:
        model(tokens, use_cache=False)
    finally:
        hook.remove()
    return torch.cat([s[0] for s in seen]), torch.cat([s[1] for s in seen])


def hessian(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return (2.0 / len(x) * x.t() @ x).float()


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())


@pytest.mark.parametrize("all_tokens", [False, True])
def test_gptq_per_expert_hessians_and_results_equal_an_independent_loop(monkeypatch, all_tokens: bool) -> None:
    model = build("qwen3_moe")
    original = copy.deepcopy(model)
    tokens = calibration()
    x, chosen = routed_inputs(original, tokens)
    used: dict[tuple[str, ...], torch.Tensor] = {}
    solve = gptq._solve_stage

    def recording(prefix, names, modules, h, spec, settings):
        used[tuple(f"{prefix}.{n}" for n in names)] = h.clone()
        return solve(prefix, names, modules, h, spec, settings)

    monkeypatch.setattr(gptq, "_solve_stage", recording)
    report = QuantReport(scheme="gptq", method="gptq")
    state = unfuse_experts(model, all_tokens=all_tokens)
    quantize_gptq(model, scheme("gptq", calibrate_all_experts=all_tokens, min_tokens=1), tokens, "cpu", report,
                  batch_size=2)
    fuse_experts(model, state)
    module, before = model.get_submodule(EXPERTS), original.get_submodule(EXPERTS)
    for e in range(8):
        rows = x if all_tokens else x[(chosen == e).any(dim=1)]
        done = plain_expert_matrices("qwen3_moe", module.gate_up_proj, module.down_proj, e)
        plain = plain_expert_matrices("qwen3_moe", before.gate_up_proj, before.down_proj, e)
        key = (f"{EXPERTS}.{e}.gate_proj", f"{EXPERTS}.{e}.up_proj")
        torch.testing.assert_close(used[key], hessian(rows), rtol=1e-5, atol=1e-6)
        stacked = torch.cat([plain["gate_proj"], plain["up_proj"]])
        expected = gptq_quantize_weight(stacked, hessian(rows), SPEC).quantized
        torch.testing.assert_close(torch.cat([done["gate_proj"], done["up_proj"]]), expected, rtol=1e-5, atol=1e-6)
        # down reads act(gate x) * up x through the already quantized gate/up, on the same tokens
        h = swiglu(rows, done["gate_proj"], done["up_proj"])
        torch.testing.assert_close(used[(f"{EXPERTS}.{e}.down_proj",)], hessian(h), rtol=1e-4, atol=1e-6)
    assert not any("fewer than" in note for note in report.notes)


def test_gptq_experts_with_too_few_tokens_fall_back_to_rtn_and_are_counted() -> None:
    model = build("qwen3_moe")
    original = copy.deepcopy(model)
    tokens = calibration(2, 16)
    _x, chosen = routed_inputs(original, tokens)
    counts = [int((chosen == e).any(dim=1).sum()) for e in range(8)]
    threshold = sorted(counts)[4]  # about half the experts fall below it
    report = QuantReport(scheme="gptq", method="gptq")
    state = unfuse_experts(model)
    quantize_gptq(model, scheme("gptq", min_tokens=threshold), tokens, "cpu", report, batch_size=2)
    fuse_experts(model, state)
    module, before = model.get_submodule(EXPERTS), original.get_submodule(EXPERTS)
    few = [e for e in range(8) if counts[e] < threshold]
    assert few
    for e in few:
        done = plain_expert_matrices("qwen3_moe", module.gate_up_proj, module.down_proj, e)
        plain = plain_expert_matrices("qwen3_moe", before.gate_up_proj, before.down_proj, e)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(done[proj], fake_quantize(plain[proj].contiguous(), SPEC))
    assert report.moe["fallback_experts"] >= len(few)  # counted per layer and expert, both layers


def test_awq_folds_exactly_and_expert_scales_come_from_routed_tokens() -> None:
    model = build("qwen3_moe")
    original = copy.deepcopy(model)
    tokens = calibration()
    x, chosen = routed_inputs(original, tokens)
    with torch.no_grad():
        reference = original(tokens).logits
    state = unfuse_experts(model)
    outcome = quantize_awq(model, scheme("awq", min_tokens=1), tokens, "cpu", QuantReport("awq", "awq"),
                           batch_size=2, search_samples=0, apply_quantization=False)
    with torch.no_grad():
        folded = model(tokens).logits
    fuse_experts(model, state)
    torch.testing.assert_close(folded, reference, rtol=1e-4, atol=1e-4)  # scales folded into norm, router, experts
    before = original.get_submodule(EXPERTS)
    for e in range(8):
        rows = x[(chosen == e).any(dim=1)]
        plain = plain_expert_matrices("qwen3_moe", before.gate_up_proj, before.down_proj, e)
        # the router and the norm were scaled by the shared group's scales first: undo that on the inputs
        norm_scales = outcome.input_scales[f"{EXPERTS}.{e}.gate_proj"]
        h = swiglu(rows, plain["gate_proj"], plain["up_proj"])
        ratio = outcome.ratios[f"{EXPERTS}.{e}.up_proj"]
        w_mean = None
        if AWQSettings().duo_scaling:
            from harness.quant.awq import weight_mean
            w_mean = weight_mean([plain["down_proj"]], SPEC)
        expected = candidate_scales(h.abs().mean(dim=0), ratio, w_mean)
        torch.testing.assert_close(outcome.input_scales[f"{EXPERTS}.{e}.down_proj"], expected, rtol=1e-4, atol=1e-6)
        assert norm_scales.shape == (64,)


class TokenContext:
    """What the calibrated methods read from a calibration context."""

    device = torch.device("cpu")
    batch_size = 2

    def __init__(self, tokens: torch.Tensor) -> None:
        self._tokens = tokens

    def tokens(self) -> torch.Tensor:
        return self._tokens

    def calibration_batches(self) -> list[torch.Tensor]:
        return list(self._tokens.split(2))


def test_smoothquant_smooths_the_router_with_the_experts_exactly() -> None:
    """The norm feeding the MoE block is smoothed with all its consumers, the router included: unchanged output."""
    from harness.quant.smoothquant import collect_input_maxima, smooth_groups, smooth_model

    model = build("qwen3_moe")
    tokens = calibration()
    with torch.no_grad():
        reference = model(tokens).logits
    state = unfuse_experts(model)
    sq = QuantConfig(name="sq", method="smoothquant", weights=TensorQuantConfig(format="int", bits=8))
    groups = smooth_groups(model, sq)
    moe_group = next(g for g in groups if g.norm.endswith("0.post_attention_layernorm"))
    assert moe_group.linears[0] == "model.layers.0.mlp.gate" and len(moe_group.linears) == 1 + 2 * 8
    router = model.model.layers[0].mlp.gate.weight.detach().clone()
    smooth_model(model, groups, collect_input_maxima(model, groups, list(tokens.split(2))), 0.5)
    with torch.no_grad():
        smoothed = model(tokens).logits
    fuse_experts(model, state)
    assert not torch.equal(model.model.layers[0].mlp.gate.weight, router)
    torch.testing.assert_close(smoothed, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["gptq", "awq", "smoothquant"])
def test_every_calibrated_method_covers_the_experts_through_apply(method: str, dtype: torch.dtype) -> None:
    from harness import quant

    model = build("mixtral").to(dtype)
    weights = TensorQuantConfig(format="int", bits=8, granularity="channel") if method == "smoothquant" \
        else copy.deepcopy(SPEC)
    activations = TensorQuantConfig(format="int", bits=8, granularity="token") if method == "smoothquant" else None
    s = QuantConfig(name=method, method=method, weights=weights, activations=activations,
                    settings={"search_samples": 0, "grid": 4} if method == "awq" else {},
                    moe=MoEQuantConfig(min_tokens=1))
    report = quant.apply(model, s, TokenContext(calibration()))
    assert report.coverage.uncovered_params == 0 and report.coverage.quantized_share > 0.9
    assert sum(".experts." in layer.name for layer in report.layers) == 2 * 4 * 3
    with torch.no_grad():
        assert torch.isfinite(model(calibration(1, 8)).logits).all()


def test_the_calibrated_cache_key_names_the_moe_options_only_when_set() -> None:
    from harness.quant.calibrated_cache import calibrated_key, scheme_identity

    default, routed_all = scheme("gptq"), scheme("gptq", calibrate_all_experts=True)
    assert "moe" not in scheme_identity(default)  # dense models' and default keys are unchanged
    assert calibrated_key("m", default, "c") != calibrated_key("m", routed_all, "c")
