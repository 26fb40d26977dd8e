"""Method specs: traits the harness asks instead of method names; a method added as CONTRIBUTING.md says, from one
module and one scheme YAML, runs a job and exports."""
from __future__ import annotations

import json
import math
import re
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from harness import quant
from harness.config import QuantConfig, compose
from harness.errors import UsageError
from harness.quant import SchemeError, unregister_method
from tests.conftest import TINY_MATH


def scheme_of(*overrides: str) -> QuantConfig:
    return quant.with_model_defaults(OmegaConf.to_object(compose(["model=tiny_random", *overrides])).quant, False)


@pytest.mark.slow
@pytest.mark.parametrize("preset, passes", [
    ("int4_g128", []), ("none", []), ("fp8", []),
    ("kv8", ["static KV-cache scales"]), ("fp8_static", ["static activation scales"]),
    ("int4_g128_kv8", ["static KV-cache scales"]), ("gptq_w4g128", ["quant.method=gptq"]),
    ("gptq_w4g128_kv8", ["quant.method=gptq", "static KV-cache scales"]), ("awq_w4g128", ["quant.method=awq"]),
    ("int8_w8a8_sq", ["quant.method=smoothquant"]),
])
def test_calibration_passes_follow_the_scheme_not_the_method_name(preset, passes):
    found = [what for what, _ in quant.calibration_passes(scheme_of(f"quant={preset}"))]
    assert [f.split(" (")[0] for f in found] == passes


