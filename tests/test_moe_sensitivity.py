"""Sensitivity and recommend on mixture-of-experts models (issue 33): a layer's experts are one unit, the
per-expert detail is granularity=expert, and a recommendation that keeps experts round-trips through its YAML."""
from __future__ import annotations

import copy

import pytest
import torch
from moe_models import build, plain_expert_matrices
from omegaconf import OmegaConf

from harness import quant
from harness.config import QuantConfig, TensorQuantConfig
from harness.divergence import scoring as divergence
from harness.planning.recommend import (
    recommended_scheme,
    scheme_yaml,
    solve,
    unit_table,
)
from harness.planning.sensitivity import layer_sensitivity, sensitivity_units
from harness.quant.experts import find_fused_experts
from harness.quant.format_table import fake_quantize

INT4_G32 = TensorQuantConfig(format="int", bits=4, granularity="group", group_size=32)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "12 + 7 * 3 = 33, and 40 - 8 = 32."]


class ByteTokenizer:
    """Bytes as token ids: enough for divergence.score_reference on a 256-token model."""

    def __call__(self, text: str, return_tensors: str = "pt", truncation: bool = True, max_length: int = 512):
        return {"input_ids": torch.tensor([list(text.encode())[:max_length]])}


def scheme() -> QuantConfig:
    return QuantConfig(name="int4_g32", weights=copy.deepcopy(INT4_G32))


def moe_layers(model: torch.nn.Module) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_one_experts_unit_per_moe_layer(model_type: str) -> None:
    model = build(model_type)
    layers = moe_layers(model)
    experts = {f"model.layers.{i}.mlp.experts" for i in layers}
    linears = sensitivity_units(model, scheme(), "linear")
    assert {u for u in linears if u.endswith(".experts")} == experts and experts
    for name in experts:
        module = model.get_submodule(name)
        count = module.down_proj.shape[0]
        assert linears[name] == [f"{name}.{e}.{p}" for e in range(count) for p in ("gate_proj", "up_proj", "down_proj")]
    # every other unit is one nn.Linear of the model, alone; routers are no unit
    others = [u for u in linears if u not in experts]
    assert all(linears[u] == [u] and isinstance(model.get_submodule(u), torch.nn.Linear) for u in others)
    assert not any(u.endswith((".gate", ".router")) for u in others)

    blocks = sensitivity_units(model, scheme(), "block")
    assert list(blocks) == [f"model.layers.{i}" for i in range(len(model.model.layers))]
    for name, members in linears.items():  # each linear-granularity unit lies whole in its block's unit
        block = ".".join(name.split(".")[:3])
        assert set(members) <= set(blocks[block])
    assert sum(len(v) for v in blocks.values()) == sum(len(v) for v in linears.values())

    per_expert = sensitivity_units(model, scheme(), "expert")
    for name in experts:
        count = model.get_submodule(name).down_proj.shape[0]
        assert [u for u in per_expert if u.startswith(name + ".")] == [f"{name}.{e}" for e in range(count)]
        assert [m for e in range(count) for m in per_expert[f"{name}.{e}"]] == linears[name]


def hand_quantized_experts(model: torch.nn.Module, experts: str, only: int | None = None) -> torch.nn.Module:
    """A copy of ``model`` with the experts of one layer (or one expert of it) rounded to nearest by hand,
    slicing the fused parameters as the modeling file lays them out (independent of harness.quant.experts)."""
    out = copy.deepcopy(model)
    module = out.get_submodule(experts)
    with torch.no_grad():
        for e in range(module.down_proj.shape[0]) if only is None else [only]:
            for matrix in plain_expert_matrices("qwen3_moe", module.gate_up_proj.data, module.down_proj.data, e).values():
                matrix.copy_(fake_quantize(matrix.clone(), INT4_G32))
    return out


@pytest.mark.slow
def test_experts_unit_kl_equals_hand_quantized_layer_and_model_is_restored() -> None:
    model = build("qwen3_moe", num_experts=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reference = divergence.score_reference(model, ByteTokenizer(), TEXTS[:1], max_tokens=24)
    table = layer_sensitivity(model, scheme(), reference, granularity="linear").set_index("unit")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(type(f.module).__name__ == "Qwen3MoeExperts" for f in find_fused_experts(model).values())
    for layer in moe_layers(model):
        name = f"model.layers.{layer}.mlp.experts"
        expected = divergence.compare_to_reference(hand_quantized_experts(model, name), reference, "hand")["kl"].mean()
        assert table.loc[name, "kl_mean"] == pytest.approx(float(expected), rel=1e-5, abs=1e-9)
        assert table.loc[name, "linears"] == 3 * model.get_submodule(name).down_proj.shape[0]
        assert table.loc[name, "kl_mean"] > 0

    detail = layer_sensitivity(model, scheme(), reference, granularity="expert").set_index("unit")
    name = f"model.layers.{moe_layers(model)[0]}.mlp.experts"
    expected = divergence.compare_to_reference(hand_quantized_experts(model, name, only=2), reference, "hand")["kl"]
    assert detail.loc[f"{name}.2", "kl_mean"] == pytest.approx(float(expected.mean()), rel=1e-5, abs=1e-9)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("granularity", ["linear", "block"])
def test_recommended_yaml_keeps_the_chosen_experts_units(granularity: str) -> None:
    import pandas as pd

    model = build("qwen3_moe")
    base = scheme()
    names = list(sensitivity_units(model, base, granularity))
    # a sensitivity table as input: the experts units most damaging, so a tight KL budget keeps them
    table = pd.DataFrame({"unit": names, "kl_mean": [1.0 if "experts" in n or granularity == "block" else 0.01
                                                     for n in names]})
    units = unit_table(model, base, table, granularity)
    for unit in units:  # parameters from the fused 3-D tensors, independently of the unit table
        if unit.name.endswith(".experts"):
            module = model.get_submodule(unit.name)
            assert unit.params == module.gate_up_proj.numel() + module.down_proj.numel()
    budget = min(u.kl for u in units) + 0.5 * (sum(u.kl for u in units) - min(u.kl for u in units))
    choice = solve(units, kl_budget=budget)
    kept_units = [u for u, q in zip(units, choice.quantized) if not q]
    assert kept_units and any(choice.quantized)

    text = scheme_yaml(recommended_scheme(base, units, choice, "rec", granularity), "a header\nof two lines")
    loaded = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantConfig), OmegaConf.create(text)))
    assert loaded.name == "rec" and list(loaded.keep) == list(base.keep) + [f"{u.name}.*" if u.linears != [u.name] else u.name
                                                         for u in kept_units]
    quant.validate_for_model(model, loaded)  # no uncovered weight: kept experts are kept whole
    account = quant.coverage_of(model, loaded)
    status = {e.name: (e.status, e.rule) for e in account.entries}
    chosen = {m for u, q in zip(units, choice.quantized) if q for m in u.linears}
    for unit in units:
        for member in unit.linears:
            experts = next((f for f in find_fused_experts(model) if member.startswith(f + ".")), None)
            param = (f"{experts}.{'down_proj' if member.endswith('down_proj') else 'gate_up_proj'}" if experts
                     else f"{member}.weight")
            assert status[param] == (("quantized", "int4 group32") if member in chosen else ("kept", "quant.keep"))
    assert account.uncovered_params == 0


