"""Quantization report: decode-floor numbers against hand computation, and the CLI on the tiny model."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from harness.quant import LayerReport, QuantReport
from harness.sizing.report_quant import (GPU_BANDWIDTH, decode_floor_metrics, decode_floor_ms, decode_floor_table, main,
                                  parse_gpus)

GPUS = {"H100": 3.35e12, "H200": 4.8e12}


def hand_report() -> QuantReport:
    """1000 parameters, of which one 10x20 linear at 4.5 bits/weight; the other 800 stay at 16 bits."""
    report = QuantReport(scheme="nvfp4", method="rtn", total_params=1000)
    report.layers.append(LayerReport("layer", 10, 20, 4.5, 20.0, 0.1))
    return report


def row(table: pd.DataFrame, model: str, precision: str) -> pd.Series:
    match = table[(table["model"] == model) & (table["precision"] == precision)]
    assert len(match) == 1, (model, precision)
    return match.iloc[0]


def test_primer_numbers_for_70b_and_8b():
    report = QuantReport(scheme="int4_g128", method="rtn", total_params=1000)
    report.layers.append(LayerReport("layer", 8, 125, 4.125, 20.0, 0.1))
    table = decode_floor_table(report, GPUS)
    bf16 = row(table, "70B", "bf16")
    assert bf16["weight_gb"] == pytest.approx(140.0)  # 70e9 x 2 bytes
    assert bf16["ms_per_token_H100"] == pytest.approx(41.791, abs=1e-3)  # 140e9 / 3.35e12 s
    assert bf16["ms_per_token_H200"] == pytest.approx(29.1667, abs=1e-4)  # 140e9 / 4.8e12 s
    int4 = row(table, "70B", "int4_g128")
    assert int4["weight_gb"] == pytest.approx(36.09375)  # 70e9 x 4.125 / 8
    assert int4["ms_per_token_H100"] == pytest.approx(10.7743, abs=1e-4)
    assert row(table, "8B", "bf16")["ms_per_token_H100"] == pytest.approx(4.7761, abs=1e-4)  # 16e9 / 3.35e12
    assert row(table, "8B", "int4_g128")["weight_gb"] == pytest.approx(4.125)


def test_this_model_rows_count_kept_layers_at_16_bits():
    table = decode_floor_table(hand_report(), GPUS, model_name="m")
    quantized = row(table, "m", "nvfp4")
    weight_bytes = (200 * 4.5 + 800 * 16) / 8  # 1712.5 bytes
    assert quantized["weight_gb"] == pytest.approx(weight_bytes / 1e9)
    assert quantized["bits_per_weight"] == pytest.approx(13.7)
    assert quantized["ms_per_token_H100"] == pytest.approx(weight_bytes / 3.35e12 * 1e3)
    assert row(table, "m", "bf16")["weight_gb"] == pytest.approx(2000 / 1e9)
    # The extrapolation uses the quantized layers' rate (4.5), not the whole small model's (13.7).
    assert row(table, "70B", "nvfp4")["weight_gb"] == pytest.approx(70e9 * 4.5 / 8 / 1e9)
    assert list(table.columns) == ["model", "precision", "params", "bits_per_weight", "weight_gb",
                                   "ms_per_token_H100", "ms_per_token_H200"]


def test_metrics_and_gpu_parsing():
    metrics = decode_floor_metrics(decode_floor_table(hand_report(), GPUS, model_name="tiny model"))
    assert metrics["decode_floor/70B/H100_ms"] == pytest.approx(70e9 * 4.5 / 8 / 3.35e12 * 1e3)
    assert metrics["decode_floor/tiny_model/weight_gb"] == pytest.approx(1712.5 / 1e9)
    assert not any("bf16" in key for key in metrics)
    assert parse_gpus("H100,Custom=2.5") == {"H100": GPU_BANDWIDTH["H100"], "Custom": 2.5e12}
    with pytest.raises(ValueError, match="unknown GPU 'H900'"):
        parse_gpus("H900")
    with pytest.raises(ValueError, match="bandwidth"):
        decode_floor_ms(1.0, 0.0)


@pytest.mark.slow
def test_cli_on_tiny_model_writes_tables_with_correct_sqnr(tmp_path, cache_dir):
    from harness.models import loading as models
    from harness.config import compose
    from omegaconf import OmegaConf

    out = tmp_path / "report"
    assert main(["model=tiny_random", "quant=int8", f"paths.cache_dir={cache_dir}", "gpus=H100,B200",
                 f"out={out}"]) == 0
    for name in ("report.md", "layers.csv", "decode_floor.csv"):
        assert (out / name).exists()
    layers = pd.read_csv(out / "layers.csv")
    assert len(layers) == 14 and (layers["bits_per_weight"] == 8 + 16 / layers["in_features"]).all()
    # SQNR of one layer recomputed from a fresh copy of the (seeded) tiny model with numpy.
    cfg = OmegaConf.to_object(compose(["model=tiny_random"]))
    weight = models.load(cfg.model, cache_dir).model.get_submodule("model.layers.1.mlp.down_proj").weight
    w = weight.detach().double().numpy()
    scale = np.abs(w).max(axis=1, keepdims=True) / 127
    q = np.clip(np.round(w / scale), -127, 127) * scale
    expected = 10 * math.log10((w ** 2).sum() / ((w - q) ** 2).sum())
    measured = layers.set_index("name").loc["model.layers.1.mlp.down_proj", "sqnr_db"]
    assert measured == pytest.approx(expected, abs=0.01)
    floor = pd.read_csv(out / "decode_floor.csv")
    assert {"ms_per_token_H100", "ms_per_token_B200"} <= set(floor.columns)
    text = (out / "report.md").read_text()
    assert "- quantized linears: 14 (" in text and "kept in high precision: lm_head" in text
    assert "41.79" in text  # the 70B BF16 row on an H100


def test_cli_typos_fail_at_start_in_one_line(tmp_path, capsys, monkeypatch):
    from harness.sizing import report_quant

    monkeypatch.setattr(report_quant, "report_quant", lambda *a, **k: pytest.fail("work started"))
    assert main(["model=tiny_random", "gpus=H900"]) == 2
    assert capsys.readouterr().err.strip() == ("error: gpus=H900: unknown GPU 'H900'; known A100, B200, H100, H200, "
                                               "MI300X, or give NAME=TB/s")
    assert main(["model=tiny_random", "--gpus", "H100"]) == 2
    assert "unknown flag '--gpus'" in capsys.readouterr().err
    assert main(["model=tiny_random", "gpu=H100"]) == 2  # not an option, not a run-config key
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "gpu" in err and len(err.strip().splitlines()) == 1
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "gpus=H100,H200,B200" in out and "out=None" in out and "quant=" in out
