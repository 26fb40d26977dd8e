"""The gate's input: finding finished runs, reading them, and checking they can be gated together.

A run is ``results/<run>/`` as a job writes it (summary.json, the paired per-item table items.parquet,
config.json). Everything that is wrong with the input, an unfinished or corrupt run, runs of
different models, margins outside (0, 1), slice names that match no run, is refused with one
:class:`GateInputError` naming the file and the fix, before any decision is made.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.config import GateConfig
from harness.errors import UsageError
from harness.results.tracking import SWEEP_TAG

_MODEL_IDENTITY = ("name", "source", "path", "gguf_file", "revision", "dtype")



class GateInputError(UsageError):
    """Results the gate cannot decide on (unfinished, mixed models, bad margins); says what would work."""


@dataclass
class RunResults:
    directory: Path
    summary: dict[str, Any]
    config: dict[str, Any]
    items: pd.DataFrame


def _looks_like_run(directory: Path) -> bool:
    return any((directory / name).exists() for name in ("summary.json", "config.json", "items.parquet", "checkpoint"))


def find_runs(path: Path) -> list[Path]:
    """``path`` itself when it is a run directory, else its run subdirectories (a sweep's results dir)."""
    if not path.is_dir():
        raise GateInputError(f"{path} is not a directory; pass a results/<run>/ directory or a directory of runs")
    if _looks_like_run(path):
        return [path]
    runs = sorted(child for child in path.iterdir() if child.is_dir() and _looks_like_run(child))
    if not runs:
        raise GateInputError(f"{path} holds no run results (no summary.json in it or its subdirectories); pass the "
                             "results/<run>/ directory a job wrote, or paths.results_dir of a sweep")
    return runs


_SCORE_COLUMNS = ("correct_ref", "correct_quant")
_ITEM_COLUMNS = ("slice", *_SCORE_COLUMNS)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GateInputError(f"{path} is not readable JSON ({type(exc).__name__}: {exc}): the file was truncated or "
                             "edited; rerun the job with force=true to rewrite it, or leave its directory out") from None
    if not isinstance(value, dict):
        raise GateInputError(f"{path} holds a {type(value).__name__}, not the JSON object a job writes; rerun the job "
                             "with force=true, or leave its directory out")
    return value


def _read_items(path: Path) -> pd.DataFrame:
    try:
        items = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for truncated / foreign files
        raise GateInputError(f"{path} is not a readable parquet table ({type(exc).__name__}: {str(exc)[:120]}): the "
                             "file was truncated or replaced; rerun the job with force=true to rewrite it") from None
    missing = [c for c in _ITEM_COLUMNS if c not in items.columns]
    if missing:
        raise GateInputError(f"{path} lacks the column(s) {missing} the paired test needs (has {list(items.columns)}); "
                             "it was not written by this harness version: rerun the job with force=true")
    for column in _SCORE_COLUMNS:
        values = pd.to_numeric(items[column], errors="coerce").to_numpy(float)
        bad = ~np.isfinite(values) | (values < 0) | (values > 1)
        if bad.any():
            first = items.iloc[int(np.flatnonzero(bad)[0])]
            raise GateInputError(f"{path}: {int(bad.sum())} row(s) of {column} are not scores in [0, 1] (NaN or out "
                                 f"of range; first: slice {first['slice']!r}, value {first[column]!r}); the job did "
                                 "not score those items: rerun it with force=true, or drop them and gate again")
    return items


def load_run(directory: Path) -> RunResults:
    """A finished run; an unfinished one (no summary.json, written last) or a corrupt one is refused."""
    if not (directory / "summary.json").exists():
        raise GateInputError(f"{directory} is not a finished run (no summary.json, which a job writes last): let the "
                             "job finish, or rerun it (it resumes from its checkpoint), then gate again")
    missing = [name for name in ("config.json", "items.parquet") if not (directory / name).exists()]
    if missing:
        raise GateInputError(f"{directory} has summary.json but not {', '.join(missing)} (an older harness version or "
                             "removed files): the paired test needs the per-item table; rerun the job with force=true")
    summary = _read_json(directory / "summary.json")
    config = _read_json(directory / "config.json")
    items = _read_items(directory / "items.parquet")
    return RunResults(directory, summary, config, items)


def _lenient_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def run_identity(directory: Path) -> dict[str, Any]:
    """Model name and sweep id of a run directory without loading it (for the filters): from
    config.json and summary.json when readable, else the run.json a job writes when it starts."""
    started = _lenient_json(directory / "run.json")
    config = _lenient_json(directory / "config.json")
    summary = _lenient_json(directory / "summary.json")
    model = (config.get("model") or {}).get("name") or started.get("model")
    sweep_id = ((summary.get("tags") or {}).get(SWEEP_TAG) or ((config.get("tracking") or {}).get("tags") or {})
                .get(SWEEP_TAG) or started.get("sweep_id"))
    return {"model": model, "sweep_id": None if sweep_id is None else str(sweep_id)}


def check_same_model(runs: list[RunResults], paths: list[Path] | None = None) -> None:
    """One gate decides for one reference model: runs of different models are refused, with the
    command that gates each model's runs (``model=<name>``)."""
    groups: dict[tuple, list[RunResults]] = {}
    for run in runs:
        groups.setdefault(tuple((run.config.get("model") or {}).get(k) for k in _MODEL_IDENTITY), []).append(run)
    if len(groups) > 1:
        described = sorted(f"{key[0]} ({key[2] or key[1]}): {len(group)} run{'s' * (len(group) > 1)}"
                           for key, group in groups.items())
        where = " ".join(str(path) for path in paths or []) or "<results>"
        commands = " or ".join(f"`python -m harness.gate {where} model={name}`"
                               for name in sorted({str(key[0]) for key in groups}))
        raise GateInputError(f"the runs compare different reference models ({'; '.join(described)}); gate one "
                             f"model's runs at a time: {commands}")


def check_config(cfg: GateConfig) -> None:
    """Margins and levels in range, before any file is read."""
    for name, value in [("gate.margin", cfg.margin), *((f"gate.margins.{k}", v) for k, v in cfg.margins.items())]:
        if value is not None and not 0 < value < 1:
            raise GateInputError(f"{name}={value!r} must lie in (0, 1): a fraction of accuracy, 0.02 = 2 points")
    if not 0 < cfg.alpha < 1:
        raise GateInputError(f"gate.alpha={cfg.alpha!r} must lie in (0, 1), e.g. 0.05")
    if cfg.correction not in (None, "holm", "bh", "none"):
        raise GateInputError(f"gate.correction={cfg.correction!r}: use holm, bh or none (or leave it unset for "
                             "the run's compare.correction)")
    if cfg.min_clusters_pass < 0:
        raise GateInputError(f"gate.min_clusters_pass={cfg.min_clusters_pass} must be >= 0 (0: no minimum)")
    if cfg.min_items < 1 or cfg.min_clusters < 2:
        raise GateInputError(f"gate.min_items={cfg.min_items} must be >= 1 and gate.min_clusters={cfg.min_clusters} "
                             ">= 2 (a clustered SE needs two clusters)")
    for name, value in [("gate.mc_chance", cfg.mc_chance), *((f"gate.chance.{k}", v) for k, v in cfg.chance.items())]:
        if not 0 <= value < 1:
            raise GateInputError(f"{name}={value!r} must lie in [0, 1): the accuracy of guessing")


def check_slice_names(cfg: GateConfig, runs: list[RunResults]) -> None:
    """Per-slice settings must name slices that some run has (a typo would silently use the default)."""
    present = set().union(*(set(r.items["slice"].unique()) for r in runs))
    named = {f"gate.{group}": set(getattr(cfg, group)) for group in ("margins", "chance", "token_slices")}
    named["gate.slices"] = set(cfg.slices)
    for group, slices in named.items():
        unknown = sorted(slices - present)
        if unknown:
            raise GateInputError(f"{group} names slice(s) {unknown} that no gated run has; the runs' slices: "
                                 f"{', '.join(sorted(present))}")
