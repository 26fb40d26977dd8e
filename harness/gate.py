"""``python -m harness.gate <results dir or sweep dir> [gate.margin=0.02 gate.margins.code=0.05 ...]``.

The ship / no-ship decision. For every finished run (``results/<run>/``: summary.json, the paired
per-item table items.parquet, the resolved config.json) and every slice, one inference — the
clustered paired score test of :mod:`harness.stats.score` — yields the interval that is printed and
the outcome read off it, at the slice's margin m and the gate's one-sided level α:

* **pass**: the lower bound of the printed 1 - 2α interval (90 % at α = 0.05) lies above -m:
  non-inferiority shown at level α. A run passes when every gated slice passes: an
  intersection-union test, so each slice at level α gives level α for the ship decision with no
  adjustment over slices (the least favourable case, one slice at Δ = -m and the rest clearly
  fine, is simulated by ``benchmarks/bench_gate_oc.py``).
* **fail**: inferiority beyond the margin shown: the upper bound of the same statistic's
  1 - 2α/k interval lies below -m, Bonferroni over the k gated slices (``correction=none``:
  k = 1), printed beside the verdict. A slice whose 1 - 2α interval lies wholly above -m never fails.
* **inconclusive**: anything else. Reasons: too few items (``min_items``), too few clusters
  (``min_clusters``), a slice of multi-item clusters that would pass with fewer than
  ``min_clusters_pass`` (20) clusters (there the score test's measured false-pass rate exceeds α:
  flips concentrated in a few sources that a handful of clusters may not include), the reference near the floor or chance (accuracy − chance < ``min_headroom``:
  a slice the reference mostly gets wrong cannot show a loss; checked before a pass, not before a
  fail), or the interval straddles -m. Then ``n_needed`` is the number of items that would give
  80 % power if the true Δ were 0 (at the slice's observed discordance and design effect), or
  "cannot be settled by more items" when the estimate itself is at or beyond -m.

The false-pass rate at Δ = -m and the power at Δ = 0 and -m/2 of this rule, over sizes, cluster
structures, accuracies, flip patterns and partial credit, are in the README (bench_gate_oc).

A sequential run (``eval.sequential=true``, :mod:`harness.sequential`) is read off its confidence
sequence instead, recomputed from items.parquet and not_evaluated.parquet at this gate's α, k and
margins: pass ⇔ its lower bound at α lies above -m, fail ⇔ its upper bound at α/k lies below -m.

Optional token-level gates compare the run's per-slice ``kl_mean`` / ``top1_agree`` point
estimates with ``gate.token`` (every slice) or ``gate.token_slices.<slice>`` limits; a slice
without token rows is inconclusive on them. A slice's outcome is its worst criterion (fail >
inconclusive > pass), a run's its worst slice.

A directory of runs (``paths.results_dir`` of a sweep) gates each run (each run its own
decision); ``model=<name>`` and ``sweep=<harness.sweep_id>`` pick runs from a directory that holds
several models or sweeps, before any run is loaded (from the run.json a job writes when it starts).

Exit status: 0 every slice passes, 1 any fails, 2 none fails but some are inconclusive, 3 bad input
(unfinished or corrupt run, NaN scores, runs of different models, margin outside (0, 1), unknown
option, ...: one line naming the file and the fix). Writes ``gate.json`` and ``gate.xml`` (JUnit:
one test case per slice and criterion, inconclusive as skipped, the numbers in the message) into
the given directory, or ``out=``.
"""
from __future__ import annotations

import json
import logging
import math
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from harness import cli, sequential, stats
from harness.cache import atomic_write_json, atomic_write_text
from harness.config import GateConfig, TokenGateConfig
from harness.tracking import SWEEP_TAG

log = logging.getLogger("harness.gate")

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
EXIT_CODES = {PASS: 0, FAIL: 1, INCONCLUSIVE: 2}
EXIT_BAD_INPUT = 3
_RANK = {PASS: 0, INCONCLUSIVE: 1, FAIL: 2}
_MODEL_IDENTITY = ("name", "source", "path", "gguf_file", "revision", "dtype")


class GateInputError(cli.UsageError):
    """Results the gate cannot decide on (unfinished, mixed models, bad margins); says what would work."""


