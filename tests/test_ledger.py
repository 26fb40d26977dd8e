"""Capacity ledger: the seed's worked 70B example, KV bytes by hand, shapes against a real run, the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from harness import ledger, quant
from harness.config import REPO_DIR, compose
from harness.quant.base import LayerReport, QuantReport

SEED_GPU = ledger.GPU("seed", 80.0, 3.352)  # the worked example's 80 GB, 3,352 GB/s GPU


def seed_rows() -> pd.DataFrame:
    per_token = {kv: ledger.kv_bytes_per_token(80, 8, 128, ledger.kv_bits_per_element(ledger.load_kv_format(kv), 128))
                 for kv in ("bf16", "fp8")}
    weights = {"bf16": 70e9 * 16 / 8, "fp8": 70e9 * 8 / 8, "int4_g128": 70e9 * 4.125 / 8}
    return ledger.capacity_rows("70B", weights, per_token, [SEED_GPU], reserve_gb=4.0)


def pick(table: pd.DataFrame, weights: str, kv: str) -> pd.Series:
    (index,) = table.index[(table["weights"] == weights) & (table["kv"] == kv)]
    return table.loc[index]


def test_the_seeds_worked_70b_example():
    table = seed_rows()
    assert pick(table, "fp8", "bf16")["kv_bytes_per_token"] == 327_680
    assert pick(table, "fp8", "fp8")["kv_bytes_per_token"] == 163_840
    fp8 = pick(table, "fp8", "bf16")
    assert fp8["weight_gb"] == pytest.approx(70.0) and fp8["kv_left_gb"] == pytest.approx(6.0)
    assert fp8["kv_tokens"] == 18_310 and round(fp8["kv_tokens"], -3) == 18_000  # "about 18,000"
    fp8_kv = pick(table, "fp8", "fp8")["kv_tokens"]
    assert fp8_kv == 36_621 and round(fp8_kv, -3) == 37_000  # 6e9 / 163,840, "about 37,000"
    assert round(fp8["decode_floor_ms"], 1) == 20.9  # ">= 20.9 ms per token"
    int4 = pick(table, "int4_g128", "bf16")
    assert round(int4["weight_gb"], 1) == 36.1 and round(int4["kv_left_gb"], 1) == 39.9
    assert int4["kv_tokens"] == 121_784 and round(int4["kv_tokens"], -3) == 122_000
    int4_fp8_kv = pick(table, "int4_g128", "fp8")["kv_tokens"]
    assert int4_fp8_kv == 243_568 and round(int4_fp8_kv, -3) == 244_000  # 39.90625e9 / 163,840
    assert round(int4["decode_floor_ms"], 1) == 10.8
    bf16 = pick(table, "bf16", "bf16")
    assert bf16["weight_gb"] == pytest.approx(140.0) and not bf16["fits"] and bf16["kv_tokens"] == 0
    assert ledger.Ledger(table, "int4_g128").wide().query("weights == 'bf16'")["kv_left_gb"].item() == "does not fit"


def test_kv_scale_overhead_by_hand():
    int4 = ledger.load_kv_format("int4")  # KIVI: keys per channel over 32 tokens, values per token, asymmetric
    keys, values = 4 + (16 + 4) / 32, 4 + (16 + 4) / 128  # a 16-bit scale and a 4-bit zero point per group
    assert ledger.kv_bits_per_element(int4, 128) == pytest.approx((keys + values) / 2)
    assert ledger.kv_bits_per_element(ledger.load_kv_format("fp8_dynamic"), 128) == pytest.approx(8 + 16 / 128)
    assert ledger.kv_bits_per_element(None, 128) == 16.0
    assert ledger.kv_bytes_per_token(32, 8, 128) == 131_072  # the 8B teaching model in BF16


def test_shapes_alone_give_the_weight_bytes_a_real_quantization_measured():
    """results/example/ is SmolLM2-135M quantized with int4_g128 by the pipeline; no weights are loaded here."""
    measured = json.loads((REPO_DIR / "results" / "example" / "summary.json").read_text())["quant"]
    cfg = OmegaConf.to_object(compose(["model=smollm2_135m", "quant=int4_g128"]))
    scheme = quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups)
    weight_bytes, bits = ledger.scheme_weight_bytes(ledger.architecture(cfg.model), scheme)
    assert weight_bytes / 1e9 == pytest.approx(measured["weight_gb"], rel=1e-12)
    assert bits == pytest.approx(measured["bits_per_weight"], rel=1e-12)


def test_shapes_match_a_real_quantized_tiny_model_and_its_kv_scheme(tmp_path):
    from harness.report_quant import prepare

    cfg = OmegaConf.to_object(compose(["model=tiny_random", "quant=int4_g128_kv8", f"paths.cache_dir={tmp_path}"]))
    prepared = prepare(cfg)
    report = quant.apply(prepared.loaded.model, prepared.scheme, prepared.context)
    arch = ledger.architecture(cfg.model)
    assert arch.total_params() == report.total_params
    assert ledger.scheme_weight_bytes(arch, prepared.scheme)[0] == pytest.approx(report.weight_bits / 8, rel=1e-12)
    table = ledger.ledger_for_run(prepared.loaded.model, report, cfg).table
    assert set(table.query("kv == 'scheme_kv'")["kv_bytes_per_token"]) == {2 * 2 * 2 * 32 * 1}  # static FP8 KV


def test_ledger_for_run_uses_the_loaded_models_config_and_report():
    from transformers import LlamaConfig

    class Loaded:
        config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000)

    report = QuantReport(scheme="int4_g128", method="rtn", total_params=1_000_000)
    report.layers.append(LayerReport("layer", 128, 1024, 4.125, 20.0, 0.1))
    cfg = OmegaConf.to_object(compose(["model=tiny_random", "quant=int4_g128"]))
    result = ledger.ledger_for_run(Loaded(), report, cfg)
    metrics = result.metrics()
    assert metrics["ledger/kv_bytes_per_token/bf16"] == 2 * 2 * 2 * 32 * 2
    expected_left = 80e9 - report.weight_bits / 8 - 4e9
    assert metrics["ledger/H100/kv_left_gb"] == pytest.approx(expected_left / 1e9)
    assert metrics["ledger/H100/bf16/kv_tokens"] == expected_left // 512
    assert metrics["ledger/B200/decode_floor_ms"] == pytest.approx(report.weight_bits / 8 / 8e12 * 1e3)
    assert "## Capacity ledger" in result.markdown()


def test_cli_on_a_hub_model_reads_no_weights(tmp_path, capsys):
    status = ledger.main(["model=llama70b", "quant=fp8", f"out={tmp_path}", "gpus=[H100,X:24:1.0]", "context=32768"])
    assert status == 0
    table = pd.read_csv(tmp_path / "ledger.csv")
    assert set(table["gpu"]) == {"H100", "X"} and set(table["context"]) == {32768}
    assert not table.query("gpu == 'X'")["fits"].any()  # 72.7 GB of weights on a 24 GB GPU
    assert "does not fit" in (tmp_path / "ledger.md").read_text()
    assert "70.6B parameters, 80 layers, 8 KV heads × 128" in capsys.readouterr().out


def test_bad_input(tmp_path, capsys):
    assert ledger.main(["model=llama8b", "gpus=[H1000]", f"out={tmp_path}"]) == 2
    assert "unknown GPU 'H1000'; known: A100, B200, H100, H200, MI300X" in capsys.readouterr().err
    assert ledger.main(["model=llama8b", "kv=[fp4]", f"out={tmp_path}"]) == 2
    assert "unknown KV format 'fp4'" in capsys.readouterr().err
    unknown = ["model=llama8b", "model.name=mystery", f"model.path={tmp_path / 'absent'}", f"out={tmp_path}"]
    assert ledger.main(unknown) == 2
    assert "no architecture known for model 'mystery'" in capsys.readouterr().err
    given = unknown + ["arch.layers=32", "arch.kv_heads=8", "arch.head_dim=128", "arch.params=8e9"]
    assert ledger.main(given) == 0  # giving the shapes is the fix the message names
    assert Path(tmp_path / "ledger.csv").exists()
