"""Simulated activation quantization: weights once at apply time, inputs per call (dynamic per-token,
static per-tensor from calibration, FP4 blocks for W4A4), each checked against torch dtypes or
hand-computed grids."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from harness import quant
from harness.config import QuantConfig, TensorQuantConfig, compose
from harness.quant import format_math as formats
from harness.quant import linear as linear_mod
from harness.quant.linear import ActQuantLinear, _InputCache, calibrate_static_scales
from harness.quant.format_table import SchemeError
from tiny_models import tiny_llama

VOCAB = 256
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


@dataclass
class TokenContext:
    batches: list[torch.Tensor]

    def calibration_batches(self) -> list[torch.Tensor]:
        return self.batches


llama = partial(tiny_llama, vocab_size=VOCAB, hidden_size=128, std=0.08)


def preset(name: str) -> QuantConfig:
    cfg = OmegaConf.to_object(compose(["model=tiny_random", f"quant={name}"]))
    return quant.with_model_defaults(cfg.quant, False)


def tokens(seed: int = 5, shape: tuple[int, int] = (2, 24)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, use_cache=False).logits


def fp8_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Saturating E4M3 quantize-dequantize through torch's own float8 dtype."""
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * scale


def int8_per_token_reference(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True) / 127
    return torch.clamp(torch.round(x / scale), -127, 127) * scale


# ------------------------------------------------------------------ weights once, inputs per call
def test_weights_are_quantized_once_at_apply_time_never_per_call(monkeypatch):
    model = llama()
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quant.apply(model, preset("fp8"), None)
    targets = {n: m for n, m in model.named_modules() if isinstance(m, ActQuantLinear)}
    assert len(targets) == 14 and "lm_head" not in targets
    for name, module in targets.items():  # per-channel E4M3 through torch's float8 cast
        scale = originals[name].abs().amax(-1, keepdim=True) / 448
        torch.testing.assert_close(module.weight.detach(), fp8_reference(originals[name], scale), rtol=0, atol=0)
    weights = {n: (m.weight, m.weight.data_ptr(), m.weight.detach().clone()) for n, m in targets.items()}

    calls: list[torch.Size] = []
    real = formats.fp8_quantize

    def counting(x, *args, **kwargs):
        calls.append(x.shape)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(formats, "fp8_quantize", counting)
    ids = tokens()
    first = logits(model, ids)
    second = logits(model, ids)
    # One input quantization per distinct input per forward (q/k/v share one, gate/up another), nothing else.
    assert len(calls) == 2 * 2 * 4
    assert all(len(shape) == 3 and shape[:2] == ids.shape for shape in calls)  # inputs, never [out, in] weights
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    for name, module in targets.items():
        parameter, pointer, values = weights[name]
        assert module.weight is parameter and module.weight.data_ptr() == pointer
        assert torch.equal(module.weight.detach(), values)


def test_dynamic_per_token_int8_matches_hand_reference_and_tokens_are_independent():
    torch.manual_seed(0)
    layer = ActQuantLinear.wrap(nn.Linear(64, 32), TensorQuantConfig(format="int", bits=8, granularity="token"))
    x = torch.randn(2, 5, 64)
    expected = nn.functional.linear(int8_per_token_reference(x), layer.weight, layer.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)
    loud = x.clone()
    loud[0, 2] *= 100.0  # one token with a huge range changes only its own scale
    changed = (layer(loud) - layer(x)).abs().amax(-1)
    assert changed[0, 2] > 0 and changed.flatten()[[i for i in range(10) if i != 2]].max() == 0


def test_static_per_tensor_fp8_scale_is_calibration_amax_over_448():
    torch.manual_seed(0)
    inner = nn.Linear(16, 8)
    model = nn.Sequential(inner)
    spec = TensorQuantConfig(format="fp8_e4m3", granularity="tensor", dynamic=False)
    ActQuantLinear.wrap(inner, spec)
    batches = [torch.randn(3, 16), torch.randn(3, 16) * 4]
    with pytest.raises(RuntimeError, match="calibrated input_scale"):
        model(batches[0])
    calibrate_static_scales(model, {"0": inner}, batches, 448.0)
    amax = max(b.abs().max() for b in batches)
    torch.testing.assert_close(inner.input_scale, amax / 448, rtol=1e-6, atol=0)
    x = torch.randn(4, 16)
    x[1, 3] = 50 * amax  # beyond the calibrated range: saturates at 448 * scale, never NaN
    expected = nn.functional.linear(fp8_reference(x, inner.input_scale), inner.weight, inner.bias)
    torch.testing.assert_close(inner(x), expected, rtol=0, atol=0)
    loud = x.clone()
    loud[0] *= 10  # a per-tensor static scale does not depend on the other tokens of the call
    assert torch.equal(inner(loud)[2:], inner(x)[2:])


def test_fp8_static_preset_calibrates_every_target_and_needs_calibration_data():
    model = llama()
    with pytest.raises(SchemeError, match="calibration"):
        quant.apply(model, preset("fp8_static"), None)
    model = llama()
    quant.apply(model, preset("fp8_static"), TokenContext([tokens(1, (4, 32)), tokens(2, (4, 32))]))
    scales = [m.input_scale for m in model.modules() if isinstance(m, ActQuantLinear)]
    assert len(scales) == 14 and all(bool(torch.isfinite(s) & (s > 0)) for s in scales)
    assert torch.isfinite(logits(model, tokens())).all()


