"""Registry slices (the *_full benchmarks): every one composes, and fails fast without the hub;
records keep one lm-eval filter per task."""
from __future__ import annotations

import pytest

from harness.job import pipeline as run_mod
from harness.config import CONF_DIR, SliceConfig
from harness.evaluation.evaluate import records_from_results
from harness.evaluation.slices import Slice, SliceError, check_hub_for_registry, resolve

# Registry benchmarks behind the five default slices; long_generation_full is the offline slice at full size.
OFFLINE_FULL = {"long_generation_full"}
FULL_SLICES = sorted(p.stem for p in (CONF_DIR / "slices").glob("*_full.yaml") if p.stem not in OFFLINE_FULL)


def test_every_default_slice_names_a_full_slice_that_exists():
    """The five slices of slices=all each have a registry benchmark for cluster runs (refusals and
    long_generation are this project's own item sets, with no registry counterpart)."""
    from omegaconf import OmegaConf

    defaults = sorted(OmegaConf.load(CONF_DIR / "slices" / "all.yaml")["defaults"])
    assert defaults and [f"{name}_full" for name in defaults] == FULL_SLICES


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL_SLICES)
def test_full_slice_composes_as_registry_and_fails_fast_offline(name, make_cfg, monkeypatch):
    cfg = run_mod.to_config(make_cfg("model=tiny_random", f"slices=[{name}]"))
    (slice_,) = resolve(cfg.slices)
    assert slice_.directory is None and slice_.config.tasks
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(SliceError, match="HF_\\(HUB\\|DATASETS\\)_OFFLINE is set"):
        check_hub_for_registry([slice_])


def test_math_full_is_gsm8k_scored_by_flexible_extract(make_cfg):
    cfg = run_mod.to_config(make_cfg("model=tiny_random", "slices=[math_full]"))
    assert cfg.slices["math_full"].tasks == ["gsm8k"] and cfg.slices["math_full"].filter == "flexible-extract"


def _results(filters: dict[str, list[float]]) -> dict:
    """simple_evaluate's output shape for one task logged under several filters (lm-eval 0.4)."""
    samples = [{"doc_id": i, "doc": {"question": f"q{i}"}, "doc_hash": f"h{i}", "target": str(i),
                "filtered_resps": [f"{name}-{i}"], "filter": name, "exact_match": score}
               for name, scores in filters.items() for i, score in enumerate(scores)]
    results = {f"exact_match,{name}": sum(scores) / len(scores) for name, scores in filters.items()}
    return {"samples": {"gsm8k": samples}, "results": {"gsm8k": results},
            "configs": {"gsm8k": {"output_type": "generate_until", "metric_list": [{"metric": "exact_match"}]}}}


def test_records_keep_the_configured_filter_once_per_item():
    results = _results({"strict-match": [0.0, 0.0, 1.0], "flexible-extract": [1.0, 0.0, 1.0]})
    slice_ = Slice("math_full", SliceConfig(tasks=["gsm8k"], registry=True, size="quick", filter="flexible-extract"), None)
    records, aggregates = records_from_results(results, slice_)
    assert records["item_id"].is_unique and len(records) == 3
    assert records["correct"].tolist() == [1.0, 0.0, 1.0]
    assert records["response"].tolist() == ["flexible-extract-0", "flexible-extract-1", "flexible-extract-2"]
    assert aggregates == {"gsm8k": pytest.approx(2 / 3)}


def test_records_default_to_the_first_filter_and_reject_an_unknown_one():
    results = _results({"strict-match": [0.0, 1.0], "flexible-extract": [1.0, 1.0]})
    first = Slice("s", SliceConfig(tasks=["gsm8k"], registry=True, size="quick"), None)
    records, aggregates = records_from_results(results, first)
    assert records["correct"].tolist() == [0.0, 1.0] and aggregates == {"gsm8k": 0.5}
    wrong = Slice("s", SliceConfig(tasks=["gsm8k"], registry=True, size="quick", filter="nope"), None)
    with pytest.raises(ValueError, match="no lm-eval filter 'nope'.*strict-match"):
        records_from_results(results, wrong)
