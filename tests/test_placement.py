"""model.device=auto through accelerate, proven on the CPU with disk offload.

On a CPU-only machine accelerate's ``device_map="auto"`` has one compute device, so a
``max_memory`` that holds the embeddings and the first block forces the second block, the final
norm and the output head to disk: their parameters become ``meta`` placeholders and accelerate's
hooks load them for each forward — the same hooks that move activations between GPUs in a
multi-GPU split. A split run must give the same per-item results as the unsplit one.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from harness import cli
from harness.models import loading as models
from harness.job import pipeline as run_mod
from harness.config import load_model_config
from harness.models.placement import PlacementError, offloaded
from tests.conftest import TINY_MATH

# tiny_random: embeddings 25.2 MB, each block 0.59 MB, head 25.2 MB (fp32). accelerate keeps room for
# the largest module on the main device, so 51 MB holds the embeddings and block 0 and no more.
SPLIT = ["model.device=auto", "+model.max_memory={cpu: 51000KB, disk: 1GB}"]


@pytest.mark.slow
def test_split_places_later_modules_on_disk(shared_model_cache, tmp_path):
    (tmp_path / "models").symlink_to(shared_model_cache)
    cfg = load_model_config("tiny_random")
    cfg.device, cfg.max_memory = "auto", {"cpu": "51000KB", "disk": "1GB"}
    model = models.load(cfg, tmp_path).model
    assert model.hf_device_map["model.layers.0"] == "cpu"
    assert model.hf_device_map["model.layers.1"] == "disk" and model.hf_device_map["lm_head"] == "disk"
    assert "lm_head.weight" in offloaded(model) and "model.embed_tokens.weight" not in offloaded(model)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["none", "kv8"])
def test_split_run_matches_the_unsplit_run_item_for_item(make_cfg, tmp_path, scheme):
    # One thread in both: CPU matmuls sum in a thread-count-dependent order, and a CPU job with more
    # threads would also move its reference to a second process (harness.job.background_reference).
    whole = run_mod.run(make_cfg(*TINY_MATH, f"quant={scheme}", "tracking.enabled=false", "runtime.threads=1"))
    split = run_mod.run(make_cfg(*TINY_MATH, f"quant={scheme}", "tracking.enabled=false", "runtime.threads=1", *SPLIT,
                                 f"paths.results_dir={tmp_path / 'split'}"))
    assert split["reference_cached"] == {"math": False}  # the split model computed its own reference
    a = pd.read_parquet(next((tmp_path / "results").glob("*")) / "items.parquet").set_index("item_id").sort_index()
    b = pd.read_parquet(next((tmp_path / "split").glob("*")) / "items.parquet").set_index("item_id").sort_index()
    for column in ("response_ref", "response_quant", "correct_ref", "correct_quant"):
        assert (a[column] == b[column]).all(), column
    ta = pd.read_parquet(next((tmp_path / "results").glob("*")) / "tokens.parquet")
    tb = pd.read_parquet(next((tmp_path / "split").glob("*")) / "tokens.parquet")
    for column in ("nll_ref", "nll_quant", "kl", "top1_ref", "top1_quant"):
        np.testing.assert_allclose(tb[column], ta[column], rtol=1e-5, atol=1e-7, err_msg=column)
    assert split["metrics"]["math/kl_mean"] == pytest.approx(whole["metrics"]["math/kl_mean"], rel=1e-5, abs=0)
    if scheme == "none":
        assert split["metrics"]["math/kl_mean"] == 0.0


@pytest.mark.slow
def test_weight_scheme_on_offloaded_weights_is_refused_before_the_reference(make_cfg, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the reference was computed before the placement was checked")
    monkeypatch.setattr(run_mod, "reference_unless_busy", never)
    with pytest.raises(PlacementError, match="offloaded.*cannot rewrite"):
        run_mod.run(make_cfg(*TINY_MATH, "quant=int4_g128", "tracking.enabled=false", *SPLIT))


@pytest.mark.slow
def test_max_memory_that_cannot_hold_the_model_is_a_clear_error(shared_model_cache, tmp_path):
    (tmp_path / "models").symlink_to(shared_model_cache)
    cfg = load_model_config("tiny_random")
    cfg.device, cfg.max_memory = "auto", {"cpu": "51000KB"}  # no disk entry: offload not allowed
    with pytest.raises(PlacementError, match="does not fit model.max_memory.*disk"):
        models.load(cfg, tmp_path)
    cfg.max_memory = {"cpu": "1MB", "disk": "1GB"}
    with pytest.raises(PlacementError, match="no room on any device"):
        models.load(cfg, tmp_path)


@pytest.mark.slow
def test_frozen_head_copy_of_an_offloaded_head_has_real_weights(shared_model_cache, tmp_path):
    from harness.divergence.scoring import OutputHead
    (tmp_path / "models").symlink_to(shared_model_cache)
    cfg = load_model_config("tiny_random")
    whole = models.load(cfg, tmp_path).model
    cfg.device, cfg.max_memory = "auto", {"cpu": "51000KB", "disk": "1GB"}
    split = models.load(cfg, tmp_path).model
    head = OutputHead.of(split, frozen_copy=True)
    assert torch.equal(head.lm_head.weight, whole.lm_head.weight)
    x = torch.randn(3, whole.config.hidden_size)
    assert torch.equal(head.logits(x), OutputHead.of(whole).logits(x))


def test_llama70b_is_split_and_its_launcher_asks_for_the_gpus_it_names():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config import CONF_DIR, register_configs
    from harness.infra.devices import parse_max_memory
    cfg = load_model_config("llama70b")
    budget = parse_max_memory(cfg.max_memory)
    gpus = sorted(k for k in budget if isinstance(k, int))
    assert cfg.device == "auto" and gpus == list(range(len(gpus)))
    gib = sum(float(budget[g].removesuffix("GiB")) for g in gpus)
    assert gib * 2**30 > 70.6e9 * 2  # Llama-3.1-70B's bf16 weights fit the GPU budget alone
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="config", overrides=["model=llama70b", "hydra/launcher=slurm_70b"],
                           return_hydra_config=True)
    GlobalHydra.instance().clear()
    launcher = composed.hydra.launcher
    assert launcher.gpus_per_node == len(gpus)
    assert launcher.mem_gb >= 256 and "submitit" in launcher._target_.lower()


def test_models_and_placement_import_one_way():
    """models places a model through placement; placement never imports models back (no cycle)."""
    import ast
    from pathlib import Path

    import harness.models.loading
    import harness.models.placement

    def harness_imports(module) -> set[str]:
        tree = ast.parse(Path(module.__file__).read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        return {name for name in found if name.startswith("harness.")}

    assert "harness.models.placement" in harness_imports(harness.models.loading)
    assert not {name for name in harness_imports(harness.models.placement) if name.startswith("harness.models.loading")}
    assert issubclass(PlacementError, cli.user_errors()[0])  # a UserError: one clean line on the command line
