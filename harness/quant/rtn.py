"""Round-to-nearest: each target weight is replaced by its quantize-dequantize image."""
from __future__ import annotations

import torch
from torch import nn

from harness.config import QuantConfig
from harness.quant.format_table import fake_quantize
from harness.quant.methods import COMPRESSED_TENSORS, register_method
from harness.quant.report import QuantReport
from harness.quant.targets import bits_for, target_linears


@torch.no_grad()
def quantize_weights_rtn(model: nn.Module, scheme: QuantConfig, report: QuantReport) -> None:
    if scheme.weights is None:
        return
    targets, _ = target_linears(model, scheme)
    for name, module in targets.items():
        original = module.weight.data
        quantized = fake_quantize(original, scheme.weights)
        report.add_layer(name, original, quantized, bits_for(scheme, module))
        module.weight.data = quantized


@register_method("rtn", exports=(COMPRESSED_TENSORS,))
def rtn(model: nn.Module, scheme: QuantConfig, context: object, report: QuantReport) -> None:
    """No calibration, any weight format: the baseline every other method is compared with."""
    quantize_weights_rtn(model, scheme, report)
