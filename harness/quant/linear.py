"""Simulated activation quantization: a Linear that fake-quantizes its input per call.

Weights are quantized once, at apply time, by the method; only the input is touched here.
A static (calibrated) activation scale is stored on the module as a buffer.

Linears that read the same tensor (q/k/v, gate/up) quantize it once, as fused kernels do: the
wrapped targets of one model share an :class:`_InputCache` holding the last quantized input,
reused only for the *same* tensor object, unmodified since (autograd version counter), under a
dynamic spec. The cache keeps that tensor alive, so its memory cannot be reused by another.

The GEMM of a quantized input runs in float32 and is rounded once to the input's dtype, as a
W8A8/W4A4 kernel computes it (``torch._scaled_mm``, CUTLASS, Marlin-FP8 W8A8: FP8/INT8 codes
multiplied exactly, accumulated in fp32/int32, scaled by fp32 scales, one rounding of the output).
Rounding the dequantized operands to bf16 first (``linear(bf16(fq(x)), bf16(fq(W)))``) adds a
correlated error the kernel does not make: each weight's rounding depends only on its code's
mantissa and its row's scale. On SmolLM2-135M's math texts it pushed the second token of a shared
prompt toward a second massive activation: FP8 W8A8 KL 0.211 in bf16 where the real FP8 GEMM
gives 0.079 (README, *FP8 W8A8 in bf16*). :func:`keep_float32_weights` therefore keeps the dequantized weights
of activation-quantized targets in float32 on a bf16/fp16 model (2 more bytes per weight).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from harness.config import TensorQuantConfig
from harness.quant.format_table import fake_quantize


class _InputCache:
    """The last dynamically quantized input of a group of linears sharing one spec."""

    def __init__(self) -> None:
        self.source: Tensor | None = None
        self.version = -1
        self.quantized: Tensor | None = None

    def get(self, x: Tensor, spec: TensorQuantConfig) -> Tensor:
        if x.is_inference():  # inference-mode tensors have no version counter to prove them unmodified
            return _quantize_input(x, spec)
        if self.source is x and x._version == self.version and self.quantized is not None:
            return self.quantized
        quantized = _quantize_input(x, spec)
        self.source, self.version, self.quantized = x, x._version, quantized
        return quantized


def _quantize_input(x: Tensor, spec: TensorQuantConfig, scale: Tensor | None = None) -> Tensor:
    """The input on its grid, dequantized in float32 (exact: no rounding back to a bf16 input's dtype)."""
    return fake_quantize(x.to(torch.float32), spec, scale=scale)


class Float32Linear(nn.Linear):
    """nn.Linear computing in float32 and rounding its output once to the input's dtype.

    The class of an activation-quantized target whose weights :func:`keep_float32_weights` keeps in
    float32, whenever its input is not quantized (weight methods' and static-scale calibration's
    forwards): a bf16 input meets the float32 weight without a dtype error.
    """

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.to(torch.float32)
        return nn.functional.linear(x.to(torch.float32), self.weight.to(torch.float32), bias).to(x.dtype)


def keep_float32_weights(targets: dict[str, nn.Linear]) -> None:
    """Make bf16/fp16 targets hold float32 weights (exact upcast) before a W/A scheme's method runs.

    The method then stores its dequantized weights in float32 (``q · s`` of an FP8 code and an
    fp32 scale needs up to 28 significant bits; bf16 keeps 8), and :class:`ActQuantLinear`
    multiplies them with the float32 quantized input as the real kernel does. float32 models are
    untouched.
    """
    for module in targets.values():
        if torch.finfo(module.weight.dtype).bits >= 32:
            continue
        module.weight.data = module.weight.data.to(torch.float32)
        if module.bias is not None:
            module.bias.data = module.bias.data.to(torch.float32)
        if type(module) is nn.Linear:
            module.__class__ = Float32Linear


class ActQuantLinear(Float32Linear):
    """nn.Linear whose input is quantized as ``spec`` says before the matmul."""

    spec: TensorQuantConfig
    _input_cache: _InputCache | None

    @classmethod
    def wrap(cls, linear: nn.Linear, spec: TensorQuantConfig, cache: _InputCache | None = None) -> "ActQuantLinear":
        linear.__class__ = cls  # keeps parameters, hooks and device placement
        linear.spec = spec
        linear._input_cache = cache
        linear.register_buffer("input_scale", None, persistent=False)
        return linear  # type: ignore[return-value]

    def forward(self, x: Tensor) -> Tensor:
        """fq(x) · W in float32, rounded once to ``x``'s dtype (see the module docstring)."""
        if self.spec.dynamic:
            cache = getattr(self, "_input_cache", None)
            quantized = cache.get(x, self.spec) if cache is not None else _quantize_input(x, self.spec)
        elif self.input_scale is None:
            raise RuntimeError("static activation quantization needs a calibrated input_scale; "
                               "run calibration first (harness.quant.calibration)")
        else:
            quantized = _quantize_input(x, self.spec, scale=self.input_scale)
        bias = None if self.bias is None else self.bias.to(torch.float32)
        return nn.functional.linear(quantized, self.weight.to(torch.float32), bias).to(x.dtype)


def install_activation_quant(targets: dict[str, nn.Linear], spec: TensorQuantConfig) -> None:
    cache = _InputCache() if spec.dynamic else None  # static scales differ per linear: nothing to share
    for module in targets.values():
        ActQuantLinear.wrap(module, spec, cache)


@torch.no_grad()
def calibrate_static_scales(model: nn.Module, targets: dict[str, nn.Linear], batches: list[Tensor],
                            fmt_max: float) -> None:
    """Per-tensor static input scale = amax over the calibration batches / format max.

    The calibration forwards run with the targets' input quantization switched off (their class
    is :class:`Float32Linear` meanwhile): scales are observed on full-precision inputs, and an
    already wrapped target without a scale yet must not refuse to run.
    """
    amax: dict[str, Tensor] = {}
    hooks = []
    classes = {name: module.__class__ for name, module in targets.items()}
    for name, module in targets.items():
        def hook(_m, inputs, _out, name=name):
            value = inputs[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax.get(name, value), value)
        hooks.append(module.register_forward_hook(hook))
    try:
        for module in targets.values():
            if isinstance(module, ActQuantLinear):
                module.__class__ = Float32Linear
        for batch in batches:
            model(batch.to(next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
        for name, module in targets.items():
            module.__class__ = classes[name]
    for name, module in targets.items():
        module.input_scale = (amax[name].clamp(min=1e-12) / fmt_max).to(module.weight.device)
