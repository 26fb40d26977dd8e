"""Router divergence (issue 33): top-k expert agreement and expert-load shift between the reference and the
quantized model, per MoE layer, on the same texts."""
from __future__ import annotations

import copy

import pytest
import torch

from harness import quant
from harness.config import QuantConfig, TensorQuantConfig
from harness.divergence.router import capture_routing, compare_routing, num_experts, routing_summary
from moe_models import build


def texts(count: int = 3, length: int = 24) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (1, length), generator=generator) for _ in range(count)]


def test_agreement_and_load_shift_by_hand() -> None:
    reference = {"layer": torch.tensor([[0, 1], [2, 3]])}
    quantized = {"layer": torch.tensor([[1, 0], [2, 4]])}
    (row,) = compare_routing(reference, quantized, {"layer": 5})
    assert row.tokens == 2 and row.top_k == 2
    assert row.identical == 0.5  # the first token's set is the same in another order
    assert row.overlap == 0.75  # (2/2 + 1/2) / 2
    assert row.load_shift == 0.25  # expert 3 loses a quarter of the slots, expert 4 gains it
    assert row.max_load_change == 0.25


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_agreement_is_exactly_one_at_quant_none(model_type: str) -> None:
    model = build(model_type)
    reference = capture_routing(model, texts())
    unchanged = copy.deepcopy(model)
    quant.apply(unchanged, QuantConfig(name="none"))
    rows = compare_routing(reference, capture_routing(unchanged, texts()), num_experts(model))
    assert len(rows) == 2
    assert all(r.identical == 1.0 and r.overlap == 1.0 and r.load_shift == 0.0 for r in rows)
    summary = routing_summary(rows)
    assert summary["identical_mean"] == 1.0 and summary["first_disagreeing_layer"] is None


def test_a_coarse_grid_moves_tokens_to_other_experts() -> None:
    model = build("qwen3_moe")
    reference = capture_routing(model, texts())
    quant.apply(model, QuantConfig(name="int2", weights=TensorQuantConfig(format="int", bits=2,
                                                                         granularity="channel")))
    rows = compare_routing(reference, capture_routing(model, texts()), num_experts(model))
    summary = routing_summary(rows)
    assert summary["identical_mean"] < 1.0 and summary["first_disagreeing_layer"] is not None
    for row in rows:
        assert 0.0 <= row.identical <= row.overlap <= 1.0 and 0.0 <= row.load_shift <= 1.0
        assert row.tokens == 3 * 24


def test_unfused_experts_report_the_same_routing() -> None:
    from harness.quant.experts import fuse_experts, unfuse_experts

    model = build("olmoe")
    fused = capture_routing(model, texts())
    state = unfuse_experts(model)
    unfused = capture_routing(model, texts())
    fuse_experts(model, state)
    assert fused.keys() == unfused.keys() and all(torch.equal(fused[k], unfused[k]) for k in fused)
