"""AWQ: scale formula, exact folding with rounding off, α=0 → RTN, clipping, whole-model runs."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaForCausalLM

from harness.config import QuantConfig, TensorQuantConfig
from harness.quant import QuantReport
from harness.quant.awq import (AWQSettings, candidate_scales, coarse_to_fine_steps, quantize_awq, search_clip,
                               search_scales, weight_mean)
from harness.quant.rtn import quantize_weights_rtn
from harness.quant.format_table import fake_quantize
from tiny_models import tiny_llama


pytestmark = pytest.mark.usefixtures("one_thread")


ASYM = TensorQuantConfig(format="int", bits=4, symmetric=False, granularity="group", group_size=32)
SYM = TensorQuantConfig(format="int", bits=4, symmetric=True, granularity="group", group_size=32)
# 64 = 48 + 16 and 128 = 48 + 48 + 32: shorter last groups (as SmolLM2's 576 inputs with group 128).
RAGGED = TensorQuantConfig(format="int", bits=4, symmetric=False, granularity="group", group_size=48,
                           ragged_groups=True)


def outlier_llama(kv_heads: int = 4, seed: int = 0) -> LlamaForCausalLM:
    model = tiny_llama(vocab_size=128, kv_heads=kv_heads, seed=seed, max_position_embeddings=128)
    with torch.no_grad():  # outlier channels, as real models have, so that scales matter
        for layer in model.model.layers:
            layer.input_layernorm.weight[:4] = 8.0
            layer.post_attention_layernorm.weight[4:8] = 6.0
    return model


def tiny_gemma(seed: int = 0) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, head_dim=16, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    return model


def _tokens(n: int = 12, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(seed))


def _scheme(spec: TensorQuantConfig = ASYM, **awq_settings) -> QuantConfig:
    return QuantConfig(name="awq_test", method="awq", weights=spec, settings=awq_settings)


def test_candidate_scales_by_hand() -> None:
    """mean|x| = [1, 4, 16], α = 1/2 → [1, 2, 4], divided by sqrt(4 · 1) = 2."""
    torch.testing.assert_close(candidate_scales(torch.tensor([1.0, 4.0, 16.0]), 0.5), torch.tensor([0.5, 1.0, 2.0]))
    torch.testing.assert_close(candidate_scales(torch.tensor([0.0, 3.0]), 0.0), torch.tensor([1.0, 1.0]))


def test_weight_mean_by_hand() -> None:
    """Rows normalised per group of 2 by their max: [0.5, 1] and [1, 0] → column means [0.75, 0.5]."""
    spec = TensorQuantConfig(format="int", bits=4, granularity="group", group_size=2)
    got = weight_mean([torch.tensor([[1.0, -2.0]]), torch.tensor([[4.0, 0.0]])], spec)
    torch.testing.assert_close(got, torch.tensor([0.75, 0.5]), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family,kv_heads", [("llama", 4), ("llama", 2), ("gemma3", 4)])
@pytest.mark.parametrize("duo_scaling", [False, True])
@torch.no_grad()
def test_folding_is_an_exact_equivalence_with_rounding_off(family: str, kv_heads: int, duo_scaling: bool) -> None:
    model = outlier_llama(kv_heads) if family == "llama" else tiny_gemma()
    tokens = _tokens()
    before = model(tokens).logits
    outcome = quantize_awq(model, _scheme(duo_scaling=duo_scaling), tokens, "cpu", QuantReport("a", "awq"),
                           batch_size=4, search_samples=4, apply_quantization=False)
    moved = max(float((s - 1).abs().max()) for s in outcome.input_scales.values())
    assert moved > 0.05, "the searched scales are trivial: the test would not exercise folding"
    torch.testing.assert_close(model(tokens).logits, before, rtol=1e-4, atol=1e-4)
    folded_into_v = any(name.endswith("v_proj") for name in outcome.output_scales)
    assert folded_into_v == (kv_heads == 4)  # v→o only without grouped-query attention


@pytest.mark.parametrize("spec", [ASYM, SYM, RAGGED], ids=["asym", "sym", "ragged"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@torch.no_grad()
def test_single_alpha_zero_and_no_clip_equals_rtn(spec: TensorQuantConfig, family: str) -> None:
    build = outlier_llama if family == "llama" else tiny_gemma
    awq_model, rtn_model = build(), build()
    scheme = _scheme(spec, grid=1, clip=False)
    outcome = quantize_awq(awq_model, scheme, _tokens(), "cpu", QuantReport("a", "awq"), batch_size=4)
    assert set(outcome.ratios.values()) == {0.0}
    quantize_weights_rtn(rtn_model, QuantConfig(name="rtn", method="rtn", weights=spec), QuantReport("r", "rtn"))
    for (name, a), (_, b) in zip(awq_model.named_parameters(), rtn_model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@torch.no_grad()
def test_search_prefers_activation_aware_scales_on_outlier_inputs() -> None:
    """A few input channels 30× larger than the rest: protecting them beats RTN clearly."""
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48, bias=False)
    linear.weight.data = torch.randn(48, 64, generator=g)
    original = linear.weight.detach().clone()
    x = torch.randn(512, 64, generator=g)
    x[:, :3] *= 30.0
    result = search_scales([linear], [True], lambda: [linear(x)], x.abs().mean(0), SYM, grid=20, duo_scaling=False)
    assert result.ratio > 0
    assert result.losses[int(result.ratio * 20)] < 0.7 * result.losses[0]
    assert torch.equal(linear.weight.data, original)  # the search leaves the weights as it found them


@torch.no_grad()
def test_a_given_reference_output_saves_one_inspect_call_and_changes_nothing() -> None:
    g = torch.Generator().manual_seed(2)
    linear = nn.Linear(64, 48, bias=False)
    linear.weight.data = torch.randn(48, 64, generator=g)
    x = torch.randn(256, 64, generator=g)
    x[:, :2] *= 20.0
    calls = []

    def inspect() -> list[torch.Tensor]:
        calls.append(1)
        return [linear(x)]

    plain = search_scales([linear], [True], inspect, x.abs().mean(0), SYM, grid=10, duo_scaling=False)
    assert len(calls) == 11
    calls.clear()
    given = search_scales([linear], [True], inspect, x.abs().mean(0), SYM, grid=10, duo_scaling=False,
                          reference=[x @ linear.weight.t()])
    assert len(calls) == 10
    assert given.ratio == plain.ratio and torch.equal(given.scales, plain.scales)
    np.testing.assert_allclose(given.losses, plain.losses, rtol=1e-6)


@pytest.mark.parametrize("grid", [20, 10, 7, 3, 1])
def test_coarse_to_fine_finds_the_minimum_of_every_single_minimum_curve(grid: int) -> None:
    """Against brute force: for each minimum position, V-shaped and skewed curves (with a plateau-free
    minimum), the coarse-to-fine steps contain the full grid's argmin, and for grid 20 only 11 are run."""
    for minimum in range(grid):
        for curve in (lambda s: abs(s - minimum), lambda s: (s - minimum) ** 2 * (3.0 if s > minimum else 0.5)):
            seen: list[int] = []
            steps = coarse_to_fine_steps(grid, lambda s: seen.append(s) or float(curve(s)))
            assert sorted(seen) == steps and len(set(seen)) == len(seen)  # each step evaluated once
            assert minimum in steps
            if grid == 20:
                assert len(steps) <= 11