def worst(outcomes: list[str]) -> str:
    return max(outcomes, key=_RANK.__getitem__) if outcomes else INCONCLUSIVE


@dataclass
class Criterion:
    """One test case: a slice under one criterion (accuracy non-inferiority, kl_mean, top1_agree)."""

    slice: str
    criterion: str
    outcome: str
    message: str
    reasons: list[str] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunDecision:
    run_name: str
    directory: str
    model: str
    scheme: str
    criteria: list[Criterion]

    @property
    def outcome(self) -> str:
        return worst([c.outcome for c in self.criteria])

    def slice_outcomes(self) -> dict[str, str]:
        slices = dict.fromkeys(c.slice for c in self.criteria)
        return {s: worst([c.outcome for c in self.criteria if c.slice == s]) for s in slices}


@dataclass
class GateDecision:
    runs: list[RunDecision]
    config: dict[str, Any]

    @property
    def outcome(self) -> str:
        return worst([r.outcome for r in self.runs])

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.outcome]

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "exit_code": self.exit_code, "config": self.config,
                "runs": [{"run_name": r.run_name, "directory": r.directory, "model": r.model, "scheme": r.scheme,
                          "outcome": r.outcome, "slices": r.slice_outcomes(),
                          "criteria": [asdict(c) for c in r.criteria]} for r in self.runs]}


# ----------------------------------------------------------------------------------- input
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


def check_same_model(runs: list[RunResults]) -> None:
    """One gate decides for one reference model: runs of different models are refused."""
    identities = {tuple((r.config.get("model") or {}).get(k) for k in _MODEL_IDENTITY): r for r in runs}
    if len(identities) > 1:
        names = sorted({f"{k[0]} ({k[2] or k[1]})" for k in identities})
        raise GateInputError(f"the runs compare different reference models ({', '.join(names)}); gate one model's "
                             "runs at a time: model=<name> picks them, or pass each run directory separately")


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


# ------------------------------------------------------------------------------- decisions
def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    return format(value, spec)


