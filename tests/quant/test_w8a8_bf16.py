"""W8A8 in bf16 computes what the deployed FP8 GEMM computes (issue 23).

The reference is independent of ``harness.quant``: ``torch._scaled_mm`` (the FP8 GEMM vLLM runs;
torch's CPU build has it too) on E4M3 codes cast with torch's own float8 dtype and fp32 row-wise
scales amax/448, output rounded once to bf16. The simulation used to round both dequantized
operands to bf16 before a bf16 GEMM; that made 48 % of one layer's outputs differ from the kernel
(relative error 3e-3) and FP8 W8A8 on SmolLM2's math texts 2.7x worse than the real GEMM.
"""
from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from harness import quant
from harness.config import QuantConfig, TensorQuantConfig, compose
from harness.quant.linear import ActQuantLinear, Float32Linear
from tiny_models import tiny_llama

E4M3 = torch.float8_e4m3fn
VOCAB = 256
FP8_CHANNEL = TensorQuantConfig(format="fp8_e4m3", granularity="channel")
FP8_TOKEN = TensorQuantConfig(format="fp8_e4m3", granularity="token")


def rowwise_e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = t.float()
    scale = t.abs().amax(-1, keepdim=True) / 448.0
    return (t / scale).clamp(-448.0, 448.0).to(E4M3), scale


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The real FP8 W8A8 GEMM of ``x`` [..., in] and the *unquantized* weight [out, in]."""
    flat = x.reshape(-1, x.shape[-1])
    x_codes, x_scale = rowwise_e4m3(flat)
    w_codes, w_scale = rowwise_e4m3(weight)
    out = torch._scaled_mm(x_codes, w_codes.t(), scale_a=x_scale, scale_b=w_scale.t().contiguous(),
                           out_dtype=x.dtype).reshape(*x.shape[:-1], -1)
    return out if bias is None else out + bias


class RealFp8(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_mm(x, self.weight, self.bias)


def preset(name: str) -> QuantConfig:
    cfg = OmegaConf.to_object(compose(["model=tiny_random", f"quant={name}"]))
    return quant.with_model_defaults(cfg.quant, False)


llama = partial(tiny_llama, vocab_size=VOCAB, hidden_size=128, std=0.08)


def layer_inputs(dtype: torch.dtype) -> tuple[nn.Linear, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(576, 384, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(384, 576, generator=generator) * 0.05)
    x = torch.randn(3, 21, 576, generator=generator) * torch.linspace(0.1, 3.0, 576)  # uneven channels
    return linear.to(dtype), x.to(dtype)


def test_bf16_fp8_linear_is_the_real_fp8_gemm_bit_for_bit():
    linear, x = layer_inputs(torch.bfloat16)
    expected = scaled_mm(x, linear.weight)
    model = nn.Sequential(copy.deepcopy(linear))
    scheme = preset("fp8")
    scheme.targets, scheme.keep = ["*"], []
    quant.apply(model, scheme, None)
    got = model(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected), f"{(got != expected).float().mean():.2%} of outputs differ"
    # What the simulation computed before: both dequantized operands rounded to bf16, bf16 GEMM.
    before = nn.functional.linear(quant.fake_quantize(x, FP8_TOKEN), quant.fake_quantize(linear.weight, FP8_CHANNEL))
    assert (before != expected).float().mean() > 0.2  # the defect this test exists to catch


def test_float32_fp8_linear_is_unchanged_by_the_float32_gemm():
    """In float32 nothing is rounded to a lower dtype: the result equals fq(x) @ fq(W)^T as before."""
    linear, x = layer_inputs(torch.float32)
    weight = quant.fake_quantize(linear.weight.detach(), FP8_CHANNEL)
    expected = nn.functional.linear(quant.fake_quantize(x, FP8_TOKEN), weight)
    linear.weight.data = weight
    torch.testing.assert_close(ActQuantLinear.wrap(linear, FP8_TOKEN)(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(scaled_mm(x, linear.weight), expected, rtol=2e-6, atol=2e-6)


@torch.no_grad()
def test_bf16_fp8_model_logits_equal_a_scaled_mm_model():
    model = llama().to(torch.bfloat16)
    real = copy.deepcopy(model)
    for parent in list(real.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(parent, name, RealFp8(child))
    quant.apply(model, preset("fp8"), None)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    got, expected = model(ids, use_cache=False).logits, real(ids, use_cache=False).logits
    assert torch.equal(got, expected), f"max |Δ| {(got - expected).abs().max():.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp8", "fp8_block", "int8_w8a8", "nvfp4", "mxfp8"])
def test_w8a8_targets_of_a_bf16_model_keep_float32_weights(name):
    model = llama().to(torch.bfloat16)
    quant.apply(model, preset(name), None)
    targets = [m for m in model.modules() if isinstance(m, ActQuantLinear)]
    assert len(targets) == 14 and all(m.weight.dtype == torch.float32 for m in targets)
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert model(ids, use_cache=False).logits.dtype == torch.bfloat16


def test_weight_only_schemes_keep_the_model_dtype():
    """W8A16 / W4A16 kernels dequantize the weight into the activation dtype: so does the simulation."""
    model = llama().to(torch.bfloat16)
    quant.apply(model, preset("fp8_w8a16"), None)
    assert all(m.weight.dtype == torch.bfloat16 for m in model.modules() if isinstance(m, nn.Linear))
    assert not any(isinstance(m, Float32Linear) for m in model.modules())


@torch.no_grad()
def test_bf16_fp8_static_calibrates_and_equals_a_tensorwise_scaled_mm():
    class Context:
        def calibration_batches(self) -> list[torch.Tensor]:
            generator = torch.Generator().manual_seed(2)
            return [torch.randint(0, VOCAB, (4, 32), generator=generator) for _ in range(2)]

    model = llama().to(torch.bfloat16)
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quant.apply(model, preset("fp8_static"), Context())
    name, module = next((n, m) for n, m in model.named_modules() if isinstance(m, ActQuantLinear))
    x = torch.randn(7, module.in_features, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w_codes, w_scale = rowwise_e4m3(originals[name])
    x_codes = (x.float() / module.input_scale).clamp(-448, 448).to(E4M3)
    expected = torch._scaled_mm(x_codes, w_codes.t(), scale_a=module.input_scale.reshape(1, 1).expand(7, 1).contiguous(),
                                scale_b=w_scale.t().contiguous(), out_dtype=torch.bfloat16)
    assert torch.equal(module(x), expected)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_smollm2_bf16_fp8_kl_equals_the_real_fp8_gemm(make_cfg):
    """SmolLM2-135M in bf16, the math slice's 16 divergence texts (236 tokens): the harness's FP8 W8A8
    KL equals that of the same model run through torch._scaled_mm, within 15 % (two implementations of
    the same arithmetic differ by one fp32 accumulation order, which flips a few FP8 codes downstream;
    measured 0.082 vs 0.079; the simulation before the fix gave 0.211)."""
    from harness.divergence import scoring as divergence
    from harness.job import identity
    from harness.job import divergence_texts
    from harness.config import to_config
    from harness.models import loading as models
    from harness.evaluation.slices import resolve
    cfg = to_config(make_cfg("model=smollm2_135m", "model.dtype=bfloat16", "slices=[math]", "quant=fp8"))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    slice_ = resolve(cfg.slices)[0]
    texts = divergence_texts.divergence_texts(slice_, identity.eval_settings(cfg, identity.tokenizer_dir(loaded)))
    ids = [divergence.tokenize(loaded.tokenizer, t, 1024) for t in texts]

    @torch.no_grad()
    def log_probs(model: nn.Module) -> list[torch.Tensor]:
        return [torch.log_softmax(model(i.unsqueeze(0), use_cache=False).logits[0, :-1].float(), -1) for i in ids]

    def mean_kl(p: list[torch.Tensor], q: list[torch.Tensor]) -> float:
        return float(torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(p, q)]).mean())

    reference = log_probs(loaded.model)
    real = copy.deepcopy(loaded.model)
    for parent in list(real.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(parent, name, RealFp8(child))
    simulated = copy.deepcopy(loaded.model)
    quant.apply(simulated, quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups), None)
    kl_real, kl_harness = mean_kl(reference, log_probs(real)), mean_kl(reference, log_probs(simulated))
    assert kl_real > 0 and abs(kl_harness - kl_real) <= 0.15 * kl_real, (kl_harness, kl_real)
