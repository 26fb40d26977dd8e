"""The coverage account (issue 33): every parameter classified, bits per weight from it, and a one-line
refusal of a scheme that would silently leave matrix-shaped weights unquantized."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import quant
from harness.config import QuantConfig, TensorQuantConfig
from harness.quant.coverage import KEPT, NOT_COVERED, QUANTIZED, check_coverage
from harness.quant.format_table import SchemeError, storage_bits
from moe_models import build
from tiny_models import tiny_llama

INT4 = TensorQuantConfig(format="int", bits=4, granularity="group", group_size=32)


def int4(**kwargs) -> QuantConfig:
    return QuantConfig(name="int4_g32", weights=TensorQuantConfig(**vars(INT4)), **kwargs)


def test_every_parameter_is_classified_once_with_a_named_rule() -> None:
    model = build("qwen3_moe")
    account = quant.coverage_of(model, int4())
    assert sorted(e.name for e in account.entries) == sorted(n for n, _ in model.named_parameters())
    assert account.total_params == sum(p.numel() for p in model.parameters())
    for entry in account.entries:
        assert entry.status in (QUANTIZED, KEPT, NOT_COVERED)
        assert entry.status != KEPT or entry.rule in ("embedding", "output_head", "norm", "router", "bias",
                                                      "quant.keep", "quant.targets")
    by_name = {e.name: e for e in account.entries}
    assert by_name["model.layers.0.mlp.experts.gate_up_proj"].status == QUANTIZED
    assert by_name["model.layers.0.mlp.gate.weight"].rule == "router"
    assert by_name["model.embed_tokens.weight"].rule == "embedding"
    assert by_name["lm_head.weight"].rule == "output_head"
    assert by_name["model.layers.0.input_layernorm.weight"].rule == "norm"
    assert account.uncovered_params == 0


def test_bits_per_weight_by_hand_on_a_moe() -> None:
    """4 + 16/32 bits for every quantized matrix; the routers at 16; embeddings and the head out."""
    model = build("qwen3_moe")
    account = quant.coverage_of(model, int4())
    hidden, experts, inter = 64, 8, 32
    attention = 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64
    expert_params = experts * (2 * inter * hidden + hidden * inter)
    router = experts * hidden
    quantized = 2 * (attention + expert_params)
    expected = (quantized * (4 + 16 / 32) + 2 * router * 16) / (quantized + 2 * router)
    assert account.quantized_params == quantized
    assert account.bits_per_weight == pytest.approx(expected, rel=1e-12)
    assert account.quantized_share == pytest.approx(quantized / (quantized + 2 * router + 256 * 64), rel=1e-12)


def test_bits_per_weight_agrees_with_the_report_on_a_dense_model() -> None:
    """On a llama the account's bits per weight is the number the harness has always reported."""
    model = tiny_llama(vocab_size=128, intermediate_size=96)
    report = quant.apply(model, int4())
    assert report.coverage.bits_per_weight == pytest.approx(report.summary()["bits_per_weight"], rel=1e-12)
    assert report.coverage.quantized_params == report.quantized_params
    assert storage_bits(INT4, 96, 64) == pytest.approx(4.5)


class Mystery(nn.Module):
    """A module kind no quantizer knows: a 3-D weight under an unknown name."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, hidden, hidden) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.einsum("...h,eho->...o", x, self.w1) / 4


def test_an_unknown_module_kind_is_refused_in_one_line_naming_it_and_its_share() -> None:
    model = tiny_llama(vocab_size=128, intermediate_size=96)
    model.model.layers[1].mlp.mystery = Mystery(64)
    account = quant.coverage_of(model, int4())
    mystery = 4 * 64 * 64
    assert account.uncovered_params == mystery
    with pytest.raises(SchemeError) as error:
        quant.validate_for_model(model, int4())
    message = str(error.value)
    assert "\n" not in message and "model.layers.1.mlp.mystery (Mystery)" in message
    assert f"{account.uncovered_share:.1%}" in message and "quant.allow_uncovered=true" in message
    check_coverage(account, allow_uncovered=True)  # proceeds
    quant.validate_for_model(model, int4(allow_uncovered=True))
    assert "NOT COVERED" in account.headline()


def test_gpt2_conv1d_is_refused_in_one_line() -> None:
    """gpt2's Conv1D (a transposed Linear) is not quantized by the harness: refused, with the fix."""
    model = build("gpt2")
    with pytest.raises(SchemeError) as error:
        quant.validate_for_model(model, int4())
    message = str(error.value)
    assert "\n" not in message and "Conv1D" in message and "transformer.h.0.attn.c_attn" in message
    assert "100.0% of the matrix weights" in message


def test_keep_and_targets_are_rules_and_refusal_only_for_weights() -> None:
    model = build("qwen3_moe")
    account = quant.coverage_of(model, int4(keep=["lm_head", "*embed*", "*experts*"]))
    by_name = {e.name: e for e in account.entries}
    assert by_name["model.layers.1.mlp.experts.down_proj"].rule == "quant.keep"
    assert account.uncovered_params == 0
    narrow = quant.coverage_of(model, int4(targets=["*q_proj"]))
    assert {e.rule for e in narrow.entries if e.name.endswith("k_proj.weight")} == {"quant.targets"}
    reference = quant.coverage_of(model, QuantConfig(name="none"))
    assert reference.quantized_params == 0 and {e.rule for e in reference.entries} == {"no_weight_format"}
    check_coverage(reference, allow_uncovered=False)


def test_the_account_is_in_the_report_summary() -> None:
    model = build("olmoe")
    report = quant.apply(model, int4())
    summary = report.summary()
    assert summary["coverage_quantized_share"] == pytest.approx(report.coverage.quantized_share)
    assert summary["bits_per_weight"] == pytest.approx(report.coverage.bits_per_weight)
    assert report.coverage.to_dict()["uncovered"] == []


@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe", "gpt_oss", "qwen2_moe", "deepseek_v3", "mixtral"])
def test_the_account_names_exactly_the_parameters_quantization_changes(model_type: str) -> None:
    """The account is static; quantizing and comparing every parameter before and after checks it."""
    model = build(model_type)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = quant.apply(model, int4())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {e.name for e in report.coverage.entries if e.status == QUANTIZED}
