"""quant-harness: does quantization hurt this model, item by item, slice by slice?

The public API mirrors the pipeline's stages, so a notebook can run one stage at a time
with the CLI's own code::

    import harness
    cfg = harness.compose(["model=smollm2_135m", "quant=int4_g128", "slices=[math]"])
    run_cfg = harness.to_config(cfg)
    loaded = harness.load_model(run_cfg.model, run_cfg.paths.cache_dir)          # load
    slices = harness.resolve_slices(run_cfg.slices)
    ref = harness.reference(loaded, slices[0], run_cfg, harness.Cache(run_cfg.paths.cache_dir))
    report = harness.quantize(loaded.model, harness.with_model_defaults(run_cfg.quant,
                              run_cfg.model.ragged_groups))                         # quantize
    lm = harness.make_lm(loaded.model, loaded.tokenizer, harness.eval_settings(run_cfg, None))
    records, _ = harness.evaluate_slice(lm, slices[0], harness.eval_settings(run_cfg, None))  # evaluate
    tokens = harness.divergence_rows(loaded.model, ref.texts, slices[0].name)      # divergence
    comparison = harness.build_comparison(ref.records, records, tokens, run_cfg.compare,
                                 list(run_cfg.eval.position_buckets), tokenize=...)  # compare
    harness.run_job(cfg)   # or everything at once, results on disk + MLflow        # log

Imports are lazy so ``import harness`` stays cheap.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "compose": ("harness.config", "compose"),
    "to_config": ("harness.config", "to_config"),
    "run_job": ("harness.job.pipeline", "run"),
    "eval_settings": ("harness.job.identity", "eval_settings"),
    "reference": ("harness.job.reference", "reference"),
    "load_model": ("harness.models.loading", "load"),
    "quantize": ("harness.quant", "apply"),
    "with_model_defaults": ("harness.quant", "with_model_defaults"),
    "resolve_slices": ("harness.evaluation.slices", "resolve"),
    "make_lm": ("harness.evaluation.evaluate", "make_lm"),
    "evaluate_slice": ("harness.evaluation.evaluate", "evaluate_slice"),
    "score_reference": ("harness.divergence.scoring", "score_reference"),
    "divergence_rows": ("harness.divergence.scoring", "compare_to_reference"),
    "build_comparison": ("harness.results.summary", "build"),
    "compare_runs": ("harness.compare", "compare_runs"),
    "paired_compare": ("harness.stats", "paired_compare"),
    "log_results": ("harness.results.tracking", "log_results"),
    "Cache": ("harness.infra.cache", "Cache"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    return getattr(importlib.import_module(module), attribute)
