"""Simulated activation quantization: a Linear that fake-quantizes its input per call.

Weights are quantized once, at apply time, by the method; only the input is touched here.
A static (calibrated) activation scale is stored on the module as a buffer.

Linears that read the same tensor (q/k/v, gate/up) quantize it once, as fused kernels do: the
wrapped targets of one model share an :class:`_InputCache` holding the last quantized input,
reused only for the *same* tensor object, unmodified since (autograd version counter), under a
dynamic spec. The cache keeps that tensor alive, so its memory cannot be reused by another.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from harness.config import TensorQuantConfig
from harness.quant.tensor import fake_quantize


class _InputCache:
    """The last dynamically quantized input of a group of linears sharing one spec."""

    def __init__(self) -> None:
        self.source: Tensor | None = None
        self.version = -1
        self.quantized: Tensor | None = None

    def get(self, x: Tensor, spec: TensorQuantConfig) -> Tensor:
        if x.is_inference():  # inference-mode tensors have no version counter to prove them unmodified
            return fake_quantize(x, spec)
        if self.source is x and x._version == self.version and self.quantized is not None:
            return self.quantized
        quantized = fake_quantize(x, spec)
        self.source, self.version, self.quantized = x, x._version, quantized
        return quantized


class ActQuantLinear(nn.Linear):
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
        if self.spec.dynamic:
            cache = getattr(self, "_input_cache", None)
            quantized = cache.get(x, self.spec) if cache is not None else fake_quantize(x, self.spec)
        elif self.input_scale is None:
            raise RuntimeError("static activation quantization needs a calibrated input_scale; "
                               "run calibration first (harness.quant.calibration)")
        else:
            quantized = fake_quantize(x, self.spec, scale=self.input_scale)
        return nn.functional.linear(quantized, self.weight, self.bias)


def install_activation_quant(targets: dict[str, nn.Linear], spec: TensorQuantConfig) -> None:
    cache = _InputCache() if spec.dynamic else None  # static scales differ per linear: nothing to share
    for module in targets.values():
        ActQuantLinear.wrap(module, spec, cache)


@torch.no_grad()
def calibrate_static_scales(model: nn.Module, targets: dict[str, nn.Linear], batches: list[Tensor],
                            fmt_max: float) -> None:
    """Per-tensor static input scale = amax over the calibration batches / format max.

    The calibration forwards run with the targets' input quantization switched off (their class
    is plain ``nn.Linear`` meanwhile): scales are observed on full-precision inputs, and an
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
                module.__class__ = nn.Linear
        for batch in batches:
            model(batch.to(next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
        for name, module in targets.items():
            module.__class__ = classes[name]
    for name, module in targets.items():
        module.input_scale = (amax[name].clamp(min=1e-12) / fmt_max).to(module.weight.device)
