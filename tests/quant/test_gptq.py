"""GPTQ: hand-checkable cases against RTN on the same grid, damping, sequential driver, cache, presets."""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from harness import quant
from harness.infra.cache import Cache
from harness.config import QuantConfig, TensorQuantConfig, compose
from harness.quant import gptq
from harness.quant import QuantReport, validate_scheme
from harness.quant.calibrated_cache import calibrated_key
from harness.quant.gptq import GPTQSettings, HessianAccumulator, gptq_quantize_weight, quantize_gptq
from harness.quant.format_table import fake_quantize
from tiny_models import tiny_llama


pytestmark = pytest.mark.usefixtures("one_thread")


SPECS = {
    "sym_g32": TensorQuantConfig(format="int", bits=4, symmetric=True, granularity="group", group_size=32),
    "asym_g32": TensorQuantConfig(format="int", bits=4, symmetric=False, granularity="group", group_size=32),
    "sym_channel": TensorQuantConfig(format="int", bits=4, symmetric=True, granularity="channel"),
    "int8_g64": TensorQuantConfig(format="int", bits=8, symmetric=True, granularity="group", group_size=64),
    # 128 inputs = 48 + 48 + 32: a shorter last group, as SmolLM2's 576 = 4·128 + 64 needs.
    "ragged_g48": TensorQuantConfig(format="int", bits=4, symmetric=False, granularity="group", group_size=48,
                                    ragged_groups=True),
}


def _weight(rows: int = 48, columns: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed))


def _correlated_inputs(tokens: int = 2048, columns: int = 128, rank: int = 8, seed: int = 1) -> torch.Tensor:
    """Inputs living near an 8-dimensional subspace: rounding errors can be steered out of it."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(tokens, rank, generator=g)
    mixing = torch.randn(rank, columns, generator=g)
    return latent @ mixing + 0.05 * torch.randn(tokens, columns, generator=g)


def _output_error(quantized: torch.Tensor, weight: torch.Tensor, inputs: torch.Tensor) -> float:
    return float(((quantized - weight) @ inputs.T).pow(2).mean())


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("act_order", [False, True])
def test_identity_hessian_gives_rtn_exactly(name: str, act_order: bool) -> None:
    """With H ∝ I no error is propagated: every column is rounded on RTN's own grid."""
    weight = _weight()
    result = gptq_quantize_weight(weight, 3.0 * torch.eye(128), SPECS[name], act_order=act_order, block_size=32)
    torch.testing.assert_close(result.quantized, fake_quantize(weight, SPECS[name]), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["sym_g32", "asym_g32", "sym_channel", "ragged_g48"])
@pytest.mark.parametrize("act_order,static_groups", [(False, True), (False, False), (True, True), (True, False)])
def test_correlated_inputs_gptq_error_well_below_rtn(name: str, act_order: bool, static_groups: bool) -> None:
    weight, inputs = _weight(), _correlated_inputs()
    accumulator = HessianAccumulator(128, "cpu")
    for chunk in inputs.split(500):
        accumulator.add_batch(chunk)
    hessian = accumulator.hessian()
    result = gptq_quantize_weight(weight, hessian, SPECS[name], act_order=act_order, static_groups=static_groups)
    rtn_error = _output_error(fake_quantize(weight, SPECS[name]), weight, inputs)
    gptq_error = _output_error(result.quantized, weight, inputs)
    assert gptq_error < 0.5 * rtn_error, (gptq_error, rtn_error)
    # Every (row, group) lies on a 4-bit grid of at most 16 levels; act-order without static groups
    # groups consecutive columns in the order of descending Hessian diagonal.
    order = torch.argsort(torch.diagonal(hessian), descending=True) if act_order and not static_groups else slice(None)
    size = {"sym_g32": 32, "asym_g32": 32, "sym_channel": 128, "ragged_g48": 48}[name]
    ordered = result.quantized[:, order]
    distinct = max(len(torch.unique(ordered[r, g:g + size])) for r in range(48) for g in range(0, 128, size))
    assert distinct <= 16


def test_hessian_matches_float64_reference() -> None:
    inputs = torch.randn(3, 40, 16, generator=torch.Generator().manual_seed(2))
    accumulator = HessianAccumulator(16, "cpu")
    accumulator.add_batch(inputs[:2])
    accumulator.add_batch(inputs[2:])
    x = inputs.reshape(-1, 16).double().numpy()
    np.testing.assert_allclose(accumulator.hessian().numpy(), 2.0 / len(x) * x.T @ x, rtol=1e-5, atol=1e-5)