@pytest.mark.slow
def test_a_missing_calibration_context_is_refused_before_any_weight_changes():
    from tiny_models import tiny_llama
    model = tiny_llama(hidden_size=128, layers=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for preset in ("fp8_static", "kv8", "gptq_w4g128", "int8_w8a8_sq"):
        with pytest.raises(SchemeError, match="needs calibration data"):
            quant.apply(model, scheme_of(f"quant={preset}"), None)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear  # no activation quantizer installed


@pytest.mark.slow
def test_settings_and_plugins_are_checked_with_the_reason():
    with pytest.raises(SchemeError, match=r"quant.settings for method gptq: .*damp.*its settings are \['damp_percent'"):
        quant.validate_scheme(scheme_of("quant=gptq_w4g128", "+quant.settings.damp=0.1"))
    with pytest.raises(SchemeError, match="takes no settings"):
        quant.validate_scheme(scheme_of("quant=int8", "+quant.settings.alpha=0.1"))
    with pytest.raises(SchemeError, match="cannot import 'no_such_plugin_module'"):
        quant.validate_scheme(scheme_of("quant=int8", "quant.plugins=[no_such_plugin_module]"))
    with pytest.raises(SchemeError, match="alpha=1.5"):  # a spec's own check runs at config time
        quant.validate_scheme(scheme_of("quant=int8_w8a8_sq", "quant.settings.alpha=1.5"))
    assert quant.method_settings(scheme_of("quant=gptq_w4g128", "quant.settings.damp_percent=0.1")).damp_percent == 0.1


def test_the_former_method_sections_are_refused_naming_the_new_key():
    for old, new in (("quant.gptq.damp_percent=0.1", "quant.settings.damp_percent"),
                     ("quant.awq.grid=10", "quant.settings.grid"),
                     ("quant.smoothquant.alpha=0.8", "quant.settings.alpha")):
        with pytest.raises(UsageError, match=rf"^{re.escape(old.split('=')[0])} moved: .*; use {re.escape(new)}$"):
            compose(["model=tiny_random", "quant=gptq_w4g128", old])


@pytest.mark.slow
def test_plan_counts_calibration_of_static_scales_under_rtn(tmp_path, cache_dir):
    from harness.planning import plan as plan_mod

    overrides = [*TINY_MATH, f"paths.results_dir={tmp_path / 'results'}", f"paths.cache_dir={cache_dir}",
                 "tracking.enabled=false", "quant=int4_g128,kv8,fp8_static,gptq_w4g128_kv8"]
    plan = plan_mod.plan_sweep(overrides, tokens_per_s=1000.0, decode_tokens_per_s=100.0)
    calibration = {job.scheme: job.calibration for job in plan.jobs}
    # kv8 and fp8_static use method rtn but calibrate static scales on 16 x 512 tokens; GPTQ + static KV: two passes.
    assert calibration == {"int4_g128": 0, "kv8": 16 * 512, "fp8_static": 16 * 512, "gptq_w4g128_kv8": 2 * 128 * 512}
    by_scheme = {job.scheme: job for job in plan.jobs}
    assert by_scheme["kv8"].estimated_s - by_scheme["int4_g128"].estimated_s == pytest.approx(16 * 512 / 1000.0)


# CONTRIBUTING.md, "A quantization method", followed to the letter: one module that calls
# harness.quant.register_method (its settings dataclass beside it), then one scheme YAML that lists the module in
# plugins: and puts the method's settings under settings:.
TOY_METHOD = '''
"""A toy calibrated method: clip each weight row at a fraction of its maximum, then round to nearest."""
from dataclasses import dataclass

import torch

from harness.quant import (COMPRESSED_TENSORS, bits_for, fake_quantize, method_settings, register_method,
                           target_linears)


@dataclass
class ClipSettings:
    fraction: float = 0.9  # rows are clipped at fraction * max|row| before rounding


@register_method("toy_clip", settings=ClipSettings, needs=("batches",), cacheable=True, weight_formats=("int",),
                 exports=(COMPRESSED_TENSORS,))
@torch.no_grad()
def toy_clip(model, scheme, context, report):
    settings = method_settings(scheme)
    assert context.calibration_batches()  # the context reached the method
    changed = []
    for name, module in target_linears(model, scheme)[0].items():
        weight = module.weight.data
        bound = settings.fraction * weight.abs().amax(dim=1, keepdim=True)
        quantized = fake_quantize(torch.maximum(torch.minimum(weight, bound), -bound), scheme.weights)
        report.add_layer(name, weight, quantized, bits_for(scheme, module))
        module.weight.data = quantized
        changed.append(f"{name}.weight")
    return changed
'''

TOY_YAML = '''
# A method registered outside the package: its module is imported from quant.plugins.
name: toy_clip_w4g128
method: toy_clip
plugins: [toy_clip_method]
weights: {format: int, bits: 4, symmetric: true, granularity: group, group_size: 128}
settings: {fraction: 0.75}
calibration: {num_samples: 4, seq_len: 64}
'''


@pytest.fixture
def toy_method(tmp_path, monkeypatch):
    """The recipe's two files in tmp_path: the module on the import path, the YAML on Hydra's search path."""
    (tmp_path / "toy_clip_method.py").write_text(textwrap.dedent(TOY_METHOD))
    (tmp_path / "conf" / "quant").mkdir(parents=True)
    (tmp_path / "conf" / "quant" / "toy_clip.yaml").write_text(TOY_YAML)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"hydra.searchpath=[file://{tmp_path / 'conf'}]"
    unregister_method("toy_clip")
    sys.modules.pop("toy_clip_method", None)


@pytest.mark.slow
def test_a_method_added_as_contributing_says_runs_a_job_and_exports(toy_method, make_cfg, tmp_path, cache_dir):
    from harness.checkpoint import export as export_mod
    from harness.job import pipeline as run_mod
    from harness.models import loading as models
    from harness.sizing.report_quant import prepare

    with pytest.raises(SchemeError, match="fraction"):  # its settings are checked against its dataclass
        quant.validate_scheme(scheme_of(toy_method, "quant=toy_clip", "quant.settings.fraction=lots"))
    result = run_mod.run(make_cfg(*TINY_MATH, toy_method, "quant=toy_clip", "tracking.enabled=false"))
    assert (result["method"], result["scheme"]) == ("toy_clip", "toy_clip_w4g128")
    assert result["quant"]["bits_per_weight"] == pytest.approx(4.125) and result["metrics"]["math/kl_mean"] > 0
    assert len(list((cache_dir / "calibrated").glob("*/shards.json"))) == 1  # cacheable: stored
    layers = pd.read_parquet(next((tmp_path / "results").glob("*")) / "quant_layers.parquet").set_index("name")
    # SQNR of one layer recomputed with numpy from a fresh copy of the seeded tiny model.
    cfg = OmegaConf.to_object(compose(["model=tiny_random"]))
    name = "model.layers.1.mlp.down_proj"
    w = models.load(cfg.model, cache_dir).model.get_submodule(name).weight.detach().double().numpy()
    bound = 0.75 * np.abs(w).max(axis=1, keepdims=True)
    groups = np.clip(w, -bound, bound).reshape(w.shape[0], -1, 128)
    scale = np.abs(groups).max(axis=2, keepdims=True) / 7
    q = (np.clip(np.round(groups / scale), -7, 7) * scale).reshape(w.shape)
    expected = 10 * math.log10((w ** 2).sum() / ((w - q) ** 2).sum())
    assert layers.loc[name, "sqnr_db"] == pytest.approx(expected, abs=0.01)
    assert len(layers) == 14
    # Its registration says its weights map to compressed-tensors: the export writes them (as python -m
    # harness.export does, from the job's calibrated-weight cache entry) and reads back the harness's weights exactly.
    prepared = prepare(OmegaConf.to_object(make_cfg(*TINY_MATH, toy_method, "quant=toy_clip")))
    report = quant.apply(prepared.loaded.model, prepared.scheme, prepared.context)
    assert any("loaded from cache" in note for note in report.notes)
    targets, kept = quant.target_linears(prepared.loaded.model, prepared.scheme)
    written = export_mod.export(prepared.loaded.model, None, prepared.scheme, tmp_path / "export", targets=targets,
                                kept=kept)
    assert len(written.quantized) == 14 and written.max_abs_weight_error == 0
    qconfig = json.loads((tmp_path / "export" / "config.json").read_text())["quantization_config"]
    assert qconfig["format"] == "pack-quantized" and qconfig["config_groups"]["group_0"]["weights"]["group_size"] == 128


def test_toy_method_settings_shape_its_calibrated_cache_key(toy_method):
    from harness.quant.calibrated_cache import calibrated_key

    base = scheme_of(toy_method, "quant=toy_clip")
    quant.validate_scheme(base)  # imports the plugin, which registers the method
    keys = {calibrated_key("m", scheme_of(toy_method, "quant=toy_clip", f"quant.settings.fraction={f}"), "h")
            for f in (0.75, 0.5)}
    assert calibrated_key("m", base, "h") in keys and len(keys) == 2
    assert quant.method_settings(base).fraction == 0.75
    assert quant.get_method("toy_clip").calibrated and quant.get_method("rtn").needs == frozenset()
    assert quant.get_method("toy_clip").exports == {quant.COMPRESSED_TENSORS}
