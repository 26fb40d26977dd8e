"""Where compared runs come from: MLflow (selected by experiment, sweep id, tags or id) or
results directories written by ``harness.job.pipeline``. Each becomes a :class:`RunData` holding the
run's summary and its per-item, per-token and generation tables.

Only the tables a comparison reads are downloaded from MLflow (summary, config, items,
tokens, generation, a thinking run's trace lengths, a ``perf.json`` of serving speed); comparison runs (tag ``harness.kind=comparison``) and unfinished runs
are never selected.
"""
from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from harness.results.tracking import RUN_KEY_TAG, SWEEP_TAG

__all__ = ["COMPARISON_KIND", "KIND_TAG", "RunData", "load_mlflow_run", "load_results_dir", "select_runs"]

KIND_TAG = "harness.kind"
COMPARISON_KIND = "comparison"
REQUIRED_ARTIFACTS = ("summary.json", "items.parquet")
OPTIONAL_ARTIFACTS = ("config.json", "tokens.parquet", "generation.parquet", "long_generation_survival.parquet",
                      "thinking.parquet", "perf.json")
# what a comparison reads of a thinking run's traces (harness.evaluation.thinking.trace_frame): lengths and states
THINKING_COLUMNS = ("item_id", "slice", "cluster", "trace_tokens_ref", "trace_tokens_quant", "cap_hit_ref",
                    "cap_hit_quant", "unclosed_ref", "unclosed_quant", "state_ref", "state_quant")


@dataclass
class RunData:
    """One finished run: its summary and the per-item, per-token and generation tables."""

    run_id: str | None
    summary: dict[str, Any]
    items: pd.DataFrame
    tokens: pd.DataFrame
    generation: pd.DataFrame
    config: dict[str, Any] = field(default_factory=dict)
    survival: pd.DataFrame = field(default_factory=pd.DataFrame)  # long generation: position, survival
    thinking: pd.DataFrame = field(default_factory=pd.DataFrame)  # a thinking model's traces (THINKING_COLUMNS)
    perf: dict[str, Any] = field(default_factory=dict)  # serving speed measured on an engine (perf.json)
    source: str = ""
    label: str = ""  # filled in by ``analyse`` (unique across the compared runs)

    @property
    def model(self) -> str:
        return str(self.summary.get("model", "?"))

    @property
    def scheme(self) -> str:
        return str(self.summary.get("scheme", "?"))

    @property
    def bits_per_weight(self) -> float:
        value = self.summary.get("quant", {}).get("bits_per_weight")
        return float(value) if value is not None else math.nan


def _read_table(path: Path) -> pd.DataFrame:
    return pd.read_parquet(path) if path.exists() else pd.DataFrame()


def _read_thinking(path: Path) -> pd.DataFrame:
    if not path.exists():
        return pd.DataFrame()
    import pyarrow.parquet as pq

    present = set(pq.read_schema(path).names)
    return pd.read_parquet(path, columns=[c for c in THINKING_COLUMNS if c in present])


def load_results_dir(directory: str | Path) -> RunData:
    """A run from its results directory (``results/<run>/``) as written by ``harness.job.pipeline``."""
    directory = Path(directory)
    missing = [name for name in REQUIRED_ARTIFACTS if not (directory / name).exists()]
    if missing:
        raise FileNotFoundError(f"{directory} lacks {missing}: not a finished results directory of harness.job.pipeline "
                                "(summary.json is written last; rerun the job or pick another directory)")
    config_path = directory / "config.json"
    return RunData(
        run_id=None,
        summary=json.loads((directory / "summary.json").read_text()),
        items=pd.read_parquet(directory / "items.parquet"),
        tokens=_read_table(directory / "tokens.parquet"),
        generation=_read_table(directory / "generation.parquet"),
        config=json.loads(config_path.read_text()) if config_path.exists() else {},
        source=str(directory),
        survival=_read_table(directory / "long_generation_survival.parquet"),
        thinking=_read_thinking(directory / "thinking.parquet"),
        perf=json.loads((directory / "perf.json").read_text()) if (directory / "perf.json").exists() else {},
    )


def load_mlflow_run(client: Any, run_id: str) -> RunData:
    """Download one run's artifacts (only the tables the comparison reads) and load them."""
    available = {entry.path for entry in client.list_artifacts(run_id)}
    missing = [name for name in REQUIRED_ARTIFACTS if name not in available]
    if missing:
        raise FileNotFoundError(f"MLflow run {run_id} has no {missing} artifacts (has {sorted(available)}); "
                                "it was not logged by harness.job.pipeline — drop it from runs= or fix its tags")
    with tempfile.TemporaryDirectory(prefix="harness-compare-") as tmp:
        for name in (*REQUIRED_ARTIFACTS, *OPTIONAL_ARTIFACTS):
            if name in available:
                client.download_artifacts(run_id, name, tmp)
        data = load_results_dir(tmp)
    data.run_id = run_id
    data.source = f"runs:/{run_id}"
    return data


def _quote(value: str, what: str) -> str:
    if "'" in value:
        raise ValueError(f"{what} {value!r} contains a single quote, which MLflow filters cannot match; "
                         "select these runs with runs=[...] instead")
    return f"'{value}'"


def select_runs(client: Any, experiment: str, *, tags: Mapping[str, str] | None = None, sweep: str | None = None,
                run_ids: Sequence[str] = ()) -> list[Any]:
    """Finished, non-comparison MLflow runs of ``experiment`` matching every tag (oldest first).

    ``sweep`` matches the ``harness.sweep_id`` tag; ``run_ids`` bypasses the search.
    """
    if run_ids:
        found = [client.get_run(run_id) for run_id in run_ids]
        comparisons = [r.info.run_id for r in found if r.data.tags.get(KIND_TAG) == COMPARISON_KIND]
        if comparisons:
            raise ValueError(f"runs {comparisons} are comparison runs, not evaluation runs; drop them from runs=")
        return found
    found_experiment = client.get_experiment_by_name(experiment)
    if found_experiment is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ValueError(f"no MLflow experiment {experiment!r} at {client.tracking_uri}; experiments there: {names}")
    wanted = dict(tags or {})
    if sweep:
        wanted[SWEEP_TAG] = sweep
    clauses = ["attributes.status = 'FINISHED'"]
    clauses += [f"tags.`{key}` = {_quote(str(value), f'tag {key}')}" for key, value in sorted(wanted.items())]
    found, token = [], None
    while True:
        page = client.search_runs([found_experiment.experiment_id], filter_string=" and ".join(clauses),
                                  max_results=1000, order_by=["attributes.start_time ASC"], page_token=token)
        found.extend(page)
        token = page.token
        if not token:
            break
    selected = [r for r in found if r.data.tags.get(KIND_TAG) != COMPARISON_KIND and RUN_KEY_TAG in r.data.tags]
    if not selected:
        raise ValueError(f"no finished harness runs in experiment {experiment!r} match {wanted or 'any tag'}; "
                         "check the sweep id / tags (MLflow UI: Runs → Tags) or pass runs=[...]")
    return selected