def test_banded_hessian_over_several_bands_matches_float64_reference_and_is_symmetric() -> None:
    # 300 columns: bands of 128, 128 and a ragged 44, so only the lower triangle is accumulated.
    inputs = torch.randn(2, 64, 300, generator=torch.Generator().manual_seed(4))
    accumulator = HessianAccumulator(300, "cpu")
    assert accumulator.band < 300
    for batch in inputs:
        accumulator.add_batch(batch)
    hessian = accumulator.hessian()
    x = inputs.reshape(-1, 300).double().numpy()
    np.testing.assert_allclose(hessian.numpy(), 2.0 / len(x) * x.T @ x, rtol=1e-5, atol=1e-5)
    assert torch.equal(hessian, hessian.t())


@pytest.mark.parametrize("name", ["sym_g32", "asym_g32", "sym_channel", "ragged_g48"])
@pytest.mark.parametrize("act_order", [False, True])
def test_stacked_solve_of_a_shared_input_group_equals_separate_solves(name: str, act_order: bool) -> None:
    # q/k/v read one input: solved as one stacked weight they must get what each gets alone.
    inputs = _correlated_inputs()
    hessian = 2.0 / len(inputs) * inputs.T @ inputs
    generator = torch.Generator().manual_seed(5)
    modules = [torch.nn.Linear(128, rows, bias=False) for rows in (48, 16, 16)]
    for module in modules:
        module.weight.data = torch.randn(module.out_features, 128, generator=generator)
    settings = GPTQSettings(act_order=act_order)
    solved = gptq._solve_stage("b", ["q", "k", "v"], modules, hessian, SPECS[name], settings)
    assert [full for full, _, _ in solved] == ["b.q", "b.k", "b.v"]
    for (_, module, result) in solved:
        alone = gptq_quantize_weight(module.weight.data, hessian, SPECS[name], act_order=act_order)
        torch.testing.assert_close(result.quantized, alone.quantized, rtol=0, atol=1e-6)


def test_per_tensor_grids_are_solved_one_linear_at_a_time() -> None:
    inputs = _correlated_inputs()
    hessian = 2.0 / len(inputs) * inputs.T @ inputs
    spec = TensorQuantConfig(format="int", bits=4, symmetric=True, granularity="tensor")
    modules = [torch.nn.Linear(128, 32, bias=False) for _ in range(2)]
    modules[1].weight.data *= 10  # a stacked per-tensor grid would coarsen the first weight's
    solved = gptq._solve_stage("b", ["gate", "up"], modules, hessian, spec, GPTQSettings())
    for (_, module, result) in solved:
        alone = gptq_quantize_weight(module.weight.data, hessian, spec)
        assert torch.equal(result.quantized, alone.quantized)


def test_dead_columns_get_zero_weight() -> None:
    inputs = _correlated_inputs()
    inputs[:, [5, 70]] = 0.0
    hessian = 2.0 / len(inputs) * inputs.T @ inputs
    result = gptq_quantize_weight(_weight(), hessian, SPECS["sym_g32"])
    assert result.dead_columns == 2
    assert torch.all(result.quantized[:, [5, 70]] == 0)


def test_singular_hessian_without_damping_warns_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    vector = torch.randn(128, generator=torch.Generator().manual_seed(3))
    singular = torch.outer(vector, vector)  # rank 1, no zero diagonal: no dead column to rescue it
    with caplog.at_level(logging.WARNING, logger="harness.quant.gptq"):
        result = gptq_quantize_weight(_weight(), singular, SPECS["sym_g32"], damp_percent=0.0, name="probe")
    assert result.damp_percent > 0
    assert any("Cholesky" in r.message and "probe" in r.message for r in caplog.records)
    assert torch.isfinite(result.quantized).all()


def test_non_finite_hessian_is_an_error() -> None:
    hessian = torch.eye(128)
    hessian[3, 3] = float("nan")
    with pytest.raises(RuntimeError, match="NaN"):
        gptq_quantize_weight(_weight(), hessian, SPECS["sym_g32"])


# --------------------------------------------------------------------------------- whole model
llama = partial(tiny_llama, vocab_size=128, max_position_embeddings=128)


def _tokens(n: int = 16, length: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(seed))


def _scheme(method: str = "gptq", **gptq_settings) -> QuantConfig:
    return QuantConfig(name=f"{method}_test", method=method, weights=SPECS["sym_g32"],
                       settings=gptq_settings)


