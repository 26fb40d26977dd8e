"""The public API runs the pipeline one stage at a time with the CLI's own code."""
from __future__ import annotations

import pandas as pd
import pytest

import harness
from tests.conftest import TINY_MATH


@pytest.mark.slow
def test_stage_by_stage_equals_the_cli_pipeline(make_cfg, tmp_path):
    cfg = make_cfg(*TINY_MATH, "quant=int4")
    run_cfg = harness.to_config(cfg)
    loaded = harness.load_model(run_cfg.model, run_cfg.paths.cache_dir)
    slices = harness.resolve_slices(run_cfg.slices)
    ref = harness.reference(loaded, slices[0], run_cfg, harness.Cache(run_cfg.paths.cache_dir))
    report = harness.quantize(loaded.model, harness.with_model_defaults(run_cfg.quant, run_cfg.model.ragged_groups))
    assert report.summary()["layers_quantized"] == 14
    settings = harness.eval_settings(run_cfg, None)
    records, _ = harness.evaluate_slice(harness.make_lm(loaded.model, loaded.tokenizer, settings), slices[0], settings)
    tokens = harness.divergence_rows(loaded.model, ref.texts, slices[0].name)
    comparison = harness.build_comparison(ref.records, records, tokens, run_cfg.compare, list(run_cfg.eval.position_buckets),
                                 lambda t: loaded.tokenizer(t, add_special_tokens=False)["input_ids"])
    cli = harness.run_job(make_cfg(*TINY_MATH, "quant=int4"))  # reference reused from the same cache
    assert cli["reference_cached"] == {"math": True}
    items = pd.read_parquet(next((tmp_path / "results").glob("*")) / "items.parquet")
    merged = comparison.items.set_index("item_id").loc[items["item_id"]]
    assert (merged["correct_quant"].to_numpy() == items["correct_quant"].to_numpy()).all()
    # the CLI scores the divergence on the states its evaluation forwards left (one prefill per
    # prompt); divergence_rows runs its own forwards, batched otherwise: float rounding apart
    # (3.4e-8 relative, measured)
    assert comparison.metrics()["math/kl_mean"] == pytest.approx(cli["metrics"]["math/kl_mean"], rel=1e-6)