# ------------------------------------------------------------------------------------------ W4A4
def _in_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Elementwise: is |value| one of the E2M1 magnitudes (exactly)?"""
    return torch.isin(values.abs(), E2M1)


def _on_mx_grid(values: torch.Tensor, block: int) -> bool:
    """Every block of ``block`` values is 2^k times E2M1 values, for one integer k per block."""
    blocks = values.double().reshape(-1, block)
    ok = torch.zeros(len(blocks), dtype=torch.bool)
    for k in range(-40, 40):
        ok |= _in_e2m1(blocks / 2.0**k).all(dim=1)
    return bool(ok.all())


def _on_nvfp4_grid(values: torch.Tensor) -> bool:
    """Every block of 16 is one positive scale times E2M1 values (the scale is not a power of two):
    for some E2M1 value g, the block scaled so that its largest magnitude becomes g lies on the grid."""
    blocks = values.double().reshape(-1, 16)
    top = blocks.abs().amax(dim=1, keepdim=True)
    ok = (top == 0)[:, 0]
    for grid_max in E2M1[1:]:
        scaled = blocks * grid_max / top.clamp(min=1e-300)
        ok |= _in_e2m1(torch.round(scaled * 4) / 4).all(dim=1) & ((scaled - torch.round(scaled * 4) / 4).abs()
                                                                  < 1e-6).all(dim=1)
    return bool(ok.all())


@pytest.mark.slow
@pytest.mark.parametrize("name,on_grid", [("mxfp4", lambda v: _on_mx_grid(v, 32)), ("nvfp4", _on_nvfp4_grid)])
def test_w4a4_quantizes_weights_and_every_input_onto_the_fp4_grid(monkeypatch, name, on_grid):
    ids = tokens()
    reference = logits(llama(), ids)
    weight_only = llama()
    quant.apply(weight_only, preset(f"{name}_w4a16"), None)
    model = llama()
    quant.apply(model, preset(name), None)
    targets = [m for m in model.modules() if isinstance(m, ActQuantLinear)]
    assert len(targets) == 14 and all(on_grid(m.weight.detach()) for m in targets)
    seen: list[torch.Tensor] = []
    real = linear_mod.fake_quantize

    def recording(x, spec, **kwargs):
        out = real(x, spec, **kwargs)
        seen.append(out.detach())
        return out

    monkeypatch.setattr(linear_mod, "fake_quantize", recording)
    out = logits(model, ids)
    assert len(seen) == 8 and all(on_grid(x) for x in seen)  # 4 distinct inputs per block
    # Quantizing the activations too adds error on top of the weights' error.
    w4a16_error = (logits(weight_only, ids) - reference).pow(2).mean()
    w4a4_error = (out - reference).pow(2).mean()
    assert w4a4_error > 1.2 * w4a16_error > 0


# ------------------------------------------------------------- performance paths stay exact
def test_shared_input_is_quantized_once_but_never_reused_stale(monkeypatch):
    torch.manual_seed(0)
    spec = TensorQuantConfig(format="fp8_e4m3", granularity="token")
    cache = _InputCache()
    first = ActQuantLinear.wrap(nn.Linear(32, 8), spec, cache)
    second = ActQuantLinear.wrap(nn.Linear(32, 8), spec, cache)
    calls = []
    real = linear_mod.fake_quantize
    monkeypatch.setattr(linear_mod, "fake_quantize", lambda x, s, **kw: calls.append(1) or real(x, s, **kw))

    def expected(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(-1, keepdim=True) / 448
        return nn.functional.linear(fp8_reference(x, scale), layer.weight, layer.bias)

    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(first(x), expected(first, x), rtol=0, atol=0)
        torch.testing.assert_close(second(x), expected(second, x), rtol=0, atol=0)
        assert len(calls) == 1  # the sibling reused the quantized input
        x.mul_(3.0)  # modified in place: the version counter moves, the cache must not answer
        torch.testing.assert_close(second(x), expected(second, x), rtol=0, atol=0)
        equal_values = x.clone()  # same values, another tensor: recomputed, not trusted by value
        torch.testing.assert_close(first(equal_values), expected(first, equal_values), rtol=0, atol=0)
        assert len(calls) == 3
    with torch.inference_mode():  # inference tensors carry no version counter: no caching, still right
        y = torch.randn(3, 32)
        torch.testing.assert_close(first(y), expected(first, y), rtol=0, atol=0)
        torch.testing.assert_close(second(y), expected(second, y), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_table_decoded_fp8_round_trip_equals_torch_cast_bitwise(dtype):
    fmt, fmax = ("e4m3", 448.0) if dtype == torch.float8_e4m3fn else ("e5m2", 57344.0)
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)  # every FP8 value, NaNs included
    finite = torch.sort(codes[torch.isfinite(codes)].unique()).values
    midpoints = (finite[:-1] + finite[1:]) / 2  # ties: round half to even
    generator = torch.Generator().manual_seed(0)
    scattered = torch.randn(20000, generator=generator) * torch.exp2(
        torch.randint(-24, 20, (20000,), generator=generator).float())
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 2 * fmax])
    x = torch.cat([codes, midpoints, torch.nextafter(midpoints, torch.tensor(float("inf"))),
                   torch.nextafter(midpoints, torch.tensor(-float("inf"))), scattered, specials])
    x = torch.stack([x, -x], dim=1).t()  # non-contiguous rows
    got = formats.fp8_cast(x, fmt)
    expected = x.clamp(-fmax, fmax).to(dtype).to(torch.float32)
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    same = ~torch.isnan(expected)
    assert torch.equal(got[same], expected[same])
    assert torch.equal(torch.signbit(got[same]), torch.signbit(expected[same]))  # -0 stays -0
