"""Layer sensitivity on tiny models: ranking, a planted damaging layer, bitwise restoration, the CLI + MLflow."""
from __future__ import annotations

import json
from functools import partial

import mlflow
import pandas as pd
import pytest
import torch
from torch import nn

from harness.divergence import scoring as divergence
from harness.config import QuantConfig, TensorQuantConfig
from harness.planning.sensitivity import layer_sensitivity, sensitivity_units
from tiny_models import tiny_llama

VOCAB = 256
INT4_CHANNEL = TensorQuantConfig(format="int", bits=4, granularity="channel")


class CharTokenizer:
    """Bytes as token ids: enough for divergence.score_reference on a 256-token model."""

    def __call__(self, text: str, return_tensors: str = "pt", truncation: bool = True, max_length: int = 512):
        ids = list(text.encode())[:max_length]
        return {"input_ids": torch.tensor([ids])}


llama = partial(tiny_llama, vocab_size=VOCAB, hidden_size=128, std=0.08)


TEXTS = ["The quick brown fox jumps over the lazy dog.", "12 + 7 * 3 = 33, and 40 - 8 = 32.",
         "def add(a, b):\n    return a + b\n"]
POISONED = "model.layers.1.mlp.down_proj"


def poisoned_llama() -> nn.Module:
    """One layer whose rows each hold one large outlier: per-channel INT4 then rounds the rest to zero."""
    model = llama()
    with torch.no_grad():
        model.get_submodule(POISONED).weight[:, 0] = 3.0
    return model


def reference_of(model: nn.Module) -> list[divergence.ReferenceText]:
    return divergence.score_reference(model, CharTokenizer(), TEXTS, max_tokens=64)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert not any("input_scale" in m._buffers or hasattr(m, "_input_cache") for m in model.modules())


def test_units_by_linear_and_by_block():
    model = llama()
    scheme = QuantConfig(name="int4", weights=INT4_CHANNEL)
    linears = sensitivity_units(model, scheme, "linear")
    assert len(linears) == 14 and all(v == [k] for k, v in linears.items())
    blocks = sensitivity_units(model, scheme, "block")
    assert list(blocks) == ["model.layers.0", "model.layers.1"] and all(len(v) == 7 for v in blocks.values())
    with pytest.raises(ValueError, match="granularity"):
        sensitivity_units(model, scheme, "head")  # type: ignore[arg-type]


def test_planted_damaging_layer_ranks_first_and_its_kl_matches_an_independent_computation():
    model = poisoned_llama()
    reference = reference_of(model)
    before = state(model)
    table = layer_sensitivity(model, QuantConfig(name="int4", weights=INT4_CHANNEL), reference, granularity="linear")
    assert_untouched(model, before)
    assert len(table) == 14 and table["unit"].is_unique
    assert (table["kl_mean"].diff().dropna() <= 0).all()  # most damaging first
    assert table.loc[0, "unit"] == POISONED and table.loc[0, "kl_mean"] > 3 * table.loc[1, "kl_mean"]
    assert (table["kl_mean"] >= 0).all() and table["top1_agree"].between(0, 1).all()
    # Independent: quantize that one weight by hand (numpy-free torch arithmetic) and compute KL directly.
    with torch.no_grad():
        weight = model.get_submodule(POISONED).weight
        scale = weight.abs().amax(dim=1, keepdim=True) / 7
        weight.copy_(torch.clamp(torch.round(weight / scale), -7, 7) * scale)
        kls = []
        for ref in reference:
            logq = torch.log_softmax(model(ref.input_ids[None], use_cache=False).logits[0, :-1].double(), -1)
            logp = ref.logp.double()
            kls.append((logp.exp() * (logp - logq)).sum(-1))
    assert table.loc[0, "kl_mean"] == pytest.approx(torch.cat(kls).mean().item(), rel=1e-4)


def test_block_granularity_ranks_the_poisoned_block_first():
    model = poisoned_llama()
    table = layer_sensitivity(model, QuantConfig(name="int4", weights=INT4_CHANNEL), reference_of(model),
                              granularity="block")
    assert table["unit"].tolist() == ["model.layers.1", "model.layers.0"]
    assert (table["linears"] == 7).all()


@pytest.mark.parametrize("scheme", [
    QuantConfig(name="fp8", weights=TensorQuantConfig(format="fp8_e4m3", granularity="channel"),
                activations=TensorQuantConfig(format="fp8_e4m3", granularity="token")),
    QuantConfig(name="sq", method="smoothquant", weights=TensorQuantConfig(format="int", bits=8),
                activations=TensorQuantConfig(format="int", bits=8, granularity="token"),
                settings={"alpha": 0.5}),
], ids=["fp8_w8a8", "smoothquant"])
def test_activation_and_smoothing_schemes_are_undone_bitwise(scheme):
    class Calibration:
        def calibration_batches(self):
            return [torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))]

    model = llama()
    reference = reference_of(model)
    before = state(model)
    table = layer_sensitivity(model, scheme, reference, granularity="block", context=Calibration())
    assert_untouched(model, before)  # norms that absorbed SmoothQuant scales included
    assert (table["kl_mean"] > 0).all()


@pytest.mark.slow
def test_cli_writes_csv_png_and_logs_an_mlflow_run(tmp_path, cache_dir):
    from harness.planning.sensitivity import KIND_TAG, main

    out = tmp_path / "sens"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["model=tiny_random", "quant=int4", "slices=[math]", f"paths.cache_dir={cache_dir}",
                 f"tracking.uri={uri}", "texts=2", f"out={out}"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    table = pd.read_csv(out / "sensitivity.csv")
    assert list(table.columns) == ["unit", "linears", "kl_mean", "kl_max", "top1_agree", "ppl_ratio"]
    assert len(table) == 2 and (out / "sensitivity.png").stat().st_size > 1000
    assert summary["texts"] == 2 and summary["all_layers"]["kl_mean"] > 0
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("quant-harness").experiment_id],
                              filter_string=f"tags.`{KIND_TAG}` = 'sensitivity'")
    assert len(runs) == 1
    artifacts = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"sensitivity.csv", "sensitivity.png", "summary.json"} <= artifacts


def test_cli_refuses_a_bad_granularity_before_loading_anything(capsys, monkeypatch):
    from harness.planning import sensitivity

    monkeypatch.setattr(sensitivity, "run_sensitivity", lambda *a, **k: pytest.fail("work started"))
    assert sensitivity.main(["model=tiny_random", "granularity=layer"]) == 2
    assert capsys.readouterr().err.strip() == ("error: granularity='layer': use granularity=block or "
                                               "granularity=linear")
    assert sensitivity.main(["model=tiny_random", "--texts", "2"]) == 2
    assert "unknown flag '--texts'" in capsys.readouterr().err
    assert sensitivity.main(["-h"]) == 0
    assert "granularity=block" in capsys.readouterr().out