def test_coarse_to_fine_misses_a_narrow_second_valley_between_coarse_steps() -> None:
    """Two valleys, the deeper one narrow and between coarse steps: the refined search keeps to the
    valley the coarse steps saw: exact only for single-minimum curves (measured on SmolLM2 before use)."""
    losses = {s: 1.0 + abs(s - 4) * 0.01 for s in range(20)} | {9: 0.5}
    steps = coarse_to_fine_steps(20, lambda s: losses[s])
    assert 9 not in steps and 4 in steps


@torch.no_grad()
def test_coarse_to_fine_search_scales_chooses_what_the_full_grid_chooses_with_fewer_calls() -> None:
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48, bias=False)
    linear.weight.data = torch.randn(48, 64, generator=g)
    x = torch.randn(512, 64, generator=g)
    x[:, :3] *= 30.0
    calls = []

    def inspect() -> list[torch.Tensor]:
        calls.append(1)
        return [linear(x)]

    reference = [x @ linear.weight.t()]
    full = search_scales([linear], [True], inspect, x.abs().mean(0), SYM, grid=20, duo_scaling=False,
                         reference=reference)
    assert len(calls) == 20
    calls.clear()
    quick = search_scales([linear], [True], inspect, x.abs().mean(0), SYM, grid=20, duo_scaling=False,
                          reference=reference, coarse_to_fine=True)
    assert len(calls) <= 11
    assert quick.ratio == full.ratio and torch.equal(quick.scales, full.scales)
    evaluated = [i for i, v in enumerate(quick.losses) if not np.isnan(v)]
    assert len(evaluated) == len(calls)
    np.testing.assert_array_equal(np.array(quick.losses)[evaluated], np.array(full.losses)[evaluated])


