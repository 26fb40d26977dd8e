"""Exports an engine serves (issue 34): INT8 W8A8 to compressed-tensors with an exact round trip, ragged
groups refused before any quantization, and stored bits per weight read from the stored dtype (FP8 and
INT8 ``.weight`` count 8 bits plus their scales), for exports and for external checkpoints."""
from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("compressed_tensors")

from harness.checkpoint import export as export_mod  # noqa: E402
from harness.checkpoint.candidate import linear_shapes, measured_bits_per_weight  # noqa: E402
from harness.config import compose  # noqa: E402
from tests.conftest import quantized_tiny as _quantized  # noqa: E402


def _header(path) -> dict:
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        return json.loads(handle.read(size))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8_w8a8", "int8_w8a8_sq"])
def test_int8_w8a8_exports_int8_weights_exactly_with_dynamic_per_token_int8_inputs(name, tmp_path):
    from compressed_tensors.quantization import QuantizationArgs
    from transformers import AutoModelForCausalLM

    prepared, _, targets, kept = _quantized(name)
    result = export_mod.export(prepared.loaded.model, prepared.loaded.tokenizer, prepared.scheme, tmp_path / "ct",
                               targets=targets, kept=kept)
    assert result.format == "int-quantized" and result.kept == ["lm_head"]
    assert result.max_abs_weight_error == 0.0 and result.max_abs_stored_error == 0.0
    group = result.quantization_config["config_groups"]["group_0"]
    acts = QuantizationArgs(**group["input_activations"])
    weights = QuantizationArgs(**group["weights"])
    assert (acts.type, acts.num_bits, acts.strategy, acts.dynamic, acts.symmetric) == ("int", 8, "token", True, True)
    assert (weights.type, weights.num_bits, weights.strategy, weights.symmetric) == ("int", 8, "channel", True)
    header = _header(tmp_path / "ct" / "model.safetensors")
    for linear in targets:  # int8 codes on disk, one float scale per output channel
        assert header[f"{linear}.weight"]["dtype"] == "I8"
        assert header[f"{linear}.weight_scale"]["shape"] == [targets[linear].out_features, 1]
    # an independent decode of what is stored: codes x scales, against the harness's weights
    from safetensors.torch import load_file

    stored = load_file(tmp_path / "ct" / "model.safetensors")
    for linear, module in targets.items():
        decoded = stored[f"{linear}.weight"].float() * stored[f"{linear}.weight_scale"].float()
        assert torch.equal(decoded, module.weight.detach().float()), linear
    # and transformers + compressed-tensors load the same weights back (decompressed on the first forward)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32).eval()
    with torch.no_grad():
        loaded(torch.zeros(1, 1, dtype=torch.long))
    theirs = dict(loaded.named_modules())
    for linear, module in targets.items():
        assert torch.equal(theirs[linear].weight.detach().float(), module.weight.detach().float()), linear


def test_int_w8a8_other_than_channel_per_token_is_refused_with_the_exported_form():
    scheme = OmegaConf.to_object(compose(["quant=int8_w8a8", "model=tiny_random",
                                          "quant.activations.granularity=tensor"])).quant
    with pytest.raises(export_mod.ExportError, match="int8 weights per channel with int8 activations per tensor .*"
                                                     "exported as symmetric int8 channel weights with dynamic "
                                                     "per-token int8 inputs"):
        export_mod.quantization_args(scheme)


@pytest.mark.slow
def test_ragged_groups_are_refused_in_one_line_before_quantizing(tmp_path, capsys, monkeypatch):
    """576 = 4.5 x 128 (SmolLM2's hidden size): the harness evaluates a last group of 64, no file holds it."""
    from harness import quant

    def no_quantizing(*args, **kwargs):
        raise AssertionError("quantized before refusing")

    monkeypatch.setattr(quant, "apply", no_quantizing)
    code = export_mod.main(["model=tiny_random", "model.tiny.hidden_size=576", "model.tiny.num_attention_heads=9",
                            "model.tiny.num_key_value_heads=3", "model.ragged_groups=true", "quant=int4_g128",
                            f"out={tmp_path / 'ct'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and not (tmp_path / "ct").exists()
    line = next(line for line in err if "group_size=128" in line)
    assert "input sizes [576]" in line and "Fix: quant.weights.group_size=64" in line


def test_whole_groups_pass_and_channel_schemes_are_not_checked():
    scheme = OmegaConf.to_object(compose(["quant=int4_g128", "model=tiny_random"])).quant
    export_mod.check_whole_groups({"a": torch.nn.Linear(256, 8), "b": torch.nn.Linear(512, 8)}, scheme)
    with pytest.raises(export_mod.ExportError, match=r"1 of 2 linears \(input sizes \[192\], e.g. b: 192 columns\)"
                                                     r".*group_size=64 \(divides every input size, as do \[32, 16\]\)"):
        export_mod.check_whole_groups({"a": torch.nn.Linear(256, 8), "b": torch.nn.Linear(192, 8)}, scheme)
    channel = OmegaConf.to_object(compose(["quant=int8", "model=tiny_random"])).quant
    export_mod.check_whole_groups({"b": torch.nn.Linear(192, 8)}, channel)


# --------------------------------------------------------------------------- stored bits per weight
def _write(path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def test_an_fp8_or_int8_weight_counts_8_bits_plus_its_scales(tmp_path):
    out, cols = 8, 576
    shapes = {"fp8": (out, cols), "int8": (out, cols), "dense": (out, cols), "packed": (out, cols)}
    _write(tmp_path / "model.safetensors", {
        "fp8.weight": torch.zeros(out, cols).to(torch.float8_e4m3fn), "fp8.weight_scale": torch.ones(out, 1),
        "int8.weight": torch.zeros(out, cols, dtype=torch.int8), "int8.weight_scale": torch.ones(out, 1),
        "dense.weight": torch.zeros(out, cols, dtype=torch.bfloat16),
        "packed.weight_packed": torch.zeros(out, cols // 8, dtype=torch.int32),
        "packed.weight_scale": torch.ones(out, cols // 128 + 1, dtype=torch.bfloat16)})
    per_element = {  # stored bits / dense elements, counted by hand from the tensors above
        "fp8": (8 * out * cols + 32 * out) / (out * cols),
        "int8": (8 * out * cols + 32 * out) / (out * cols),
        "packed": (32 * out * cols // 8 + 16 * out * 5) / (out * cols)}
    expected = sum(per_element.values()) / 3  # same element count each: the plain mean
    assert measured_bits_per_weight(tmp_path, shapes) == pytest.approx(expected, rel=1e-12)
    assert measured_bits_per_weight(tmp_path, {"dense": (out, cols)}) is None  # bf16 .weight: dense, left out
    assert measured_bits_per_weight(tmp_path, {"fp8": (out, cols)}) == pytest.approx(8 + 32 / cols, rel=1e-12)


@pytest.mark.slow
def test_the_fp8_export_reports_its_stored_bits(tmp_path):
    prepared, _, targets, kept = _quantized("fp8")
    result = export_mod.export(prepared.loaded.model, prepared.loaded.tokenizer, prepared.scheme, tmp_path / "ct",
                               targets=targets, kept=kept)
    shapes = linear_shapes(prepared.loaded.model)
    measured = measured_bits_per_weight(tmp_path / "ct", shapes, set(kept))
    by_hand = sum(8 * o * i + 32 * o for name, (o, i) in shapes.items() if name in targets) / \
        sum(o * i for name, (o, i) in shapes.items() if name in targets)
    assert measured == pytest.approx(by_hand, rel=1e-12) and measured < 9
    assert result.bits_per_weight < 16
