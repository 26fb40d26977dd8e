"""Architecture adapters: block capture/replay, group wiring, scale folding (Llama and Gemma 3)."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from harness.quant.architectures import (GEMMA3, LLAMA, capture_block_inputs, get_adapter, make_batches,
                                    round_outside_blocks, run_block, staged_forward)
from harness.quant.awq import fold_scales
from tiny_models import tiny_llama


pytestmark = pytest.mark.usefixtures("one_thread")

llama = partial(tiny_llama, vocab_size=128, max_position_embeddings=128)


def tiny_gemma(kv_heads: int = 4, seed: int = 0) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # Gemma initialises norms at 0, i.e. scale 1: make them non-trivial
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    return model


MODELS = {"llama": llama, "gemma3": tiny_gemma}


@pytest.mark.parametrize("family", sorted(MODELS))
@torch.no_grad()
def test_replaying_blocks_reproduces_the_model(family: str) -> None:
    """Captured inputs + run_block, block after block, give the model's own block outputs.

    Gemma's two layers use different masks (sliding window 8 < 24 tokens) and rotary tables,
    so reusing block 0's arguments for block 1 would fail this test.
    """
    model = MODELS[family]()
    adapter = get_adapter(model)
    tokens = torch.randint(0, 128, (6, 24), generator=torch.Generator().manual_seed(1))
    expected: list[list[torch.Tensor]] = [[] for _ in adapter.blocks(model)]
    hooks = [block.register_forward_hook(lambda _m, _a, out, i=i: expected[i].append(
        out[0] if isinstance(out, tuple) else out)) for i, block in enumerate(adapter.blocks(model))]
    for batch in make_batches(tokens, 4):
        model(batch)
    for hook in hooks:
        hook.remove()
    inputs = capture_block_inputs(model, adapter, make_batches(tokens, 4), torch.device("cpu"))
    assert [h.shape[0] for h in inputs.hidden] == [4, 2]
    hidden = inputs.hidden
    for index, block in enumerate(adapter.blocks(model)):
        hidden = [run_block(block, h, e) for h, e in zip(hidden, inputs.extras[index])]
        for got, want in zip(hidden, expected[index]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The recorders are gone: the model runs normally again.
    assert not any("forward" in vars(block) for block in adapter.blocks(model))
    if family == "gemma3":
        with pytest.raises(AssertionError):
            swapped = run_block(adapter.blocks(model)[1], expected[0][0], inputs.extras[0][0])
            torch.testing.assert_close(swapped, expected[1][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(MODELS))
@torch.no_grad()
def test_groups_name_every_consumer_of_one_input(family: str) -> None:
    """Each group's linears and inspected module all receive the very same input values."""
    model = MODELS[family]()
    adapter = get_adapter(model)
    block = adapter.blocks(model)[0]
    seen: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            seen[name] = (args[0] if args else kwargs["hidden_states"]).clone()
        return record

    names = {n for g in adapter.groups for n in (*g.linears, g.inspect)}
    handles = [block.get_submodule(n).register_forward_pre_hook(hook(n), with_kwargs=True) for n in names]
    model(torch.randint(0, 128, (2, 12)))
    for handle in handles:
        handle.remove()
    linears = {n for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    assert linears == set(adapter.linear_names()), "every linear of a block belongs to exactly one group"
    for group in adapter.groups:
        for name in (*group.linears[1:], group.inspect):
            torch.testing.assert_close(seen[name], seen[group.linears[0]], rtol=0, atol=0)


def test_v_to_o_is_foldable_only_without_grouped_query_attention() -> None:
    prevs = lambda model: [g.prev for g in LLAMA.foldable_groups(LLAMA.blocks(model)[0])]  # noqa: E731
    assert "self_attn.v_proj" not in prevs(llama(kv_heads=2))
    assert prevs(llama(kv_heads=4)) == ["input_layernorm", "self_attn.v_proj", "post_attention_layernorm",
                                              "mlp.up_proj"]
    assert "self_attn.v_proj" not in [g.prev for g in GEMMA3.foldable_groups(GEMMA3.blocks(tiny_gemma(1))[0])]


@pytest.mark.parametrize("family", sorted(MODELS))
@torch.no_grad()
def test_folding_into_a_norm_divides_its_output(family: str) -> None:
    """prev'(x) = prev(x) / s and W'(x/s) = W x; Gemma's (1 + w) norm needs its offset."""
    model = MODELS[family]()
    adapter = get_adapter(model)
    block = adapter.blocks(model)[0]
    norm, linear = block.get_submodule("input_layernorm"), block.get_submodule("self_attn.q_proj")
    x = torch.randn(3, 64)
    scales = torch.rand(64) * 3 + 0.2
    before_norm, before_linear = norm(x), linear(norm(x))
    fold_scales(norm, [linear], scales, adapter.norm_offset)
    torch.testing.assert_close(norm(x), before_norm / scales, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(linear(norm(x)), before_linear, rtol=1e-4, atol=1e-5)
    if adapter.norm_offset:
        wrong = tiny_gemma().model.layers[0].input_layernorm
        fold_scales(wrong, [], scales, 0.0)  # as if it were a Llama norm
        assert not torch.allclose(wrong(x), before_norm / scales, rtol=1e-3)


def test_unknown_family_names_the_known_ones() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="llama"):
        get_adapter(model)


def test_targets_outside_blocks_are_rounded_with_a_note() -> None:
    from harness.config import QuantConfig, TensorQuantConfig
    from harness.quant import QuantReport, target_linears
    from harness.quant.format_table import fake_quantize

    model = llama()
    spec = TensorQuantConfig(format="int", bits=4, granularity="group", group_size=32)
    scheme = QuantConfig(name="x", method="gptq", weights=spec, keep=["*embed*"])
    targets, _ = target_linears(model, scheme)
    before = model.lm_head.weight.detach().clone()
    report = QuantReport(scheme="x", method="gptq")
    changed = round_outside_blocks(model, LLAMA, scheme, targets, report)
    assert changed == ["lm_head.weight"] and "lm_head" in report.notes[0]
    torch.testing.assert_close(model.lm_head.weight, fake_quantize(before, spec), rtol=0, atol=0)


def _toy_block() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


@torch.no_grad()
def test_staged_forward_runs_each_batch_once_and_later_stages_see_earlier_changes() -> None:
    block = _toy_block()
    hidden = [torch.randn(3, 8) for _ in range(4)]
    calls = []
    block.register_forward_pre_hook(lambda _m, _a: calls.append(1))
    seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def on_stage(stage: int) -> None:
        if stage == 0:  # "quantize" the first linear: everything downstream must see it
            block[0].weight.zero_()
            block[0].bias.fill_(1.0)

    outputs = staged_forward(block, hidden, [((), {})] * 4, [block[0], block[2]],
                             lambda stage, x: seen[stage].append(x.clone()), on_stage, torch.device("cpu"))
    assert len(calls) == 4, "one forward per batch"
    for h, x0, x1, out in zip(hidden, seen[0], seen[1], outputs):
        torch.testing.assert_close(x0, h)
        torch.testing.assert_close(x1, torch.ones(3, 8))  # relu(0·h + 1)
        torch.testing.assert_close(out, block(h))


@torch.no_grad()
def test_staged_forward_refuses_stops_out_of_order_and_cleans_up() -> None:
    import threading

    block = _toy_block()
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="did not reach stage 0"):
        staged_forward(block, [torch.randn(2, 8)] * 3, [((), {})] * 3, [block[2], block[0]],
                       lambda *_: None, lambda _s: None, torch.device("cpu"))

    def explode(_stage: int) -> None:
        raise ValueError("solve failed")

    with pytest.raises(ValueError, match="solve failed"):
        staged_forward(block, [torch.randn(2, 8)] * 3, [((), {})] * 3, [block[0]], lambda *_: None, explode,
                       torch.device("cpu"))
    assert threading.active_count() == before
    assert not block._forward_pre_hooks, "hooks removed"
