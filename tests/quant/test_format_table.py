"""The number-format table: one entry added here is usable for weights, activations and the KV cache.

The toy format is a symmetric 3-bit integer grid (codes -3..3, scale amax / 3) built from the
existing primitives; every check compares against a numpy reference written out here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from harness import quant
from harness.config import KVCacheQuantConfig, QuantConfig, TensorQuantConfig
from harness.quant.kv import fake_quantize_kv, install_kv_quant, kv_formats, kv_layer_states, validate_kv_cache
from harness.quant.linear import ActQuantLinear
from harness.quant.format_table import FORMATS, SchemeError, unregister_format
from tests.quant.toy_format import TOY, toy_entry
from tiny_models import tiny_llama

unregister_format(TOY)  # importing the plugin registered it; each test registers its own entry

@pytest.fixture
def toy_format():
    quant.register_format(toy_entry())
    yield TOY
    unregister_format(TOY)


def reference(x: np.ndarray, axis=None) -> np.ndarray:
    """Symmetric 3-bit grid, scale amax / 3 over ``axis`` (None: the whole array), ties to even."""
    scale = np.abs(x).max(axis=axis, keepdims=True) / 3
    return np.clip(np.round(x / scale), -3, 3) * scale


@dataclass
class Batches:
    batches: list[torch.Tensor]

    def calibration_batches(self) -> list[torch.Tensor]:
        return self.batches


def ids(seed: int, shape=(2, 16)) -> torch.Tensor:
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


def test_the_built_in_formats_are_one_entry_each():
    assert {"int", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4", "mxfp8"} <= set(FORMATS)
    assert FORMATS["fp8_e4m3"].max(TensorQuantConfig()) == 448.0 and FORMATS["fp8_e5m2"].max(None) == 57344.0
    assert FORMATS["int"].max(TensorQuantConfig(bits=4)) == 7.0
    assert [FORMATS[n].block_size for n in ("nvfp4", "mxfp4", "mxfp8")] == [16, 32, 32]
    assert kv_formats() == ["fp8_e4m3", "fp8_e5m2", "int"]  # block formats have no static-scale rounding


@torch.no_grad()
def test_a_registered_format_quantizes_weights_as_its_reference(toy_format):
    model = tiny_llama(attn="sdpa")
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    scheme = QuantConfig(name="w3", method="rtn", weights=TensorQuantConfig(format=toy_format, granularity="channel"))
    report = quant.apply(model, scheme)
    assert len(report.layers) == 14
    for layer in report.layers:
        weight = model.get_submodule(layer.name).weight
        expected = reference(originals[layer.name].numpy(), axis=1)
        np.testing.assert_allclose(weight.numpy(), expected, rtol=1e-6, atol=1e-7)
        assert layer.bits_per_weight == 3 + 16 / layer.in_features
    grouped = TensorQuantConfig(format=toy_format, granularity="group", group_size=32, ragged_groups=True)
    w = torch.randn(4, 80)  # 80 = 2 x 32 + a ragged 16: the shorter last group gets its own scale
    expected = np.concatenate([reference(w[:, :64].numpy().reshape(4, 2, 32), axis=2).reshape(4, 64),
                               reference(w[:, 64:].numpy(), axis=1)], axis=1)
    np.testing.assert_allclose(quant.fake_quantize(w, grouped).numpy(), expected, rtol=1e-6, atol=1e-7)


@torch.no_grad()
def test_a_registered_format_quantizes_dynamic_and_static_activations(toy_format):
    model = tiny_llama(attn="sdpa")
    scheme = QuantConfig(name="a3", method="rtn", activations=TensorQuantConfig(format=toy_format, granularity="token"))
    quant.apply(model, scheme)
    linear = model.model.layers[0].mlp.down_proj
    assert isinstance(linear, ActQuantLinear)
    x = torch.randn(3, 5, 128)
    expected = torch.from_numpy(reference(x.numpy(), axis=-1)) @ linear.weight.T
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)

    static = tiny_llama(attn="sdpa")
    scheme = QuantConfig(name="a3s", method="rtn",
                         activations=TensorQuantConfig(format=toy_format, granularity="tensor", dynamic=False))
    with pytest.raises(SchemeError, match="calibration"):
        quant.apply(static, scheme)
    seen: list[torch.Tensor] = []
    down = static.model.layers[0].mlp.down_proj
    handle = down.register_forward_pre_hook(lambda _m, args: seen.append(args[0].abs().amax()))
    batches = [ids(1), ids(2)]
    for batch in batches:  # observe the inputs the calibration will see, unquantized
        static(batch)
    handle.remove()
    quant.apply(static, scheme, Batches(batches))
    torch.testing.assert_close(down.input_scale, torch.stack(seen).max() / 3, rtol=1e-6, atol=0)
    x = torch.randn(2, 128)
    scale = float(down.input_scale)
    expected = np.clip(np.round(x.numpy() / scale), -3, 3) * scale
    torch.testing.assert_close(down(x), torch.from_numpy(expected).float() @ down.weight.T, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_registered_format_quantizes_the_kv_cache(toy_format):
    token = TensorQuantConfig(format=toy_format, granularity="token")
    validate_kv_cache(KVCacheQuantConfig(keys=token, values=token))
    assert toy_format in kv_formats()
    x = torch.randn(2, 2, 7, 16)
    np.testing.assert_allclose(fake_quantize_kv(x, token).numpy(), reference(x.numpy(), axis=-1), rtol=1e-6, atol=1e-7)
    head = TensorQuantConfig(format=toy_format, granularity="head")
    np.testing.assert_allclose(fake_quantize_kv(x, head).numpy(), reference(x.numpy(), axis=(2, 3)),
                               rtol=1e-6, atol=1e-7)

    model = tiny_llama(attn="sdpa")
    static = TensorQuantConfig(format=toy_format, granularity="tensor", dynamic=False)
    cfg = KVCacheQuantConfig(keys=static, values=static)
    install_kv_quant(model, cfg, Batches([ids(3)]))
    states = kv_layer_states(model)
    assert len(states) == 2
    for state in states.values():
        torch.testing.assert_close(state.key_scale, state.observed["keys"].amax() / 3, rtol=0, atol=0)
    values = torch.randn(1, 2, 5, 16)
    quantized = fake_quantize_kv(values, static, static_scale=state.value_scale)
    scale = float(state.value_scale)
    np.testing.assert_allclose(quantized.numpy(), np.clip(np.round(values.numpy() / scale), -3, 3) * scale,
                               rtol=1e-6, atol=1e-7)
    assert torch.isfinite(model(ids(4)).logits).all()


def test_a_registered_format_is_validated_by_its_entry(toy_format):
    with pytest.raises(SchemeError, match=f"asymmetric {toy_format}"):
        quant.validate_scheme(QuantConfig(name="x", weights=TensorQuantConfig(format=toy_format, symmetric=False)))
    with pytest.raises(SchemeError, match="supports"):
        quant.validate_scheme(QuantConfig(name="x", weights=TensorQuantConfig(format=toy_format, granularity="block")))
    with pytest.raises(SchemeError, match="integer grid"):  # GPTQ solves for the int grid only
        quant.validate_scheme(QuantConfig(name="x", method="gptq", weights=TensorQuantConfig(format=toy_format)))
    unregister_format(toy_format)
    with pytest.raises(SchemeError, match=f"format='{toy_format}'"):
        quant.validate_scheme(QuantConfig(name="x", weights=TensorQuantConfig(format=toy_format)))


def test_the_generic_accounting_matches_the_hand_count_and_the_built_in_entries():
    """Storage, label and KV bits come from an entry's facts; checked against counts written out here."""
    quant.register_format(toy_entry())
    try:
        from harness.quant.format_table import bits_per_element, kv_bits, label, storage_bits

        grouped = TensorQuantConfig(format=TOY, granularity="group", group_size=64)
        assert storage_bits(grouped, 32, 128) == 3 + 16 / 64
        assert storage_bits(grouped, 32, 96) == 3 + 2 * 16 / 96  # ragged: ceil(96 / 64) scales per row
        assert label(grouped) == "toy_int3 group64"
        assert label(TensorQuantConfig(format="int", bits=4, symmetric=False, granularity="group")) == "int4 asym group128"
        assert label(TensorQuantConfig(format="nvfp4", granularity="group", group_size=16)) == "nvfp4"
        token = TensorQuantConfig(format=TOY, granularity="token")
        assert kv_bits(token, head_dim=64, group_tokens=32) == 3 + 16 / 64  # one scale per token and head
        assert kv_bits(TensorQuantConfig(format=TOY, granularity="channel"), 64, 32) == 3 + 16 / 32
        assert kv_bits(TensorQuantConfig(format=TOY, granularity="head"), 64, 32) == 3.0  # per layer: nothing per token
        assert bits_per_element(TOY, granularity="group", group_size=128) == 3 + 16 / 128
    finally:
        unregister_format(TOY)


