"""Peer tier: the harness's RTN INT4 against llm-compressor's on the tiny model, weight for weight.

llm-compressor runs in its own venv (.venv-peer, made by ``bash scripts/peer_venv.sh``: its
compressed-tensors pin clashes with the harness's), through benchmarks/peer_llmcompressor_worker.py;
the two sides exchange an HF checkpoint and safetensors files. Each tool's dequantized weights are
checked against its own documented convention, re-implemented here from the formulas (independent
of both tools), so every difference between them is accounted for:

- harness (``harness.quant.format_math.int_qparams``): ``s = amax / 7``, codes ``round(w / s)`` clamped
  to ``[-7, 7]`` (restricted symmetric range);
- compressed-tensors 0.19 (``calculate_qparams`` + ``calculate_range``, used by llm-compressor's
  memoryless min-max observer): ``s = amax / ((qmax - qmin) / 2) = amax / 7.5``, codes
  ``round(w / s)`` clamped to ``[-8, 7]`` — the full two's-complement range, so a group's largest
  negative weight lands on -8 (its ``w / s`` is -7.5, which rounds half-to-even to -8) and its
  largest positive one on 7 (7.5 rounds to 8, clamped to 7).

Both round half to even, keep fp32 scales for an fp32 model and have zero point 0.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from harness import quant
from harness.models import loading as models
from harness.config import REPO_DIR, compose
from harness.quant import format_math as formats
from tests.conftest import require_venv

PEER_PYTHON = Path(os.environ.get("HARNESS_PEER_VENV", REPO_DIR / ".venv-peer")) / "bin" / "python"
WORKER = REPO_DIR / "benchmarks" / "peer_llmcompressor_worker.py"



@pytest.fixture(autouse=True)
def _peer_venv() -> None:
    require_venv(PEER_PYTHON, "llm-compressor peer", "scripts/peer_venv.sh")


def grid(w: torch.Tensor, group: int, divisor: float, qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group RTN from the formula: per group s = amax / divisor, q = clamp(round(w / s)).

    Returns (dequantized weight, scales [out, in / group]); an all-zero group's scale is irrelevant
    (every code is 0), the tools use 1 (harness) and fp32 eps (compressed-tensors).
    """
    g = w.float().reshape(w.shape[0], -1, group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = amax / divisor
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(g / safe), qmin, qmax)
    return (q * safe).reshape(w.shape), scale[..., 0]