@pytest.mark.slow  # imports the job stack (about 2 s)
def test_recommend_refuses_per_expert_granularity() -> None:
    from harness.errors import UsageError
    from harness.planning.recommend import RecommendOptions, recommend

    options = RecommendOptions(granularity="expert")
    options.budget.kl_mean = 0.1
    with pytest.raises(UsageError, match="granularity=expert"):
        recommend(None, options)



@pytest.mark.slow
def test_an_activation_scheme_leaves_the_experts_fused_and_bitwise_restored() -> None:
    """W8A8 leaves the quantized experts unfused (their Linears quantize inputs); each unit is undone."""
    model = build("qwen3_moe", num_experts=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reference = divergence.score_reference(model, ByteTokenizer(), TEXTS[:1], max_tokens=24)
    w8a8 = QuantConfig(name="w8a8", weights=TensorQuantConfig(format="fp8_e4m3", granularity="channel"),
                       activations=TensorQuantConfig(format="fp8_e4m3", granularity="token", dynamic=True))
    table = layer_sensitivity(model, w8a8, reference, granularity="block")
    assert list(table.sort_values("order")["unit"]) == [f"model.layers.{i}" for i in range(2)]
    assert (table["linears"] == 4 + 3 * 4).all() and (table["kl_mean"] > 0).all()
    assert set(model.state_dict()) == set(before)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert [type(f.module).__name__ for f in find_fused_experts(model).values()] == ["Qwen3MoeExperts"] * 2
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_unit_scheme_names_a_whole_experts_module_by_one_pattern_only_when_it_selects_the_same() -> None:
    from harness.planning.sensitivity import target_matrices, unit_scheme

    model = build("qwen3_moe")
    name = "model.layers.0.mlp.experts"
    for base, whole in ((scheme(), True), (QuantConfig(name="gu", weights=copy.deepcopy(INT4_G32),
                                                      targets=["*gate_proj", "*up_proj", "*_attn.*"]), False)):
        members = sensitivity_units(model, base, "linear")[name]
        unit = unit_scheme(base, members, model)
        assert unit.targets == ([f"{name}.*"] if whole else members) and unit.allow_uncovered
        # the unit's scheme selects exactly the unit's matrices
        assert list(target_matrices(model, unit)) == members


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_recommend_on_a_tiny_moe_checkpoint_end_to_end(make_cfg, tmp_path, cache_dir) -> None:
    """python -m harness.recommend's body on a saved qwen3_moe: one experts unit per layer, the solver's bits per
    weight equal the applied scheme's (routers counted at 16 in both), the YAML selects the chosen units."""
    import pandas as pd

    from harness.sizing.report_quant import prepare
    from harness.planning import recommend
    from harness.planning.sensitivity import target_matrices
    from test_moe_job import TINY, checkpoint

    directory = checkpoint(tmp_path, "qwen3_moe", cache_dir)
    cfg = OmegaConf.to_object(make_cfg(*TINY, "quant=int4_g128", "model=tiny_random", "model.source=hf",
                                       f"model.path={directory}", "model.name=tiny_qwen3_moe",
                                       "model.chat_template=false", "tracking.enabled=false"))
    options = recommend.RecommendOptions(budget=recommend.Budget(bits=8.0), granularity="linear", texts=2,
                                         frontier=[], out=str(tmp_path / "rec"))
    # (no uniform frontier: it composes model=<model.name>, and a checkpoint given by path has no conf/model entry)
    result = recommend.recommend(cfg, options)
    out = tmp_path / "rec" / result["recommended"]
    units = pd.read_csv(out / "units.csv")
    assert [u for u in units["unit"] if u.endswith(".experts")] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert result["applied_bits_per_weight"] == pytest.approx(result["bits_per_weight"], rel=1e-12)
    assert result["bits_per_weight"] <= 8.0
    scheme = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantConfig),
                                                 OmegaConf.load(out / f"{result['recommended']}.yaml")))
    model = prepare(cfg).loaded.model
    members = sensitivity_units(model, scheme, "linear")  # the recommended scheme's own units
    assert sorted(members) == sorted(units.loc[units["quantized"], "unit"])
    assert set(target_matrices(model, scheme)) == {m for u in members.values() for m in u}
