"""results/example is what the current code computes, and every number quoted from it is generated.

* The example's summary.json is recomputed from its items.parquet with the statistics of today's code
  (:func:`harness.results.summary.paired_statistics` at the run's own ``compare`` settings): any
  statistics change must come with a regenerated example (``scripts/regenerate_example.py``).
* Its records carry what today's job writes for the statistics (the declared strata).
* ``harness.compare`` on the example gives the intervals the run's own report.md gives.
* The README's and the docs' blocks about it are what ``scripts/example_docs.py`` renders from it.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.config import CompareConfig
from harness.results import summary

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "results" / "example"
KEYS = ["n", "n_clusters", "acc_ref", "acc_quant", "delta", "delta_ci_low", "delta_ci_high", "flips_right_to_wrong",
        "flips_wrong_to_right", "delta_p", "delta_p_adj"]


def _example_docs():
    spec = importlib.util.spec_from_file_location("example_docs", REPO / "scripts" / "example_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["example_docs"] = module
    spec.loader.exec_module(module)
    return module


def _recomputed(directory: Path) -> pd.DataFrame:
    config = json.loads((directory / "config.json").read_text())
    items = pd.read_parquet(directory / "items.parquet")
    table = summary.paired_statistics(items, CompareConfig(**config["compare"]))
    return table[table["level"].isin(["overall", "slice"])]


def _stored(directory: Path) -> dict[str, float]:
    return json.loads((directory / "summary.json").read_text())["metrics"]


def _differences(directory: Path) -> list[str]:
    stored, out = _stored(directory), []
    for row in _recomputed(directory).to_dict("records"):
        name = "overall" if row["level"] == "overall" else row["slice"]
        for key in KEYS:
            metric = f"{name}/{key.replace('delta', 'acc_delta') if key.startswith('delta') else key}"
            if metric not in stored or abs(float(row[key]) - stored[metric]) > 1e-9:
                out.append(f"{metric}: stored {stored.get(metric)}, recomputed {row[key]}")
    return out


def test_the_example_summary_is_what_todays_statistics_compute_from_its_items():
    differences = _differences(EXAMPLE)
    assert not differences, ("results/example is stale; run .venv/bin/python scripts/regenerate_example.py:\n"
                             + "\n".join(differences[:10]))


def test_the_example_records_carry_the_strata_todays_job_writes():
    items = pd.read_parquet(EXAMPLE / "items.parquet")
    assert "stratum" in items, "results/example predates declared strata; regenerate it"
    stats = pd.read_parquet(EXAMPLE / "item_stats.parquet")
    overall = stats[stats["level"] == "overall"].iloc[0]
    # overall: every (slice, cluster) pair is its own cluster, as the run's statistics count them
    assert int(overall["n_clusters"]) == items.groupby(["slice", "cluster"]).ngroups


def test_harness_compare_gives_the_intervals_the_runs_own_report_gives():
    from harness.compare.analysis import analyse
    from harness.compare.options import CompareOptions
    from harness.compare.sources import load_results_dir

    report = analyse([load_results_dir(EXAMPLE)], CompareOptions())
    theirs = report.item_stats[report.item_stats["level"].isin(["overall", "slice"])]
    stored = _stored(EXAMPLE)
    for row in theirs.to_dict("records"):
        name = "overall" if row["level"] == "overall" else row["slice"]
        assert (row["delta_ci_low"], row["delta_ci_high"]) == pytest.approx(
            (stored[f"{name}/acc_delta_ci_low"], stored[f"{name}/acc_delta_ci_high"]), abs=1e-12), name


def test_readme_and_docs_blocks_are_generated_from_the_example():
    docs = _example_docs()
    rendered = {name: render() for name, render in docs.BLOCKS.items()}
    used = set()
    for page in docs.PAGES:
        text = page.read_text()
        used |= {m["name"] for m in docs.BLOCK.finditer(text)}
        assert docs.rewrite(text, rendered) == text, (
            f"{page.relative_to(REPO)} quotes results/example otherwise than it computes; "
            "run .venv/bin/python scripts/example_docs.py")
    assert used == set(docs.BLOCKS), f"blocks no page uses: {set(docs.BLOCKS) - used}"


def test_the_readme_table_shows_every_slice_of_the_example_and_overall():
    docs = _example_docs()
    text = (REPO / "README.md").read_text()
    (block,) = [m["body"] for m in docs.BLOCK.finditer(text) if m["name"] == "table"]
    rows = {line.split("|")[1].strip() for line in block.splitlines()[2:] if line.startswith("|")}
    assert rows == {"overall", *json.loads((EXAMPLE / "summary.json").read_text())["slices"]}


def test_a_stale_example_is_caught(tmp_path):
    """The guard fails on an example whose stored statistics are not today's: here one whose items were
    re-clustered after its summary was written (as the strata change did to the old example)."""
    for name in ("config.json", "summary.json"):
        (tmp_path / name).write_text((EXAMPLE / name).read_text())
    items = pd.read_parquet(EXAMPLE / "items.parquet")
    items.assign(cluster=items["item_id"]).to_parquet(tmp_path / "items.parquet")  # every item its own cluster
    assert any("n_clusters" in d for d in _differences(tmp_path))
