"""Every scheme preset composes, validates and fits the tiny model; nonsense schemes are refused at config time."""
from __future__ import annotations

import importlib
import importlib.util

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from harness import quant
from harness.config import CONF_DIR, QuantConfig, compose
from harness.quant.format_table import SchemeError

# Presets of the other methods need their modules registered (harness.quant.__init__ does it once wired).
for _method in ("gptq", "awq", "kv"):
    if importlib.util.find_spec(f"harness.quant.{_method}") is not None:
        importlib.import_module(f"harness.quant.{_method}")

PRESETS = sorted(p.stem for p in (CONF_DIR / "quant").glob("*.yaml"))
REQUIRED = {"fp8", "fp8_w8a16", "fp8_block", "fp8_static", "int8_w8a8_sq", "int8_w8a8", "nvfp4", "nvfp4_w4a16",
            "mxfp4", "mxfp4_w4a16", "mxfp8", "int4_g32", "int4_g64", "int4", "int4_g128", "int8", "none"}


def scheme_of(*overrides: str) -> QuantConfig:
    cfg = OmegaConf.to_object(compose(["model=tiny_random", *overrides]))
    return quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups)


@pytest.fixture(scope="module")
def tiny_meta_model():
    """The tiny model's shapes on the meta device: validation needs shapes, not weights."""
    import torch

    from tiny_models import tiny_llama
    with torch.device("meta"):
        return tiny_llama(vocab_size=1024, hidden_size=128, seed=None)


def test_required_presets_exist():
    assert REQUIRED <= set(PRESETS), sorted(REQUIRED - set(PRESETS))


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_validates_and_fits_the_tiny_model(name, tiny_meta_model):
    scheme = scheme_of(f"quant={name}")
    assert scheme.name == name, f"conf/quant/{name}.yaml must set name: {name}"
    text = (CONF_DIR / "quant" / f"{name}.yaml").read_text()
    assert text.startswith("#"), f"conf/quant/{name}.yaml must open with a comment saying what it is"
    quant.validate_scheme(scheme)
    quant.validate_for_model(tiny_meta_model, scheme)
    if scheme.weights is not None or scheme.activations is not None:
        _, kept = quant.target_linears(tiny_meta_model, scheme)
        assert "lm_head" in kept  # high precision by default ...


def test_keep_patterns_are_overridable(tiny_meta_model):
    scheme = scheme_of("quant=fp8", "quant.keep=[lm_head,*down_proj]")
    targets, kept = quant.target_linears(tiny_meta_model, scheme)
    assert "model.layers.0.mlp.down_proj" in kept and "model.layers.0.mlp.down_proj" not in targets
    everything = scheme_of("quant=fp8", "quant.keep=[]")
    assert "lm_head" in quant.target_linears(tiny_meta_model, everything)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name,bits", [("fp8", 8 + 32 / 128), ("fp8_block", 8 + 32 / 128 ** 2), ("nvfp4", 4.5),
                                       ("mxfp4", 4.25), ("mxfp8", 8.25), ("int4_g32", 4.5), ("int4_g64", 4.25),
                                       ("int8_w8a8_sq", 8 + 16 / 128)])
def test_bits_per_weight_of_presets_on_a_128x128_layer(name, bits):
    from torch import nn
    layer = nn.Linear(128, 128, bias=False)
    scheme = scheme_of(f"quant={name}")
    # NVFP4's fp32 tensor scale adds 32 bits per matrix.
    extra = 32 / 128 ** 2 if name == "nvfp4" else 0.0
    assert quant.bits_for(scheme, layer) == pytest.approx(bits + extra)


# ----------------------------------------------------------------------------------- bad input
@pytest.mark.slow
@pytest.mark.parametrize("overrides,reason", [
    (["quant=nvfp4", "quant.weights.symmetric=false"], "asymmetric nvfp4 makes no sense"),
    (["quant=mxfp4", "quant.activations.symmetric=false"], "asymmetric mxfp4 makes no sense"),
    (["quant=fp8", "quant.weights.symmetric=false"], "asymmetric fp8_e4m3 makes no sense"),
    (["quant=nvfp4", "quant.activations.dynamic=false"], "static"),
    (["quant=nvfp4", "quant.weights.group_size=32"], "blocks are 16 elements"),
    (["quant=int4_g128", "quant.weights.format=int3"], "format='int3'"),
    (["quant=int4_g128", "quant.weights.bits=12"], "bits=12"),
    (["quant=int4_g128", "quant.method=magic"], "method='magic' is not registered"),
    (["quant=fp8", "quant.activations.granularity=channel"], "activations are quantized per token"),
])
def test_nonsense_schemes_are_refused_with_the_reason(overrides, reason):
    with pytest.raises(SchemeError, match=reason):
        quant.validate_scheme(scheme_of(*overrides))


@pytest.mark.parametrize("overrides", [["quant=int4_g128", "quant.weights.group_size=96"],
                                       ["quant=int8_w8a8", "quant.activations.granularity=group",
                                        "quant.activations.group_size=48"]])
def test_group_size_that_does_not_divide_the_tiny_model_is_refused(overrides, tiny_meta_model):
    scheme = scheme_of(*overrides)
    quant.validate_scheme(scheme)  # fine on its own ...
    with pytest.raises(SchemeError, match="does not divide the input size 128"):
        quant.validate_for_model(tiny_meta_model, scheme)  # ... but not for these shapes


def test_ragged_groups_opt_in_accepts_a_non_dividing_group(tiny_meta_model):
    scheme = scheme_of("quant=int4_g128", "quant.weights.group_size=96", "quant.weights.ragged_groups=true")
    quant.validate_for_model(tiny_meta_model, scheme)


def test_wrongly_typed_value_fails_when_the_config_is_built():
    with pytest.raises(ConfigCompositionException):
        compose(["model=tiny_random", "quant=fp8", "quant.weights.bits=eight"])