@torch.no_grad()
def test_clip_search_shrinks_an_outlier_weight_nobody_reads() -> None:
    """A weight outlier on an input that is always 0 only costs resolution: clipping it must win."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 32, generator=g)
    weight[:, 0] = 20.0
    inputs = torch.randn(256, 32, generator=g)
    inputs[:, 0] = 0.0
    bounds = search_clip(weight, inputs, SYM, grid=20, max_shrink=0.5)
    assert bounds.shape == weight.shape
    assert torch.all(bounds < 20.0 * 0.75)
    unclipped = search_clip(weight, inputs, SYM, grid=20, max_shrink=0.0)
    torch.testing.assert_close(unclipped, weight.abs().amax(dim=1, keepdim=True).expand_as(weight))
    ragged = search_clip(weight, inputs, RAGGED, grid=20, max_shrink=0.0)  # 32 columns: one short group
    torch.testing.assert_close(ragged, unclipped)
    wide = torch.cat([weight, weight[:, :16]], dim=1)  # 48 columns = one full group of 48
    two = search_clip(torch.cat([wide, weight[:, :16]], dim=1), torch.randn(64, 64, generator=g), RAGGED, grid=20,
                      max_shrink=0.0)
    torch.testing.assert_close(two[:, :48], wide.abs().amax(dim=1, keepdim=True).expand(-1, 48))
    torch.testing.assert_close(two[:, 48:], weight[:, :16].abs().amax(dim=1, keepdim=True).expand(-1, 16))


@torch.no_grad()
def test_ragged_groups_with_clipping_stay_on_the_grid() -> None:
    model = outlier_llama()
    quantize_awq(model, _scheme(RAGGED), _tokens(), "cpu", QuantReport("a", "awq"), batch_size=4, search_samples=4)
    down = model.model.layers[0].mlp.down_proj.weight  # 128 inputs: groups 48, 48, 32
    for start, end in ((0, 48), (48, 96), (96, 128)):
        assert max(len(torch.unique(row[start:end])) for row in down) <= 16


@torch.no_grad()
def test_awq_model_beats_rtn_on_outlier_model_and_reports_effective_weights() -> None:
    reference = outlier_llama()
    awq_model, rtn_model = copy.deepcopy(reference), copy.deepcopy(reference)
    report = QuantReport("awq", "awq")
    quantize_awq(awq_model, _scheme(), _tokens(16), "cpu", report, batch_size=4, search_samples=8)
    quantize_weights_rtn(rtn_model, QuantConfig(name="rtn", method="rtn", weights=ASYM), QuantReport("r", "rtn"))
    held_out = _tokens(8, seed=3)
    logits = reference(held_out).logits
    awq_error = float((awq_model(held_out).logits - logits).pow(2).mean())
    rtn_error = float((rtn_model(held_out).logits - logits).pow(2).mean())
    assert awq_error < rtn_error
    assert len(report.layers) == 14
    # The report compares the original weight with the effective one (scales undone): close, not scaled.
    assert all(5.0 < layer.sqnr_db < 40.0 for layer in report.layers)
    q_proj = awq_model.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_proj, fake_quantize(reference.model.layers[0].self_attn.q_proj.weight, ASYM))


@torch.no_grad()
def test_search_samples_comes_from_the_config_and_bad_settings_fail_at_config_time() -> None:
    from dataclasses import dataclass

    from harness import quant
    from harness.quant import awq as awq_mod
    from harness.quant.format_table import SchemeError

    @dataclass
    class Context:
        token_set: torch.Tensor
        device: torch.device = torch.device("cpu")
        batch_size: int = 4

        def tokens(self) -> torch.Tensor:
            return self.token_set

    assert AWQSettings().search_samples == 4  # the default (measured on SmolLM2: benchmarks/results/awq_search.json)
    seen = []

    def search_scales(linears, quantize, inspect, *args, **kwargs):  # sequences the α loss is measured on
        seen.append(sum(out.shape[0] for out in inspect()))
        return real(linears, quantize, inspect, *args, **kwargs)

    real = awq_mod.search_scales
    for samples, expected in ((4, 4), (0, 12)):  # 0: every sequence
        scheme = _scheme()
        scheme.settings["search_samples"] = samples
        seen.clear()
        awq_mod.search_scales = search_scales
        try:
            quant.apply(outlier_llama(), scheme, Context(_tokens(12)))
        finally:
            awq_mod.search_scales = real
        assert set(seen) == {expected}
    for field, value in (("grid", 0), ("clip_grid", 0), ("search_samples", -1), ("max_shrink", 1.5)):
        scheme = _scheme()
        scheme.settings[field] = value
        with pytest.raises(SchemeError, match=f"quant.settings.{field}={value}"):
            quant.validate_scheme(scheme)


def test_cache_key_keeps_full_grid_entries_and_separates_coarse_to_fine() -> None:
    """The full grid's key is the one from before the option existed (its settings without the field);
    coarse-to-fine gets its own key."""
    import dataclasses

    from harness.infra.cache import stable_hash
    from harness.quant.calibrated_cache import ALGORITHM_VERSION, calibrated_key

    full = _scheme(coarse_to_fine=False)
    before = {"method": "awq", "weights": dataclasses.asdict(full.weights), "targets": list(full.targets),
              "keep": list(full.keep), "version": ALGORITHM_VERSION,
              "settings": {k: v for k, v in dataclasses.asdict(AWQSettings(coarse_to_fine=False)).items()
                           if k != "coarse_to_fine"}}
    if before["weights"].get("int_range") == "restricted":
        del before["weights"]["int_range"]
    assert calibrated_key("m", full, "h") == stable_hash({"model": "m", "scheme": before, "calibration": "h"}, 24)
    quick = _scheme()  # coarse-to-fine is the default
    assert AWQSettings().coarse_to_fine
    assert calibrated_key("m", quick, "h") != calibrated_key("m", full, "h")


@torch.no_grad()
@pytest.mark.parametrize("coarse_to_fine", [True, False])
def test_whole_model_search_follows_the_coarse_to_fine_setting(coarse_to_fine: bool) -> None:
    from harness.quant import awq as awq_mod

    calls: list[int] = []
    real = awq_mod.search_scales

    def search_scales(linears, quantize, inspect, *args, **kwargs):
        counted = lambda: calls.append(1) or inspect()  # noqa: E731
        return real(linears, quantize, counted, *args, **kwargs)

    awq_mod.search_scales = search_scales
    try:
        quantize_awq(outlier_llama(), _scheme(coarse_to_fine=coarse_to_fine), _tokens(8), "cpu",
                     QuantReport("a", "awq"), batch_size=4, search_samples=4)
    finally:
        awq_mod.search_scales = real
    groups = 2 * 4  # two blocks; without grouped-query attention v→o is searched too
    if coarse_to_fine:
        assert groups * 8 <= len(calls) <= groups * 11  # 5 coarse points + 3 to 6 around the best
    else:
        assert len(calls) == groups * 20