def _plain(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        return None if math.isnan(float(value)) else float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def slice_chance(cfg: GateConfig, slice_name: str, items: pd.DataFrame) -> float:
    """Accuracy of guessing: gate.chance[slice], else mc_chance per multiple-choice item (0 generative)."""
    if slice_name in cfg.chance:
        return float(cfg.chance[slice_name])
    return float(np.mean(np.where(items["output_type"] == "multiple_choice", cfg.mc_chance, 0.0)))


def accuracy_criteria(run: RunResults, cfg: GateConfig) -> list[Criterion]:
    """The accuracy decision of every gated slice of one run (module docstring: the ship rule).

    Each slice's interval is the clustered score interval of :mod:`harness.stats` at level
    1 - 2α, the one printed: pass ⇔ its lower bound > -margin. The fail claim (Δ < -margin)
    is read off the same statistic's upper bound at level 1 - 2α/k, Bonferroni over the k gated
    slices (``correction=none``: k = 1), also printed.
    """
    compare = run.config.get("compare", {})
    default_margin = cfg.margin if cfg.margin is not None else float(compare.get("margin", 0.02))
    correction = cfg.correction or compare.get("correction", "holm")
    items = run.items
    slices = [s for s in sorted(items["slice"].unique()) if not cfg.slices or s in cfg.slices]
    family = 1 if correction == "none" else max(1, len(slices))
    out = []
    for name in slices:
        group = items[items["slice"] == name]
        margin = float(cfg.margins.get(name, default_margin))
        clusters = group["cluster"].to_numpy(dtype=object) if "cluster" in group else None
        ref, quant = group["correct_ref"].to_numpy(float), group["correct_quant"].to_numpy(float)
        shown = stats.paired_compare(ref, quant, clusters=clusters, n_resamples=int(compare.get("n_resamples", 2000)),
                                     seed=int(compare.get("seed", 0)), ci_level=1 - 2 * cfg.alpha, margin=margin,
                                     min_clusters=1)
        fail_level = 1 - 2 * cfg.alpha / family
        row = shown.to_dict()
        record = (run.summary.get("sequential") or {}).get(name)
        if record is not None:  # a sequential run: its confidence sequence decides, at this gate's α and margin
            sequence = sequential.gate_sequence(group, _not_evaluated(run, name), record, margin, cfg.alpha, family)
            row.update(delta_ci_low=sequence.lower, delta_ci_high=sequence.upper, fail_ci_high=sequence.upper,
                       interval="sequence", items_total=sequence.n_total, method=record["method"])
        else:
            codes = stats.paired.cluster_codes(clusters, len(group))
            row.update(fail_ci_high=stats.score_test(quant - ref, codes).interval(fail_level)[1], interval="score")
        row.update(slice=name, chance=slice_chance(cfg, name, group), fail_level=fail_level, family=family)
        out.append(_accuracy_decision(row, cfg, correction))
    return out


# The score test's largest false-pass rate at Δ = -m with few clusters, α = 0.05 (benchmarks/bench_gate_oc.py,
# 2,000 data sets per design, README): why a pass needs gate.min_clusters_pass clusters.
FEW_CLUSTER_FALSE_PASS = ("measured up to 0.108 with 5 clusters and 0.075 with 10, 0.158 with 10 when flips "
                          "concentrate (ICC 0.2); at most 0.060 from 20")


def _few_clusters_to_pass(row: dict[str, Any], cfg: GateConfig) -> bool:
    """Whether a slice of multi-item clusters has fewer clusters than a pass needs (a sequence read by
    betting assumes nothing of the clusters and is exempt)."""
    clustered = int(row["n_clusters"]) < int(row["n"])
    betting = row.get("interval") == "sequence" and row.get("method") == "betting"
    return clustered and not betting and int(row["n_clusters"]) < cfg.min_clusters_pass


def _not_evaluated(run: RunResults, slice_name: str) -> pd.DataFrame | None:
    """The items a sequential run did not need in ``slice_name`` (not_evaluated.parquet), or None."""
    path = run.directory / "not_evaluated.parquet"
    if not path.exists():
        return None
    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same bad input
        raise GateInputError(f"{path} is unreadable ({type(exc).__name__}); rerun the job with force=true") from None
    return frame[frame["slice"] == slice_name]


def _accuracy_decision(row: dict[str, Any], cfg: GateConfig, correction: str) -> Criterion:
    margin, n, clusters = float(row["margin"]), int(row["n"]), int(row["n_clusters"])
    headroom = float(row["acc_ref"]) - row["chance"]
    low, high, fail_high = row["delta_ci_low"], row["delta_ci_high"], row["fail_ci_high"]
    level = 100 * (1 - 2 * cfg.alpha)
    family = int(row["family"])
    reasons: list[str] = []
    if n < cfg.min_items:
        reasons.append(f"too few items ({n} < gate.min_items={cfg.min_items})")
    if clusters < cfg.min_clusters:
        reasons.append(f"too few clusters ({clusters} < gate.min_clusters={cfg.min_clusters})")
    adjusted = f"{100 * row['fail_level']:.4g} % upper bound, Bonferroni over {family} slices" if family > 1 else \
        f"{level:.4g} % upper bound"
    if reasons:
        outcome = INCONCLUSIVE
    elif fail_high < -margin:
        outcome = FAIL
        reasons = [f"worse beyond the margin: {adjusted} {100 * fail_high:+.1f} pt < -{100 * margin:.1f} pt"]
    elif low > -margin and _few_clusters_to_pass(row, cfg):
        outcome = INCONCLUSIVE
        reasons = [f"non-inferior on its interval, but a pass needs {cfg.min_clusters_pass} clusters "
                   f"(gate.min_clusters_pass; this slice has {clusters} of {n} items): with fewer the measured "
                   f"false-pass rate at the margin exceeds α ({FEW_CLUSTER_FALSE_PASS})"]
    elif low > -margin and headroom < cfg.min_headroom:
        outcome = INCONCLUSIVE
        reasons = [f"reference near floor/chance (acc_ref {row['acc_ref']:.3f} - chance {row['chance']:.3f} = "
                   f"{headroom:.3f} < gate.min_headroom={cfg.min_headroom}): it cannot show a loss"]
    elif low > -margin:
        outcome = PASS
    else:
        outcome = INCONCLUSIVE
        reasons = [f"non-inferiority not shown: lower bound {100 * low:+.1f} pt <= -{100 * margin:.1f} pt"]
        if fail_high >= -margin and high < 0:
            reasons.append("a drop is shown, its size against the margin is not")
        if row["mde"] > margin and row.get("interval") != "sequence":
            reasons.append(f"MDE {row['mde']:.3f} exceeds the margin {margin:.3f}")
    # More items settle it unless Δ̂ is at/beyond the margin, the reference is at the floor, or clusters are few.
    settleable = bool(row["settleable"]) and row.get("interval") != "sequence"  # a sequence used what it had
    settles = outcome == INCONCLUSIVE and settleable and headroom >= cfg.min_headroom and clusters >= cfg.min_clusters
    if outcome == INCONCLUSIVE and row.get("interval") == "sequence" and not any(r.startswith("too few") for r in reasons):
        reasons.append(f"the confidence sequence did not settle on the slice's {row['items_total']} items")
    elif outcome == INCONCLUSIVE and not settleable and not any(r.startswith("too few") for r in reasons):
        reasons.append(f"cannot be settled by more items: Δ̂ {100 * row['delta']:+.1f} pt is at or beyond the margin")
    numbers = {key: _plain(row[key]) for key in ("n", "n_clusters", "acc_ref", "acc_quant", "delta", "delta_ci_low",
                                                 "delta_ci_high", "delta_se", "delta_p", "design_effect",
                                                 "flips_right_to_wrong", "flips_wrong_to_right", "noninferiority_p",
                                                 "inferiority_p", "mde", "fail_ci_high", "fail_level")}
    numbers.update({"margin": margin, "alpha": cfg.alpha, "ci_level": 1 - 2 * cfg.alpha, "correction": correction,
                    "family": family, "chance": row["chance"], "headroom": headroom, "settleable": settleable,
                    "n_needed": _plain(row["n_needed"]) if settles else None})
    interval = (f"confidence sequence: lower bound (level {cfg.alpha:g}) {100 * low:+.1f} pt" if row.get("interval") == "sequence"
                else f"{level:.4g} % CI [{100 * low:+.1f}, {100 * high:+.1f}]")
    if row.get("interval") == "sequence":
        adjusted = adjusted.replace("upper bound", "sequence upper bound")
        numbers["items_total"] = int(row["items_total"])
        numbers["interval"] = "sequence"
    message = (f"{outcome}: delta {100 * row['delta']:+.1f} pt, {interval} "
               f"vs margin -{100 * margin:.1f} pt ({adjusted} {100 * fail_high:+.1f}); acc_ref {row['acc_ref']:.3f}, "
               + (f"n={n} of {row['items_total']} (sequential), clusters={clusters}"
                  if row.get("interval") == "sequence" else
                  f"n={n}, clusters={clusters}, non-inferiority p={_fmt(row['noninferiority_p'], '.3g')}, "
                  f"MDE {100 * row['mde']:.1f} pt")
               + (f", n_needed={numbers['n_needed']} (80 % power if the true delta were 0)" if settles else "")
               + ("; " + "; ".join(reasons) if reasons else ""))
    return Criterion(str(row["slice"]), "accuracy_noninferiority", outcome, message, reasons, numbers)


def token_criteria(run: RunResults, cfg: GateConfig, slices: list[str]) -> list[Criterion]:
    """``<slice>/kl_mean <= kl_mean_max`` and ``<slice>/top1_agree >= top1_agree_min`` where set."""
    metrics = run.summary.get("metrics", {})
    out = []
    for name in slices:
        limits = cfg.token_slices.get(name, TokenGateConfig())
        kl_max = limits.kl_mean_max if limits.kl_mean_max is not None else cfg.token.kl_mean_max
        top1_min = limits.top1_agree_min if limits.top1_agree_min is not None else cfg.token.top1_agree_min
        for metric, limit, ok in (("kl_mean", kl_max, lambda v, lim: v <= lim),
                                  ("top1_agree", top1_min, lambda v, lim: v >= lim)):
            if limit is None:
                continue
            value = metrics.get(f"{name}/{metric}")
            relation = "<=" if metric == "kl_mean" else ">="
            if value is None:
                out.append(Criterion(name, metric, INCONCLUSIVE, f"inconclusive: no {name}/{metric} in summary.json "
                                     "(the slice scored no divergence texts)", ["no token data"], {"limit": limit}))
                continue
            outcome = PASS if ok(value, limit) else FAIL
            se = metrics.get(f"{name}/{metric}_se")
            out.append(Criterion(name, metric, outcome, f"{outcome}: {metric} {value:.4g}"
                                 + (f" (se {se:.2g})" if se is not None else "") + f", required {relation} {limit:g}",
                                 [] if outcome == PASS else [f"{metric} {value:.4g} not {relation} {limit:g}"],
                                 {"value": value, "se": se, "limit": limit}))
    return out


def decide_run(run: RunResults, cfg: GateConfig) -> RunDecision:
    accuracy = accuracy_criteria(run, cfg)
    slices = [c.slice for c in accuracy]
    tokens = token_criteria(run, cfg, slices)
    order = {s: i for i, s in enumerate(slices)}
    criteria = sorted(accuracy + tokens, key=lambda c: order[c.slice])
    return RunDecision(str(run.summary.get("run_name", run.directory.name)), str(run.directory),
                       str(run.summary.get("model", "")), str(run.summary.get("scheme", "")), criteria)


def decide(paths: list[Path], cfg: GateConfig, model: str | None = None, sweep: str | None = None) -> GateDecision:
    """Gate every finished run under ``paths`` (all of one reference model; ``model`` picks one by name,
    ``sweep`` the runs tagged with that ``harness.sweep_id``)."""
    check_config(cfg)
    if not paths:
        raise GateInputError("no results given; usage: python -m harness.gate results/<run> [gate.margin=0.02 ...]")
    directories = [d for path in paths for d in find_runs(Path(path))]
    identities = {d: run_identity(d) for d in directories}  # filters first: unfinished runs elsewhere do not matter
    if model is not None:
        names = {d: identities[d].get("model") for d in directories}
        directories = [d for d in directories if names[d] == model]
        if not directories:
            raise GateInputError(f"no run of model {model!r} under {', '.join(map(str, paths))}; models there: "
                                 f"{', '.join(sorted(filter(None, set(names.values())))) or 'none'}")
    if sweep is not None:
        ids = {d: identities[d].get("sweep_id") for d in directories}
        directories = [d for d in directories if ids[d] == sweep]
        if not directories:
            raise GateInputError(f"no run tagged {SWEEP_TAG}={sweep!r}; sweep ids there: "
                                 f"{', '.join(sorted(filter(None, map(str, ids.values())))) or 'none'}")
    runs = [load_run(d) for d in directories]
    check_same_model(runs)
    check_slice_names(cfg, runs)
    return GateDecision([decide_run(r, cfg) for r in runs], OmegaConf.to_container(OmegaConf.structured(cfg)))


# --------------------------------------------------------------------------------- outputs
def junit_xml(decision: GateDecision) -> str:
    """JUnit XML: a testsuite per run, a testcase per slice and criterion; inconclusive is skipped."""
    root = ET.Element("testsuites", name="harness.gate")
    totals = {"tests": 0, "failures": 0, "skipped": 0}
    for run in decision.runs:
        suite = ET.SubElement(root, "testsuite", name=run.run_name)
        counts = {"tests": len(run.criteria), "failures": 0, "skipped": 0}
        for c in run.criteria:
            case = ET.SubElement(suite, "testcase", classname=f"{run.run_name}.{c.slice}", name=c.criterion)
            if c.outcome == FAIL:
                ET.SubElement(case, "failure", message=c.message, type="gate.fail").text = c.message
                counts["failures"] += 1
            elif c.outcome == INCONCLUSIVE:
                ET.SubElement(case, "skipped", message=c.message)
                counts["skipped"] += 1
            ET.SubElement(case, "system-out").text = json.dumps(c.numbers, sort_keys=True)
        for key, value in counts.items():
            suite.set(key, str(value))
            totals[key] += value
        suite.set("errors", "0")
    for key, value in totals.items():
        root.set(key, str(value))
    root.set("errors", "0")
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def table(decision: GateDecision) -> pd.DataFrame:
    rows = []
    for run in decision.runs:
        for c in run.criteria:
            x = c.numbers
            if c.criterion == "accuracy_noninferiority":
                if x.get("interval") == "sequence":  # a sequential run: items used of the slice's, the sequence's bounds
                    detail = (f"Δ {100 * x['delta']:+.1f} seq [{100 * x['delta_ci_low']:+.1f}, "
                              f"{100 * x['delta_ci_high']:+.1f}] m {100 * x['margin']:.1f}; "
                              f"{x['n']}/{x['items_total']} items")
                else:
                    detail = (f"Δ {100 * x['delta']:+.1f} [{100 * x['delta_ci_low']:+.1f}, {100 * x['delta_ci_high']:+.1f}] "
                              f"({100 * x['ci_level']:.4g} %) m {100 * x['margin']:.1f}")
                n_needed = x["n_needed"] if x["n_needed"] is not None else \
                    ("not by more items" if not x["settleable"] and c.outcome == INCONCLUSIVE
                     and x.get("interval") != "sequence" else "")
                rows.append({"run": run.run_name, "slice": c.slice, "criterion": "accuracy", "outcome": c.outcome,
                             "n": x["n"], "acc_ref": round(x["acc_ref"], 3), "detail": detail,
                             "fail bound": f"{100 * x['fail_ci_high']:+.1f}", "p_ni": _fmt(x["noninferiority_p"], ".3g"),
                             "mde_pt": round(100 * x["mde"], 1), "n_needed": n_needed, "why": "; ".join(c.reasons)})
            else:
                rows.append({"run": run.run_name, "slice": c.slice, "criterion": c.criterion, "outcome": c.outcome,
                             "n": "", "acc_ref": "", "detail": c.message.split(": ", 1)[-1], "fail bound": "",
                             "p_ni": "", "mde_pt": "", "n_needed": "", "why": "; ".join(c.reasons)})
    return pd.DataFrame(rows)


def write(decision: GateDecision, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "gate.json", decision.to_dict())
    atomic_write_text(out / "gate.xml", junit_xml(decision))
    return out / "gate.json", out / "gate.xml"


def gate_results(results_dir: str | Path, gate_cfg: GateConfig) -> GateDecision:
    """The pipeline's call at the end of a job: gate this run, write gate.json/gate.xml beside its results."""
    decision = decide([Path(results_dir)], gate_cfg)
    write(decision, Path(results_dir))
    log.info("gate: %s\n%s", decision.outcome, table(decision).to_string(index=False))
    return decision


# ------------------------------------------------------------------------------------- CLI
@dataclass
class GateOptions:
    paths: list[str] = field(default_factory=list, metadata={"help": "results/<run> dirs or directories of runs"})
    gate: GateConfig = field(default_factory=GateConfig, metadata={"help": "gate.margin, gate.margins.<slice>, ..."})
    out: Optional[str] = field(default=None, metadata={"help": "where gate.json/gate.xml go (default: the one path)"})
    model: Optional[str] = field(default=None, metadata={"help": "gate only the runs of this model (conf/model name)"})
    sweep: Optional[str] = field(default=None, metadata={"help": "gate only the runs of this harness.sweep_id"})


TOOL = cli.Tool(prog="python -m harness.gate", positional="paths", options=GateOptions, bad_input_status=EXIT_BAD_INPUT,
                summary="Deployment gate: per slice pass / fail / inconclusive from the paired non-inferiority test "
                        "at the slice's margin. Exit 0 all pass, 1 any fail, 2 none fail but some inconclusive, "
                        "3 bad input. Writes gate.json and gate.xml (JUnit).")


def _body(parsed: cli.Parsed[GateOptions]) -> int:
    options = parsed.options
    assert options is not None
    decision = decide([Path(p) for p in options.paths], options.gate, options.model, options.sweep)
    if options.out:
        out = Path(options.out)
    elif len(options.paths) == 1:
        out = Path(options.paths[0])
    else:
        raise GateInputError("several paths given: set out=<dir> for gate.json and gate.xml")
    json_path, xml_path = write(decision, out)
    shown = table(decision)
    print(shown.to_markdown(index=False) if len(shown) else "(no slices gated)")
    print(f"\ngate: {decision.outcome} (exit {decision.exit_code}); wrote {json_path} and {xml_path}")
    return decision.exit_code


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
