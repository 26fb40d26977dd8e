"""What a comparison selects and how it tests: :class:`CompareOptions`, one field per
``key=value`` argument of ``python -m harness.compare`` (``help=`` is what --help shows)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from harness.config import CompareConfig, EvalConfig

__all__ = ["CORRECTIONS", "CompareOptions"]

CORRECTIONS = ("holm", "bh", "none")
_DEFAULTS = CompareConfig()


def _opt(default, help: str, **kwargs):  # noqa: A002 - "help" is the metadata key harness.cli reads
    if callable(default):
        return field(default_factory=default, metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class CompareOptions:
    """What to compare and how; every field is a ``key=value`` argument of the command."""

    experiment: str = _opt("quant-harness", "MLflow experiment holding the runs")
    tags: dict[str, str] = _opt(dict, "tags.KEY=VALUE: MLflow tags that must all match")
    sweep: str | None = _opt(None, "harness.sweep_id tag of a sweep")
    runs: list[str] = _opt(list, "explicit MLflow run ids (overrides the search)")
    dirs: list[str] = _opt(list, "results directories instead of MLflow")
    tracking_uri: str | None = _opt(None, "alias tracking.uri; None: $MLFLOW_TRACKING_URI, else ./mlflow.db")
    margin: float | None = _opt(_DEFAULTS.margin, "alias compare.margin; non-inferiority / equivalence margin "
                                                  "(0.01 = 1 point), null for none")
    correction: str = _opt("holm", "alias compare.correction; holm | bh | none, across ALL tests of the comparison")
    n_resamples: int = _opt(_DEFAULTS.n_resamples, "paired bootstrap resamples")
    seed: int = _opt(_DEFAULTS.seed, "bootstrap seed (rows depend only on seed and group)")
    ci_level: float = _opt(_DEFAULTS.ci_level, "confidence level of the intervals")
    alpha: float = _opt(0.05, "significance level after correction")
    position_buckets: list[int] = _opt(lambda: list(EvalConfig().position_buckets),
                                       "token position bucket edges for KL by position")
    name: str | None = _opt(None, "None: the sweep id, else the experiment name")
    out: str | None = _opt(None, "None: results/compare/<name>")
    log: bool = _opt(True, "log the comparison to MLflow (only when runs came from MLflow)")
    perf: list[str] = _opt(list, "perf.json files (or folders holding one) of python -m harness.parity speed=true, "
                                 "each matched to the compared run it measured: adds speed-up against quality (the "
                                 "Pareto front) and the ledger beside the engine; a run's own perf.json is read anyway")
    perf_device: str | None = _opt(None, "the device the speed was measured on, for the ledger's decode floor: a GPU "
                                         "name (H100) or NAME:memory_GB:bandwidth_TBps; None: the one perf.json names")
    parity: bool = _opt(False, "the runs, in the order given, are a scheme's simulation, its export served by an engine "
                               "and (optional) the reference served by that engine and the scheme's own floor (its "
                               "simulation with inputs moved in the last bit): add the simulation-against-served "
                               "table (python -m harness.parity)")

    def report_name(self) -> str:
        raw = self.name or self.sweep or self.experiment
        return re.sub(r"[^A-Za-z0-9_.+-]+", "_", raw).strip("_") or "comparison"

    def check(self) -> None:
        """Raise ``ValueError`` naming a bad correction or margin (before any run is loaded)."""
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction={self.correction!r} is unknown; use holm, bh or none")
        if self.margin is not None and not 0 < self.margin < 1:
            raise ValueError(f"margin={self.margin!r} must lie in (0, 1) (0.01 = 1 point) or be null")
        for path in self.perf:
            if not (Path(path).is_file() or (Path(path) / "perf.json").is_file()):
                raise ValueError(f"perf={path}: no perf.json there; give the perf.json written by python -m "
                                 "harness.parity speed=true, or the folder holding it")
        if self.perf_device and ":" in self.perf_device:
            parts = self.perf_device.split(":")
            try:
                if len(parts) != 3 or float(parts[1]) <= 0 or float(parts[2]) <= 0:
                    raise ValueError
            except ValueError:
                raise ValueError(f"perf_device={self.perf_device!r}: give NAME:memory_GB:bandwidth_TBps with positive "
                                 "numbers (e.g. L40S:48:0.864) or a GPU name (H100)") from None