def compressed_tensors_grid(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    return grid(w, group, 7.5, -8, 7)


def harness_grid(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    return grid(w, group, 7.0, -7, 7)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """The seeded tiny model, built by the harness and saved as the HF checkpoint the peer loads."""
    cache = Path(os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness")).expanduser()
    cfg = OmegaConf.to_object(compose(["model=tiny_random"]))
    loaded = models.load(cfg.model, cache)
    out = tmp_path_factory.mktemp("peer") / "tiny"
    loaded.model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    return out, loaded


def run_peer(model_dir: Path, method: str, group: int, extra: list[str] | None = None) -> dict:
    """Run llm-compressor in .venv-peer; returns {weights, scales, info}."""
    from safetensors.torch import load_file

    prefix = model_dir.parent / f"{method}_g{group}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # the peer must not see the harness
    done = subprocess.run([str(PEER_PYTHON), str(WORKER), "--model", str(model_dir), "--method", method,
                           "--group-size", str(group), "--out", str(prefix), *(extra or [])],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"weights": load_file(f"{prefix}.weights.safetensors"), "scales": load_file(f"{prefix}.scales.safetensors"),
            "info": json.loads(Path(f"{prefix}.json").read_text())}


def harness_rtn(loaded, group: int) -> dict[str, torch.Tensor]:
    import copy

    cfg = OmegaConf.to_object(compose(["model=tiny_random", f"quant=int4_g{group}"]))
    model = copy.deepcopy(loaded.model)
    report = quant.apply(model, quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups))
    assert report.layers, "the harness quantized no layer"
    return {layer.name: model.get_submodule(layer.name).weight.detach().float() for layer in report.layers}


@pytest.mark.slow
@pytest.mark.parametrize("group", [64, 128])
def test_rtn_w4a16_each_tool_matches_its_convention_and_differ_only_by_it(tiny, group):
    model_dir, loaded = tiny
    peer = run_peer(model_dir, "rtn", group)
    ours = harness_rtn(loaded, group)
    original = {name: m.weight.detach().float() for name, m in loaded.model.named_modules()
                if isinstance(m, torch.nn.Linear)}
    assert peer["info"]["observers"] == ["memoryless_minmax"] and peer["info"]["scheme"]["scale_dtype"] is None
    # Same layers: every linear but lm_head (the harness also keeps "*embed*", which is no Linear).
    assert set(peer["weights"]) == set(ours) == set(original) - {"lm_head"}
    codes_peer, codes_ours = set(), set()
    for name, w in original.items():
        if name == "lm_head":
            continue
        expected_peer, scale_peer = compressed_tensors_grid(w, group)
        expected_ours, scale_ours = harness_grid(w, group)
        assert torch.equal(peer["weights"][name], expected_peer), name  # bit for bit
        assert torch.equal(peer["scales"][name], scale_peer), name
        assert torch.equal(ours[name], expected_ours), name
        # The harness's own integer primitive reproduces the peer's grid when handed the peer's
        # qparams: s = amax / 7.5 and codes -8..7, i.e. its [0, 15] grid with zero point 8.
        view = w.reshape(w.shape[0], -1, group)
        s = scale_peer.unsqueeze(-1)
        assert torch.equal(formats.int_fake_quant(view, s, torch.full_like(s, 8.0), 4, symmetric=False)
                           .reshape(w.shape), peer["weights"][name]), name
        codes_peer |= set(torch.round(view / s).clamp(-8, 7).unique().tolist())
        codes_ours |= set(torch.round(view / scale_ours.unsqueeze(-1)).unique().tolist())
        # The two grids really differ (so the equalities above are not vacuous).
        assert not torch.equal(expected_peer, expected_ours), name
    assert codes_peer == set(range(-8, 8)) and codes_ours == set(range(-7, 8))


def test_gptq_grid_is_fixed_from_the_original_weights(tiny):
    """llm-compressor 0.14's GPTQ takes every group's scale from the observer on the ORIGINAL weights
    (the RTN scales), where the harness (like the reference GPTQ) recomputes each group's scale from
    the error-updated weights when it reaches it; both land on their own grids."""
    from safetensors.torch import save_file

    model_dir, loaded = tiny
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, loaded.model.config.vocab_size, (8, 64), generator=generator)
    tokens_file = model_dir.parent / "tokens.safetensors"
    save_file({"input_ids": tokens}, str(tokens_file))
    peer = run_peer(model_dir, "gptq", 64, ["--tokens", str(tokens_file)])
    assert peer["info"]["weights_stored_dequantized"] and peer["info"]["actorder"] is None
    changed = 0
    for name, deq in peer["weights"].items():
        w = loaded.model.get_submodule(name).weight.detach().float()
        _, rtn_scale = compressed_tensors_grid(w, 64)
        assert torch.equal(peer["scales"][name], rtn_scale), name
        codes = deq.reshape(w.shape[0], -1, 64) / rtn_scale.unsqueeze(-1)
        assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.round().abs().max() <= 8, name
        changed += int(not torch.equal(deq, compressed_tensors_grid(w, 64)[0]))
    assert changed == len(peer["weights"])  # GPTQ moved weights off plain RTN in every layer


@pytest.mark.parametrize("group", [64, 128])
def test_int_range_full_reproduces_llm_compressor_rtn_exactly(tiny, group):
    """`int_range: full` (the int4_g128_ct preset's grid) evaluates exactly what llm-compressor writes."""
    import copy

    model_dir, loaded = tiny
    peer = run_peer(model_dir, "rtn", group)
    cfg = OmegaConf.to_object(compose(["model=tiny_random", f"quant=int4_g{group}", "quant.weights.int_range=full"]))
    model = copy.deepcopy(loaded.model)
    report = quant.apply(model, quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups))
    assert {layer.name for layer in report.layers} == set(peer["weights"])
    for layer in report.layers:
        assert torch.equal(model.get_submodule(layer.name).weight.detach().float(), peer["weights"][layer.name]), \
            layer.name
