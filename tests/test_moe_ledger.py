"""The capacity ledger on mixture-of-experts models (issue 33): total parameters for memory, active ones for the
batch-1 decode floor, expected distinct experts at batch B, checked against hand calculations from each model's
published configuration."""
from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from harness.config import QuantConfig, TensorQuantConfig
from harness.sizing.ledger import Architecture, build_ledger, known_architectures


def test_qwen3_30b_a3b_total_and_active_by_hand() -> None:
    arch = known_architectures()["qwen3_30b_a3b"]
    hidden, layers, experts, top_k, width, vocab = 2048, 48, 128, 8, 768, 151936
    attention = 32 * 128 * hidden * 2 + 4 * 128 * hidden * 2  # q and o, k and v
    expert = 3 * hidden * width
    per_layer = attention + experts * expert + experts * hidden + 2 * hidden  # + router + two norms
    total = layers * per_layer + 2 * vocab * hidden + hidden  # untied embedding and head, final norm
    assert arch.total_params() == total == 30_532_110_336  # Qwen publishes 30.5B
    active = total - layers * (experts - top_k) * expert
    assert arch.active_params() == active == 3_353_020_416  # and 3.3B activated


def test_mixtral_8x7b_total_and_active_by_hand() -> None:
    arch = known_architectures()["mixtral_8x7b"]
    hidden, layers, width = 4096, 32, 14336
    attention = 2 * 4096 * hidden + 2 * 1024 * hidden
    expert = 3 * hidden * width
    total = layers * (attention + 8 * expert + 8 * hidden + 2 * hidden) + 2 * 32000 * hidden + hidden
    assert arch.total_params() == total
    assert round(total / 1e9, 1) == 46.7  # Mistral publishes 46.7B total
    assert round(arch.active_params() / 1e9, 1) == 12.9  # and 12.9B active
    assert arch.active_params() == total - layers * 6 * expert


def test_deepseek_v3_shaped_total_and_active_by_hand() -> None:
    arch = known_architectures()["deepseek_v3"]
    hidden, layers, dense, width = 7168, 61, 3, 2048
    mla = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    expert = 3 * hidden * width
    moe_layer = mla + 256 * expert + expert + 256 * hidden + 2 * hidden  # routed + shared + router + norms
    dense_layer = mla + 3 * hidden * 18432 + 2 * hidden
    total = dense * dense_layer + (layers - dense) * moe_layer + 2 * 129280 * hidden + hidden
    # MLA is one matrix of round(params / hidden) rows per layer: off by under a row (hidden) per layer
    assert arch.total_params() == pytest.approx(total, abs=layers * hidden)
    assert round(total / 1e9) == 671  # DeepSeek publishes 671B
    # DeepSeek publishes 37B activated per token; 37.6B here, 36.6B without the input embedding (a gather)
    assert 37e9 < arch.active_params() < 38e9
    assert 36e9 < arch.active_params() - 129280 * hidden < 37e9
    assert arch.active_params() == pytest.approx(total - (layers - dense) * 248 * expert, abs=layers * hidden)


def test_expected_distinct_experts_equals_enumeration() -> None:
    """Every equally likely routing of B tokens, each to k distinct of E experts, enumerated exactly."""
    for experts, top_k, batch in [(4, 2, 2), (5, 2, 3), (6, 3, 2), (4, 1, 3)]:
        arch = Architecture(num_experts=experts, experts_per_token=top_k)
        choices = list(itertools.combinations(range(experts), top_k))
        routings = list(itertools.product(choices, repeat=batch))
        mean = Fraction(sum(len(set().union(*routing)) for routing in routings), len(routings))
        assert arch.expected_experts(batch) == pytest.approx(float(mean), rel=1e-12)
    assert Architecture(num_experts=128, experts_per_token=8).expected_experts(1) == pytest.approx(8)


def test_decode_floor_reads_active_experts_and_memory_holds_all() -> None:
    arch = known_architectures()["qwen3_30b_a3b"]
    int4 = QuantConfig(name="int4_g128", weights=TensorQuantConfig(format="int", bits=4, granularity="group",
                                                                   group_size=128))
    ledger = build_ledger("qwen3_30b_a3b", arch, int4, gpus=["H100"], kv=["bf16"])
    rows = {r["weights"]: r for r in ledger.table.to_dict("records")}
    bf16 = rows["bf16"]
    assert bf16["weight_gb"] == pytest.approx(arch.total_params() * 2 / 1e9)
    read = arch.active_params() * 2 - (151936 - 1) * 2048 * 2  # untied embedding: one row gathered
    assert bf16["decode_floor_ms"] == pytest.approx(read / 3.35e12 * 1e3, rel=1e-9)
    expert_bits = 4 + 16 / 128  # gate/up read 2048 inputs, down 768: groups of 128 divide both
    unread = 48 * 120 * 3 * 2048 * 768 * expert_bits / 8
    weight_bytes = rows["int4_g128"]["weight_gb"] * 1e9
    expected = (weight_bytes - unread - (151936 - 1) * 2048 * 2) / 3.35e12 * 1e3
    assert rows["int4_g128"]["decode_floor_ms"] == pytest.approx(expected, rel=1e-9)
    assert "Mixture of experts: 128 experts, 8 per token" in ledger.markdown()


def test_dense_models_are_unchanged() -> None:
    arch = known_architectures()["llama8b"]
    assert arch.active_params() == arch.total_params() and arch.inactive_params(64) == 0
