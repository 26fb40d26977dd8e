"""`int_range: full`: compressed-tensors' symmetric INT grid (scale amax/((2^b-1)/2), codes -2^(b-1)..2^(b-1)-1)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from harness.config import compose
from harness.quant import format_math as formats
from harness.quant.format_table import SchemeError, validate_spec


@pytest.mark.parametrize("bits", [4, 8])
def test_full_range_matches_the_documented_formula_in_numpy(bits):
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(bits))
    ours = formats.int_quantize(w, bits, symmetric=True, granularity="group", group_size=64, full_range=True)
    g = w.numpy().reshape(8, 4, 64)  # float32 throughout, as the weights are: ties at ±(2^b-1)/2 round alike
    scale = np.abs(g).max(-1, keepdims=True) / np.float32((2**bits - 1) / 2)
    codes = np.clip(np.round(g / scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    assert np.allclose(ours.numpy(), (codes * scale).reshape(8, 256), rtol=0, atol=1e-6)
    assert codes.min() == -(2 ** (bits - 1))  # the code the restricted grid never produces is used


def test_restricted_stays_the_default_and_differs():
    w = torch.randn(4, 128, generator=torch.Generator().manual_seed(0))
    restricted = formats.int_quantize(w, 4, symmetric=True, granularity="group", group_size=128)
    full = formats.int_quantize(w, 4, symmetric=True, granularity="group", group_size=128, full_range=True)
    assert not torch.equal(restricted, full)
    scale = w.abs().amax(-1, keepdim=True) / 7
    assert torch.equal(restricted, torch.clamp(torch.round(w / scale), -7, 7) * scale)


def test_the_preset_composes_and_bad_ranges_are_refused():
    scheme = OmegaConf.to_object(compose(["quant=int4_g128_ct", "model=tiny_random"])).quant
    assert scheme.weights.int_range == "full"
    validate_spec(scheme.weights, "weights")
    bad = OmegaConf.to_object(compose(["quant=int4_g128_asym", "model=tiny_random",
                                       "quant.weights.int_range=full"])).quant
    with pytest.raises(SchemeError, match="int_range=full applies to symmetric int grids"):
        validate_spec(bad.weights, "weights")
    typo = OmegaConf.to_object(compose(["quant=int4_g128", "model=tiny_random", "quant.weights.int_range=wide"])).quant
    with pytest.raises(SchemeError, match="use restricted .* or full"):
        validate_spec(typo.weights, "weights")


@pytest.mark.slow
def test_gptq_on_the_full_range_grid_uses_code_minus_eight():
    from harness import quant
    from harness.sizing.report_quant import prepare

    cfg = OmegaConf.to_object(compose(["quant=gptq_w4g128", "model=tiny_random", "quant.weights.int_range=full",
                                       "quant.calibration.num_samples=4", "quant.calibration.seq_len=64"]))
    prepared = prepare(cfg)
    quant.apply(prepared.loaded.model, prepared.scheme, prepared.context)
    w = prepared.loaded.model.model.layers[0].mlp.down_proj.weight.detach().reshape(128, -1, 128)
    from harness.checkpoint.export import recover_int_grid

    scale, _ = recover_int_grid(w.reshape(128, -1), 4, symmetric=True, granularity="group", group_size=128)
    codes = torch.round(w / scale.unsqueeze(-1))
    assert codes.min() >= -8 and codes.max() <= 7 and (codes == -8).any()