@dataclass
class FakeContext:
    """The part of CalibrationContext the methods use, without a tokenizer."""

    token_set: torch.Tensor
    cache: Cache | None = None
    model_key: str = "tiny"
    device: torch.device = torch.device("cpu")
    batch_size: int = 4

    def tokens(self) -> torch.Tensor:
        return self.token_set

    @property
    def calibration_hash(self) -> str:
        return str(hash(tuple(self.token_set.flatten().tolist())))


@torch.no_grad()
def test_sequential_gptq_quantizes_every_block_linear_and_beats_rtn_on_its_inputs() -> None:
    model = llama()
    tokens = _tokens()
    reference = copy.deepcopy(model)
    report = QuantReport(scheme="gptq_test", method="gptq")
    changed = quantize_gptq(model, _scheme(), tokens, "cpu", report, batch_size=4)
    assert len(changed) == len(report.layers) == 14
    rtn = copy.deepcopy(reference)
    quant.apply(rtn, QuantConfig(name="rtn", method="rtn", weights=SPECS["sym_g32"]))
    held_out = _tokens(seed=5)
    logits = reference(held_out).logits
    gptq_error = float((model(held_out).logits - logits).pow(2).mean())
    rtn_error = float((rtn(held_out).logits - logits).pow(2).mean())
    assert gptq_error < rtn_error


@torch.no_grad()
def test_each_block_is_fed_by_the_quantized_blocks_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block 1's Hessians come from quantized block 0's outputs, not from the full-precision ones."""
    from harness.quant.architectures import LLAMA, capture_block_inputs, make_batches, run_block

    model, tokens = llama(), _tokens(8)
    full_precision = copy.deepcopy(model)
    seen: dict[int, list[torch.Tensor]] = {}
    from harness.quant import architectures as adapters
    run = adapters.run_block

    def spy(block, hidden, extra):
        seen.setdefault(id(block), []).append(hidden.clone())
        return run(block, hidden, extra)

    monkeypatch.setattr(adapters, "run_block", spy)
    quantize_gptq(model, _scheme(), tokens, "cpu", QuantReport("g", "gptq"), batch_size=4)
    monkeypatch.setattr(adapters, "run_block", run)
    block1_inputs = seen[id(model.model.layers[1])]
    for source, should_match in ((model, True), (full_precision, False)):
        captured = capture_block_inputs(source, LLAMA, make_batches(tokens, 4), torch.device("cpu"))
        outputs = [run_block(source.model.layers[0], h, e) for h, e in zip(captured.hidden, captured.extras[0])]
        matches = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(outputs, block1_inputs))
        assert matches == should_match


@torch.no_grad()
def test_apply_uses_and_fills_the_calibrated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    context = FakeContext(_tokens(), cache=Cache(tmp_path))
    first = llama()
    report = quant.apply(first, _scheme(), context)
    assert len(report.layers) == 14 and "stored" in report.notes[-1]

    def fail(*_args, **_kwargs):
        raise AssertionError("calibration ran again despite a cached entry")

    monkeypatch.setattr(gptq, "quantize_gptq", fail)
    second = llama()
    again = quant.apply(second, _scheme(), context)
    assert "loaded" in again.notes[-1]
    assert [l.sqnr_db for l in again.layers] == [l.sqnr_db for l in report.layers]
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_cache_key_ignores_kv_and_name_but_not_the_weights() -> None:
    base = _scheme()
    renamed = copy.deepcopy(base)
    renamed.name = "other"
    regrouped = copy.deepcopy(base)
    regrouped.weights = SPECS["asym_g32"]
    reordered = _scheme(act_order=True)
    keys = [calibrated_key("m", s, "h") for s in (base, renamed, regrouped, reordered)]
    assert keys[0] == keys[1] and len(set(keys)) == 3
    assert calibrated_key("m", base, "h") != calibrated_key("m", base, "other-calibration")


PRESETS = {
    "gptq_w4g128": ("gptq", True, False),
    "gptq_w4g128_actorder": ("gptq", True, True),
    "awq_w4g128": ("awq", False, False),
    "gptq_w4g128_kv8": ("gptq", True, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_compose_and_validate(preset: str) -> None:
    scheme = OmegaConf.to_object(compose([f"quant={preset}"]).quant)
    method, symmetric, act_order = PRESETS[preset]
    assert (scheme.name, scheme.method, scheme.weights.symmetric) == (preset, method, symmetric)
    act_ordered = getattr(quant.method_settings(scheme), "act_order", False)  # AWQ's settings have no act_order
    assert (scheme.weights.bits, scheme.weights.group_size, act_ordered) == (4, 128, act_order)
    assert (scheme.kv_cache is not None) == preset.endswith("kv8")
    validate_scheme(scheme)
