"""Shared fixtures: hermetic results/MLflow/reference caches per test, one shared model cache.

Dequantized packaged weights are expensive to make (tens of seconds) and identical for
every test, so the ``models`` namespace of each test cache links to the user's model
cache; everything else a test writes (reference cache, results, MLflow) is under tmp_path.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from harness.config import compose

USER_CACHE = Path(os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness")).expanduser()


@pytest.fixture(scope="session")
def shared_model_cache() -> Path:
    models = USER_CACHE / "models"
    models.mkdir(parents=True, exist_ok=True)
    return models


@pytest.fixture
def cache_dir(tmp_path: Path, shared_model_cache: Path) -> Path:
    root = tmp_path / "cache"
    root.mkdir()
    (root / "models").symlink_to(shared_model_cache)
    return root


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    """An empty MLflow store with its tables made. A new sqlite store runs MLflow's ~60 alembic
    migrations (3-6 s on this CPU), so each test's store starts as a copy of this one: the same
    file MLflow would make, made once per worker."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def make_cfg(tmp_path: Path, cache_dir: Path, mlflow_template: Path):
    """Compose a run config as the CLI would, with all outputs under tmp_path (MLflow: tmp_path/mlflow.db,
    a copy of the empty template)."""
    shutil.copyfile(mlflow_template, tmp_path / "mlflow.db")

    def _make(*overrides: str):
        return compose([
            f"paths.results_dir={tmp_path / 'results'}",
            f"paths.cache_dir={cache_dir}",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
            "compare.n_resamples=1000",
            *overrides,
        ])

    return _make


# Both math tasks (the multiple-choice one is opt-in since issue 12): the tests cover loglikelihood scoring too.
TINY_MATH = ["model=tiny_random", "slices=[math]", "slices.math.n_items=18", "slices.math.divergence_texts=4",
             "slices.math.tasks=[harness_math_gen,harness_math_mc]"]
