"""Smoke matrix: every preset in conf/quant/ over slices=all on tiny_random, run to the end.

A few items per slice keep each run short, the reference is evaluated once for the whole
matrix (one shared harness cache), and calibration is shrunk for the calibrated schemes.
What must hold for every preset: the job finishes, writes its per-item records and its
statistics, and every statistic is finite or a documented NaN (harness.stats).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from harness.job import pipeline as run_mod
from harness.config import CONF_DIR, compose

# `external` evaluates a checkpoint given by candidate.path: tests/test_candidate_pipeline.py runs it.
PRESETS = sorted(path.stem for path in (CONF_DIR / "quant").glob("*.yaml") if path.stem != "external")
ITEMS = {"math": 4, "long_context": 4, "multilingual": 1, "code": 2, "structured": 4}  # multilingual: x 12
SLICES = tuple(ITEMS)
SMALL = [
    "model=tiny_random",
    "slices=all",
    *(f"slices.{name}.n_items={count}" for name, count in ITEMS.items()),
    *(f"slices.{name}.divergence_texts=1" for name in SLICES),
    "quant.calibration.num_samples=2",
    "quant.calibration.seq_len=32",
    "tracking.enabled=false",
    "compare.n_resamples=200",
    "+slices.multilingual.metadata.languages=[en,ar]",  # 2 of its 11 languages (Latin, Arabic): 12 items, not 66
    "eval.max_gen_toks=8",  # a random model never stops: uncapped, code's 256-token replies were a third of a preset
]
ALLOWED_NAN = ["delta_se", "delta_p", "delta_p_adj", "design_effect", "inferiority_p", "settleable", "delta_ci_low", "delta_ci_high", "mde", "noninferiority_p", "tost_p",
               "flip_rate_ci_low", "flip_rate_ci_high", "right_to_wrong_ci_low", "right_to_wrong_ci_high",
               "wrong_to_right_ci_low", "wrong_to_right_ci_high", "n_needed"]  # NaN/None with < 2 clusters


def test_the_matrix_covers_every_preset() -> None:
    assert len(PRESETS) >= 20 and "none" in PRESETS and "gptq_w4g128" in PRESETS and "awq_w4g128" in PRESETS


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory, shared_model_cache: Path) -> Path:
    """One harness cache for the whole matrix: the reference is evaluated once, not per preset."""
    root = tmp_path_factory.mktemp("smoke_cache")
    (root / "models").symlink_to(shared_model_cache)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_runs_every_slice_to_the_end(shared_cache: Path, tmp_path: Path, preset: str) -> None:
    cfg = compose([f"paths.results_dir={tmp_path / 'results'}", f"paths.cache_dir={shared_cache}", *SMALL,
                   f"quant={preset}"])
    result = run_mod.run(cfg)
    directory = next((tmp_path / "results").glob("*"))
    items = pd.read_parquet(directory / "items.parquet")
    assert set(items["slice"]) == set(SLICES)
    stats = pd.read_parquet(directory / "item_stats.parquet")
    assert set(stats.loc[stats["level"] == "slice", "slice"]) == set(SLICES)
    assert (stats["n_clusters"] >= 1).all() and (stats["n_clusters"] <= stats["n"]).all()
    for column in stats.columns:
        values = stats[column]
        if column in ALLOWED_NAN or not pd.api.types.is_numeric_dtype(values):
            continue
        assert values.notna().all(), f"{preset}: NaN in {column}"
    several = stats[stats["n_clusters"] >= 2]
    for column in ALLOWED_NAN:
        rows = several[several["settleable"].astype(bool)] if column == "n_needed" else several  # None: Δ̂ <= -m
        assert rows[column].map(lambda v: v is not None and math.isfinite(v)).all(), f"{preset}: {column}"
    assert set(stats.loc[stats["n_clusters"] < 5, "verdict"]) <= {"too few clusters"}
    assert math.isfinite(result["metrics"]["overall/acc_delta"])