@pytest.mark.slow
def test_a_plugin_format_runs_a_whole_job_as_weights_and_as_kv_cache(make_cfg, tmp_path):
    """The plugin route end to end: quant.plugins registers the format, and the job reads it everywhere,
    the ledger's KV bits at the end of the job included (once a crash: ``unknown format``)."""
    import sys

    from harness.job import pipeline
    from tests.conftest import TINY_MATH

    sys.modules.pop("tests.quant.toy_format", None)  # the job's own plugin import registers it
    unregister_format(TOY)
    try:
        cfg = make_cfg(*TINY_MATH, "quant=int4_g128_kv8", "quant.name=w3kv3", "quant.plugins=[tests.quant.toy_format]",
                       f"quant.weights.format={TOY}", "quant.weights.bits=3", "quant.weights.group_size=32",
                       f"quant.kv_cache.keys.format={TOY}", f"quant.kv_cache.values.format={TOY}",
                       "quant.kv_cache.keys.granularity=token", "quant.kv_cache.values.granularity=token",
                       "quant.kv_cache.keys.dynamic=true", "quant.kv_cache.values.dynamic=true",
                       "eval.max_gen_toks=8")
        result = pipeline.run(cfg)
    finally:
        unregister_format(TOY)
    assert result["quant"]["bits_per_weight"] == pytest.approx(3 + 16 / 32)
    # tiny_random: 2 layers, 2 KV heads, head dim 128 / 4 = 32; one 16-bit scale per token and head
    kv_bits = 3 + 16 / 32
    assert result["quant"]["ledger/kv_bytes_per_token/scheme_kv"] == pytest.approx(2 * 2 * 2 * 32 * kv_bits / 8)
    assert result["metrics"]["math/kl_mean"] > 0
