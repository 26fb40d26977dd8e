"""Peer tier: mixture-of-experts checkpoints llm-compressor itself writes, loaded as external candidates.

llm-compressor (in .venv-peer, see scripts/peer_venv.sh and tests/test_peer_llmcompressor.py) quantizes a
tiny random ``qwen3_moe`` and ``mixtral`` with compressed-tensors' W4A16 preset (group 32, routers ignored as
its MoE examples do) and saves them; the harness loads each as a candidate, through transformers and
compressed-tensors. Every expert matrix must equal the harness's own int4 g32 full-range RTN of the same
weights (compressed-tensors' grid, ``int_range=full``) bit for bit. The peer writes Mixtral's experts as
``block_sparse_moe.experts.<e>.gate_proj`` (not transformers' ``w1``), which transformers 5.25 does not fuse:
the candidate loader reads those through compressed-tensors.
"""
from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from harness import quant
from harness.checkpoint import candidate
from harness.config import REPO_DIR, QuantConfig, TensorQuantConfig, compose
from harness.quant.experts import find_fused_experts
from tests.conftest import require_venv
from moe_models import build

PEER_PYTHON = Path(os.environ.get("HARNESS_PEER_VENV", REPO_DIR / ".venv-peer")) / "bin" / "python"
pytestmark = pytest.mark.slow

PEER = textwrap.dedent("""
    import sys
    from transformers import AutoModelForCausalLM
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from compressed_tensors.quantization import preset_name_to_scheme

    source, out = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(source, dtype="float32")
    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights.group_size = 32
    recipe = QuantizationModifier(config_groups={"group_0": scheme},
                                  ignore=["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"])
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(out)
""")


@pytest.fixture(autouse=True)
def _peer_venv() -> None:
    require_venv(PEER_PYTHON, "llm-compressor peer", "scripts/peer_venv.sh")


@pytest.mark.parametrize("model_type,renamed", [("qwen3_moe", False), ("mixtral", True)])
def test_llm_compressor_moe_checkpoint_loads_with_every_expert_as_the_harness_quantizes_it(
        model_type: str, renamed: bool, tmp_path: Path):
    from test_export_moe import _tokenizer

    reference = build(model_type)
    reference.save_pretrained(tmp_path / "source")
    out = tmp_path / "peer"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run([str(PEER_PYTHON), "-c", PEER, str(tmp_path / "source"), str(out)], check=True, env=env,
                   capture_output=True, timeout=600)
    stored = candidate.stored_tensors(out)
    expert = "block_sparse_moe.experts.0.gate_proj" if renamed else "mlp.experts.0.gate_proj"
    assert f"model.layers.0.{expert}.weight_packed" in stored  # one tensor set per expert, as the harness writes
    tokenizer = _tokenizer(out)
    cfg = OmegaConf.to_object(compose(["model=tiny_random", f"paths.cache_dir={tmp_path / 'cache'}"]))
    loaded, described = candidate.load(candidate.CandidateConfig(path=str(out)), cfg.model, cfg.paths.cache_dir,
                                       reference_model=reference, reference_tokenizer=tokenizer)
    experts = find_fused_experts(reference)
    matrices = sum(info.num_experts * len(info.projections()) for info in experts.values())
    assert described.details["experts_from_library"]["rewritten"] == (matrices if renamed else 0)
    ours = build(model_type)
    quant.apply(ours, QuantConfig(name="int4_g32_full", weights=TensorQuantConfig(
        format="int", bits=4, granularity="group", group_size=32, int_range="full")))
    theirs = find_fused_experts(loaded.model)
    for name, info in find_fused_experts(ours).items():
        for e in range(info.num_experts):
            for proj in info.projections():
                assert torch.equal(theirs[name].matrix(e, proj), info.matrix(e, proj)), (name, e, proj)
    report = candidate.weight_report(reference, loaded.model, described, sum(p.numel() for p in reference.parameters()))
    account = report.coverage.to_dict()
    assert account["uncovered_params"] == 0 and account["kept_by_rule"]["router"] > 0
