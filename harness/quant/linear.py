"""Simulated activation quantization: a Linear that fake-quantizes its input per call.

Weights are quantized once, at apply time, by the method; only the input is touched here.
A static (calibrated) activation scale is stored on the module as a buffer.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from harness.config import TensorQuantConfig
from harness.quant.tensor import fake_quantize


class ActQuantLinear(nn.Linear):
    """nn.Linear whose input is quantized as ``spec`` says before the matmul."""

    spec: TensorQuantConfig

    @classmethod
    def wrap(cls, linear: nn.Linear, spec: TensorQuantConfig) -> "ActQuantLinear":
        linear.__class__ = cls  # keeps parameters, hooks and device placement
        linear.spec = spec
        linear.register_buffer("input_scale", None, persistent=False)
        return linear  # type: ignore[return-value]

    def forward(self, x: Tensor) -> Tensor:
        scale = None if self.spec.dynamic else self.input_scale
        if not self.spec.dynamic and scale is None:
            raise RuntimeError("static activation quantization needs a calibrated input_scale; "
                               "run calibration first (harness.quant.calibration)")
        return nn.functional.linear(fake_quantize(x, self.spec, scale=scale), self.weight, self.bias)


def install_activation_quant(targets: dict[str, nn.Linear], spec: TensorQuantConfig) -> None:
    for module in targets.values():
        ActQuantLinear.wrap(module, spec)


@torch.no_grad()
def calibrate_static_scales(model: nn.Module, targets: dict[str, nn.Linear], batches: list[Tensor],
                            fmt_max: float) -> None:
    """Per-tensor static input scale = amax over the calibration batches / format max."""
    amax: dict[str, Tensor] = {}
    hooks = []
    for name, module in targets.items():
        def hook(_m, inputs, _out, name=name):
            value = inputs[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax.get(name, value), value)
        hooks.append(module.register_forward_hook(hook))
    try:
        for batch in batches:
            model(batch.to(next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    for name, module in targets.items():
        module.input_scale = (amax[name].clamp(min=1e-12) / fmt_max).to(module.weight.device)
