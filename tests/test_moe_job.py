"""A tiny random mixture-of-experts model through the whole job (issue 33): config → quantize → evaluate →
statistics → gate → MLflow, for a qwen3_moe and a mixtral configuration saved as a local checkpoint
(``model.source=hf model.path=<dir>``) with SmolLM2's tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.config import compose
from harness.infra.cache import Cache
from harness.job import pipeline
from harness.models.loading import load_tokenizer
from moe_models import build

pytestmark = pytest.mark.slow

TINY = ["slices=[math]", "slices.math.n_items=9", "slices.math.divergence_texts=3", "eval.max_gen_toks=8",
        "slices.math.tasks=[harness_math_mc]"]
SHAPES = {"qwen3_moe": dict(hidden_size=128, moe_intermediate_size=128, head_dim=32, num_experts=8,
                            num_experts_per_tok=2),
          "mixtral": dict(hidden_size=128, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)}


def checkpoint(root: Path, model_type: str, cache_dir: Path) -> Path:
    """A random MoE saved with SmolLM2's tokenizer: what ``model.source=hf`` loads."""
    tiny = compose(["model=tiny_random", f"paths.cache_dir={cache_dir}"])
    tokenizer = load_tokenizer(compose([f"model={tiny.model.tiny.tokenizer}"]).model, Cache(cache_dir))
    model = build(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  max_position_embeddings=2048, tie_word_embeddings=False, **SHAPES[model_type])
    directory = root / model_type
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("model_type,scheme", [("qwen3_moe", "int4_g128"), ("mixtral", "gptq_w4g128"),
                                               ("qwen3_moe", "none")])
@pytest.mark.usefixtures("one_thread")
def test_tiny_moe_runs_the_whole_job(tmp_path: Path, make_cfg, cache_dir: Path, model_type: str,
                                     scheme: str) -> None:
    directory = checkpoint(tmp_path, model_type, cache_dir)
    cfg = make_cfg(*TINY, f"quant={scheme}", "model=tiny_random", "model.source=hf", f"model.path={directory}",
                   f"model.name=tiny_{model_type}", "model.chat_template=false", "gate.enabled=true",
                   "quant.calibration.num_samples=4", "quant.calibration.seq_len=64",
                   "quant.calibration.format=plain")
    result = pipeline.run(cfg)
    written = next(Path(cfg.paths.results_dir).rglob("summary.json"))
    summary = json.loads(written.read_text())
    quant = summary["quant"]
    coverage = quant["coverage"]
    if scheme == "none":
        assert coverage["quantized_params"] == 0
        router = quant.get("router") or {}
        for entry in router.values():  # the reference routes exactly as itself
            assert entry.get("identical_mean", 1.0) == 1.0
        return
    attention = 2 * 128 * 128 + 2 * 64 * 128  # q, o; k, v (2 of 4 heads of 32)
    experts = {"qwen3_moe": 8, "mixtral": 4}[model_type] * 3 * 128 * 128
    assert coverage["uncovered_params"] == 0 and coverage["quantized_params"] == 2 * (attention + experts)
    assert set(coverage["kept_by_rule"]) >= {"embedding", "output_head", "router", "norm"}
    assert quant["bits_per_weight"] == pytest.approx(coverage["bits_per_weight"])
    assert "router" in quant, sorted(quant)
    router = quant["router"]["math"]
    assert 0.0 <= router["identical_mean"] <= router["overlap_mean"] <= 1.0
    assert len(router["per_layer"]) == 2
    assert "gate" in result
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert any(r.data.metrics.get("detail/quant/coverage_quantized_share") == pytest.approx(coverage["quantized_share"])
               and "detail/quant/router_identical_mean" in r.data.metrics for r in runs)
