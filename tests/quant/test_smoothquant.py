"""SmoothQuant: hand-computed scales, exact equivalence without quantization (Llama and Gemma norms),
the balance property s makes, and that it helps INT8 W8A8 on a model with activation outliers."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest
import torch
from omegaconf import OmegaConf

from harness import quant
from harness.config import QuantConfig, TensorQuantConfig
from harness.quant.smoothquant import collect_input_maxima, smooth_groups, smoothing_scales
from harness.quant.format_table import SchemeError
from tiny_models import tiny_llama

VOCAB = 256


@dataclass
class TokenContext:
    """The part of a QuantContext SmoothQuant uses: fixed calibration batches."""

    batches: list[torch.Tensor]

    def calibration_batches(self) -> list[torch.Tensor]:
        return self.batches


# non-trivial norm weights so the fold is exercised
llama = partial(tiny_llama, vocab_size=VOCAB, hidden_size=128, std=0.08, norm_range=(0.5, 1.5))


def tiny_gemma3(seed: int = 0) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma stores w with scale (1 + w): make w far from 0
                param.uniform_(-0.5, 1.0)
    return model


def batches(seed: int = 1, count: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, 32), generator=generator) for _ in range(count)]


def scheme(method: str = "smoothquant", *, w8a8: bool = False, alpha: float = 0.5) -> QuantConfig:
    weights = TensorQuantConfig(format="int", bits=8, granularity="channel") if w8a8 else None
    activations = TensorQuantConfig(format="int", bits=8, granularity="token") if w8a8 else None
    return QuantConfig(name="sq", method=method, weights=weights, activations=activations,
                       settings={"alpha": alpha} if method == "smoothquant" else {})


@torch.no_grad()
def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens, use_cache=False).logits


def test_scales_match_hand_computed_values():
    act = torch.tensor([4.0, 1.0, 0.0, 9.0, 16.0])
    weight = torch.tensor([1.0, 4.0, 2.0, 0.0, 0.25])
    # alpha 0.5: sqrt(a) / sqrt(w); a dead activation or weight channel keeps 1.
    assert torch.equal(smoothing_scales(act, weight, 0.5), torch.tensor([2.0, 0.5, 1.0, 1.0, 8.0]))
    # alpha 1: all difficulty moves to the weights, s = max|X|.
    assert torch.equal(smoothing_scales(act, weight, 1.0), torch.tensor([4.0, 1.0, 1.0, 1.0, 16.0]))
    # alpha 0: s = 1 / max|W|.
    assert torch.allclose(smoothing_scales(act, weight, 0.0), torch.tensor([1.0, 0.25, 1.0, 1.0, 4.0]))


def test_groups_are_the_norm_fed_ones():
    groups = smooth_groups(llama())
    assert [g.norm for g in groups[:2]] == ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm"]
    assert groups[0].linears == tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    assert groups[1].linears == ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")
    assert len(groups) == 4
    gemma = smooth_groups(tiny_gemma3())
    assert gemma[1].norm == "model.layers.0.pre_feedforward_layernorm"  # not post_attention_layernorm


@pytest.mark.parametrize("build", [llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_smoothing_without_quantization_leaves_logits_unchanged(build):
    model = build()
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))
    before = logits(model, tokens)
    norm_before = model.model.layers[0].input_layernorm.weight.detach().clone()
    q_before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    report = quant.apply(model, scheme(), TokenContext(batches()))
    after = logits(model, tokens)
    # The parameters really changed (by per-channel factors well away from 1) ...
    layer = model.model.layers[0]
    assert (layer.input_layernorm.weight - norm_before).abs().max() > 0.05
    assert (layer.self_attn.q_proj.weight - q_before).abs().max() > 0.01
    # ... yet the function did not.
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert report.layers == [] and "smoothquant: alpha=0.5" in report.notes[0]


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_smoothing_balances_activation_and_weight_maxima(alpha):
    """With a = max|X_j|, w = max|W_:,j| and s = a^alpha / w^(1-alpha), the smoothed model has
    max|X'_j| = a / s = a^(1-alpha) w^(1-alpha) and max|W'_:,j| = w s = a^alpha w^alpha (equal at 0.5)."""
    model = llama()
    calibration = batches()
    groups = smooth_groups(model)
    act = collect_input_maxima(model, groups, calibration)
    weight = {g.norm: torch.stack([model.get_submodule(n).weight.abs().amax(0) for n in g.linears]).amax(0).detach()
              for g in groups}
    quant.apply(model, scheme(alpha=alpha), TokenContext(calibration))
    act_after = collect_input_maxima(model, groups, calibration)
    for g in groups:
        weight_after = torch.stack([model.get_submodule(n).weight.abs().amax(0) for n in g.linears]).amax(0).detach()
        a, w = act[g.norm].double(), weight[g.norm].double()
        torch.testing.assert_close(act_after[g.norm].double(), a ** (1 - alpha) * w ** (1 - alpha), rtol=1e-4, atol=0)
        torch.testing.assert_close(weight_after.double(), a ** alpha * w ** alpha, rtol=1e-4, atol=0)


def _with_activation_outliers(model: torch.nn.Module) -> torch.nn.Module:
    """A few hidden channels 30x larger at every norm output: the LLM.int8() outlier pattern."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 40, 97]] *= 30.0
    return model


def test_smoothquant_beats_plain_int8_w8a8_on_outlier_activations():
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    reference = _with_activation_outliers(llama())
    target = logits(reference, tokens)
    errors = {}
    for method in ("rtn", "smoothquant"):
        model = _with_activation_outliers(llama())
        report = quant.apply(model, scheme(method, w8a8=True), TokenContext(batches()))
        assert len(report.layers) == 14  # 7 linears x 2 blocks; lm_head kept
        errors[method] = (logits(model, tokens) - target).pow(2).mean().item()
    assert errors["smoothquant"] < 0.6 * errors["rtn"], errors  # measured 0.44


def test_scheme_preset_composes_with_smoothquant_method():
    from harness.config import compose
    cfg = OmegaConf.to_object(compose(["model=tiny_random", "quant=int8_w8a8_sq"]))
    assert cfg.quant.method == "smoothquant" and cfg.quant.settings == {"alpha": 0.5}
    quant.validate_scheme(cfg.quant)


def test_bad_alpha_and_missing_calibration_are_refused():
    with pytest.raises(SchemeError, match="alpha=1.5"):
        quant.apply(llama(), scheme(alpha=1.5), TokenContext(batches()))
    with pytest.raises(SchemeError, match="calibration"):
        quant.apply(llama(), scheme(), None)
