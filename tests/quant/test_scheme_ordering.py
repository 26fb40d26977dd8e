"""On SmolLM2, KL(ref‖quant) on the math slice's divergence texts orders as the formats' resolution says:
int8 per-channel < fp8 (E4M3, 3 mantissa bits) < int4 group-128 < int4 per-channel."""
from __future__ import annotations

import copy
import os

import pytest
import torch
from omegaconf import OmegaConf

from harness import quant
from harness.divergence import scoring as divergence
from harness.models import loading as models
from harness.config import compose, load_model_config
from harness.planning.sensitivity import reference_texts

pytestmark = pytest.mark.slow
SCHEMES = ["int8", "fp8_w8a16", "fp8", "int4_g128", "int4"]


@pytest.fixture(scope="module")
def kl_by_scheme(one_thread) -> dict[str, float]:
    cache_dir = os.path.expanduser(os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness"))
    loaded = models.load(load_model_config("smollm2_135m"), cache_dir)
    cfg = OmegaConf.to_object(compose(["model=smollm2_135m", "slices=[math]"]))
    reference = reference_texts(loaded, cfg, 12)
    kls = {}
    for name in SCHEMES:
        scheme = OmegaConf.to_object(compose(["model=smollm2_135m", f"quant={name}"])).quant
        model = copy.deepcopy(loaded.model)
        quant.apply(model, quant.with_model_defaults(scheme, True), None)  # 576 = 4.5 x 128: ragged last group
        with torch.no_grad():
            kls[name] = float(divergence.compare_to_reference(model, reference, "math")["kl"].mean())
        del model
    print("KL(ref||quant) on SmolLM2 math texts:", kls)
    return kls


def test_kl_orders_int8_fp8_int4_g128_int4(kl_by_scheme):
    kl = kl_by_scheme
    assert 0 < kl["int8"] < kl["fp8"] < kl["int4_g128"] < kl["int4"], kl


def test_fp8_activations_add_to_the_fp8_weight_error(kl_by_scheme):
    assert kl_by_scheme["int8"] < kl_by_scheme["fp8_w8a16"] < kl_by_scheme["fp8"], kl_by_scheme
