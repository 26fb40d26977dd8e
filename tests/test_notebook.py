"""notebooks/analysis.ipynb executes headless on runs of the tiny model, so it cannot rot.

Two finished runs go into a temporary MLflow store; the notebook's parameters are overridden
papermill-style (a cell injected after the one tagged ``parameters``) and it runs with
nbclient on the ``python3`` kernel, which jupyter_client starts with this interpreter
(``sys.executable``, the project's virtual environment): the notebook prints it and the
test checks it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from harness.job import pipeline as run_mod
from harness.config import REPO_DIR, compose

NOTEBOOK = REPO_DIR / "notebooks" / "analysis.ipynb"


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory, shared_model_cache) -> dict:
    root = tmp_path_factory.mktemp("notebook")
    cache = root / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(shared_model_cache)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    for scheme in ("int4", "int8"):
        cfg = run_mod.to_config(compose([
            f"paths.results_dir={root / 'results'}", f"paths.cache_dir={cache}", f"tracking.uri={uri}",
            "model=tiny_random", "slices=[math]", "slices.math.n_items=4", "slices.math.divergence_texts=2",
            f"quant={scheme}", "tracking.experiment=nb-test"]))
        cfg.tracking.tags["harness.sweep_id"] = "nightly"
        run_mod.run(cfg)
    return {"root": root, "uri": uri}


def inject_parameters(notebook: nbformat.NotebookNode, values: dict) -> None:
    """Insert a cell assigning ``values`` right after the cell tagged "parameters" (papermill's rule)."""
    index = next(i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", []))
    source = "\n".join(f"{key} = {value!r}" for key, value in values.items())
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = ["injected-parameters"]
    notebook.cells.insert(index + 1, cell)


def _text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def _tagged(notebook: nbformat.NotebookNode, tag: str) -> nbformat.NotebookNode:
    return next(cell for cell in notebook.cells if tag in cell.metadata.get("tags", []))


@pytest.mark.slow
def test_notebook_executes_on_tiny_runs(tiny_store, tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    out_dir = tmp_path / "out"
    inject_parameters(notebook, {"TRACKING_URI": tiny_store["uri"], "EXPERIMENT": "nb-test", "SWEEP": "nightly",
                                 "N_RESAMPLES": 300, "OUT_DIR": str(out_dir)})
    client = NotebookClient(notebook, kernel_name="python3", timeout=300,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first failing cell

    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []
    assert f"kernel python: {sys.executable}" in _text(_tagged(notebook, "setup"))
    assert "2 runs" in _text(_tagged(notebook, "compare"))
    listing = _text(_tagged(notebook, "listing"))
    assert "int4" in listing and "int8" in listing
    matrix = _tagged(notebook, "matrix")["outputs"][0]["data"]
    assert "<table" in matrix["text/html"] and "int4" in matrix["text/html"] and "math" in matrix["text/html"]
    images = [o for o in _tagged(notebook, "plots")["outputs"] if "image/png" in o.get("data", {})]
    assert len(images) >= 4  # forest, forest per sub-slice, flips, KL CDF, accuracy vs bits
    for name in ("comparison.html", "comparison.md", "forest.png", "kl_cdf.png", "accuracy_vs_bits.png"):
        assert (Path(out_dir) / name).stat().st_size > 0, name
    assert "tests," in _text(_tagged(notebook, "correction"))
