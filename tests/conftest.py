"""Shared fixtures: hermetic results/MLflow/reference caches per test, one shared model cache.

Dequantized packaged weights are expensive to make (tens of seconds) and identical for
every test, so the ``models`` namespace of each test cache links to the user's model
cache; everything else a test writes (reference cache, results, MLflow) is under tmp_path.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from harness.config import compose

USER_CACHE = Path(os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness")).expanduser()


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's torch gets its share of the CPUs, not all of them.

    torch's default is one thread per CPU; with every worker doing that, two workers on two
    cores run four spinning OpenMP threads, and every parallel region waits for a thread that
    shares its core (harness/infra/runtime.py measured 4x on this machine; a SmolLM2 test took 782 s
    under xdist against 182 s alone). ``OMP_NUM_THREADS`` is set too, so the jobs a test starts
    (``runtime.threads=null`` reads it) and the subprocesses it spawns inherit the share. A
    value the user exported is kept.
    """
    from harness.infra.runtime import choose_threads

    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    cpus, _ = choose_threads(None)  # the CPUs this run was given, as a job would count them
    share = max(1, cpus // max(1, int(workers)))
    os.environ["OMP_NUM_THREADS"] = str(share)
    import torch

    torch.set_num_threads(share)


# The test files that take longest (seconds of test time, 2 workers, idle: make test --durations=0 on
# 2026-12-02): run first, so that no worker starts a long file while the others run out of work. With
# --no-loadscope-reorder (Makefile) xdist hands out files in collection order; pytest-xdist's default
# order (most tests first) put the two-test console file, 190 s, last.
LONGEST_FIRST = ("test_endpoint_vllm.py",  # a real vLLM server: 4 jobs, ~14 min at load 10 (2026-12-03)
                 "test_parity_vllm.py",  # an export, 3 jobs, two vLLM servers: 8.6 min at load 7 (2026-12-03)
                 "test_smoke_matrix.py", "test_console.py",  # 182, 122 s in a suite run of 2026-12-02
                 "test_bf16.py", "test_sweeps.py", "test_resume.py",  # ~110, 109, ~100
                 "test_tracking_server.py", "test_slice_long_context.py", "test_pipeline.py",  # 75-64
                 "faults/test_fault_disk.py", "test_sweep_overlap.py", "faults/test_fault_reference_process.py",
                 "test_models.py", "test_export.py",  # ~58-44
                 "test_tracking_ui.py", "test_slurm.py", "test_slice_multilingual.py", "test_compare.py",
                 "test_background_reference.py", "quant/test_w8a8_bf16.py")  # 37-31


def require_venv(python: Path, what: str, script: str) -> None:
    """Skip a test whose separate venv (``python``) is missing, or fail it when CI demands the system tiers
    (HARNESS_REQUIRE_SYSTEM_TESTS=1); the message names the script that creates the venv."""
    if python.exists():
        return
    message = f"{what} venv missing ({python}): create it with `bash {script}`"
    if os.environ.get("HARNESS_REQUIRE_SYSTEM_TESTS") == "1":
        pytest.fail(message + " (HARNESS_REQUIRE_SYSTEM_TESTS=1)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread: tiny models run fastest so, and are least disturbed by other jobs on the cores; the
    previous count is restored when the module ends. A whole file: ``pytestmark =
    pytest.mark.usefixtures("one_thread")``; one test: ``@pytest.mark.usefixtures("one_thread")`` (the rest of
    its module then runs on one thread too); a module fixture: ``one_thread`` as its argument (hence module
    scope)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def perturbed_llama_pair(vocab_size: int = 96, num_hidden_layers: int = 1) -> tuple[Any, Any]:
    """A small random Llama (transformers) as the reference and a copy with every weight perturbed by 5 % of its
    mean magnitude as the "quantized" model; the reference's head is sharpened (x8) so that its distributions
    are far from uniform: KL well above float32 rounding, and top-k matters. Seeded: the same pair every call."""
    import copy

    import torch

    from tiny_models import tiny_llama

    reference = tiny_llama(vocab_size, layers=num_hidden_layers, max_position_embeddings=128)
    with torch.no_grad():
        reference.lm_head.weight.mul_(8.0)
    quantized = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in quantized.parameters():
            parameter.add_(0.05 * parameter.abs().mean() * torch.randn(parameter.shape, generator=generator))
    return reference, quantized


@pytest.fixture(scope="module")
def llama_pair() -> tuple[Any, Any]:
    """:func:`perturbed_llama_pair` with one layer and a 96-token vocabulary, built once per test file."""
    return perturbed_llama_pair()


def quantized_tiny(name: str, *extra: str) -> tuple[Any, Any, dict, list]:
    """The tiny random model with scheme ``name`` applied (8 calibration samples of 64 tokens; ``extra``
    overrides): (the prepared job, an unquantized copy of its model, the quantized target linears, the names
    kept in high precision)."""
    import copy

    from omegaconf import OmegaConf

    from harness import quant
    from harness.sizing.report_quant import prepare
    from harness.quant import target_linears

    cfg = OmegaConf.to_object(compose([f"quant={name}", "model=tiny_random", "quant.calibration.num_samples=8",
                                       "quant.calibration.seq_len=64", *extra]))
    prepared = prepare(cfg)
    reference = copy.deepcopy(prepared.loaded.model)
    quant.apply(prepared.loaded.model, prepared.scheme, prepared.context)
    targets, kept = target_linears(prepared.loaded.model, prepared.scheme)
    return prepared, reference, targets, kept
