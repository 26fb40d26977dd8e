"""Calibration domain as an axis (issue 14): does a code-calibrated GPTQ/AWQ do better on code?

Runs the sweep ``schemes x sources`` on ``slices`` (each job is ``python -m harness``'s own
``harness.job.pipeline``, so the references are shared and cached, the calibrated weights are cached per
source, and every job's results land in ``results_dir``), then prints and writes:

- per job and slice, against the reference: accuracy (reference, quantized), the flips
  (right->wrong / wrong->right) and their McNemar p, mean KL(ref||quant) per token with its SE,
  and top-1 agreement;
- per scheme and slice, head to head on the same items: each non-baseline source against the
  baseline source (``prose``): accuracy difference with its paired (cluster) bootstrap CI, the
  items only one of the two gets right with McNemar's p, and the difference of mean per-token
  KL on the same gold-text tokens with a bootstrap CI over texts.

The full sweep of the README is the default::

    python benchmarks/bench_calibration_domain.py
    # = python -m harness -m quant=gptq_w4g128,awq_w4g128 quant.calibration.source=prose,code \\
    #       slices=[code,math,multilingual]   (+ the tables)

A reduced run for a busy CPU: ``schemes=[gptq_w4g128] slices=[code] num_samples=32``.
Writes benchmarks/results/calibration_domain.json (``out=``).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from harness import cli

log = logging.getLogger("bench_calibration_domain")
RESULTS = Path(__file__).resolve().parent / "results"
COLUMNS = ("acc_ref", "acc_quant", "flips_right_to_wrong", "flips_wrong_to_right", "delta_p", "kl_mean", "kl_se",
           "top1_agree")


@dataclass
class Options:
    model: str = field(default="smollm2_135m", metadata={"help": "model config (conf/model)"})
    schemes: list[str] = field(default_factory=lambda: ["gptq_w4g128", "awq_w4g128"],
                               metadata={"help": "quant presets (calibrated methods)"})
    sources: list[str] = field(default_factory=lambda: ["prose", "code"],
                               metadata={"help": "quant.calibration.source values; the first is the baseline"})
    slices: list[str] = field(default_factory=lambda: ["code", "math", "multilingual"], metadata={"help": "slices"})
    num_samples: Optional[int] = field(default=None, metadata={
        "help": "quant.calibration.num_samples (None: the preset's, 128)"})
    results_dir: str = field(default="results/calibration_domain", metadata={"help": "paths.results_dir of the jobs"})
    tracking: bool = field(default=False, metadata={"help": "log the jobs to MLflow"})
    out: str = field(default=str(RESULTS / "calibration_domain.json"), metadata={"help": "JSON written here"})


def job_overrides(options: Options, scheme: str, source: str) -> list[str]:
    """The overrides of one job: what `python -m harness -m ...` would give it."""
    overrides = [f"model={options.model}", f"quant={scheme}", f"quant.calibration.source={source}",
                 f"slices=[{','.join(options.slices)}]", f"paths.results_dir={options.results_dir}",
                 f"tracking.enabled={str(options.tracking).lower()}",
                 f"tracking.run_name={options.model}/{scheme}@{source}/{'+'.join(options.slices)}"]
    if options.num_samples is not None:
        overrides.append(f"quant.calibration.num_samples={options.num_samples}")
    return overrides


def result_dir(results_dir: str, run_key: str) -> Path:
    found = sorted(Path(results_dir).glob(f"*__{run_key[:8]}"))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one results directory for run key {run_key} in {results_dir}, found {found}")
    return found[0]


def against_reference(summary: dict[str, Any], slice_name: str) -> dict[str, float]:
    metrics = summary["metrics"]
    row = {column: metrics.get(f"{slice_name}/{column}", float("nan")) for column in COLUMNS}
    for column in ("flips_right_to_wrong", "flips_wrong_to_right"):
        row[column] = int(row[column]) if row[column] == row[column] else row[column]  # counts (NaN stays)
    return row


def head_to_head(base: pd.DataFrame, other: pd.DataFrame, slice_name: str, n_resamples: int = 2000) -> dict[str, Any]:
    """``other`` source vs the ``base`` source on the same items of one slice (paired)."""
    from harness.stats import paired_compare

    keep = ["item_id", "cluster", "correct_quant"]
    a = base[base["slice"] == slice_name][keep]
    b = other[other["slice"] == slice_name][keep]
    merged = a.merge(b, on=["item_id", "cluster"], suffixes=("_base", "_other"))
    if len(merged) != len(a) or len(merged) != len(b):
        raise ValueError(f"{slice_name}: the two runs scored different items ({len(a)} vs {len(b)}, {len(merged)} shared)")
    result = paired_compare(merged["correct_quant_base"].astype(float), merged["correct_quant_other"].astype(float),
                            clusters=merged["cluster"], n_resamples=n_resamples)
    # paired_compare's "ref" is the baseline source here: its flips are the items only one source gets right.
    return {"n": result.n, "acc_diff": result.delta, "ci_low": result.delta_ci[0], "ci_high": result.delta_ci[1],
            "other_only_right": result.flips_wrong_to_right, "base_only_right": result.flips_right_to_wrong,
            "delta_p": result.delta_p}


def kl_difference(base: pd.DataFrame, other: pd.DataFrame, slice_name: str, n_resamples: int = 2000,
                  seed: int = 0) -> dict[str, float]:
    """Mean per-token KL(ref||quant) of ``other`` minus ``base`` on the same tokens, with a 95% CI.

    The CI resamples whole gold texts (tokens of one text are not independent), paired: each
    resampled text contributes both runs' KL on its tokens.
    """
    import numpy as np

    keys = ["slice", "text", "position"]
    merged = base[base["slice"] == slice_name][keys + ["kl"]].merge(
        other[other["slice"] == slice_name][keys + ["kl"]], on=keys, suffixes=("_base", "_other"))
    if merged.empty:
        return {"kl_diff": float("nan"), "kl_ci_low": float("nan"), "kl_ci_high": float("nan")}
    merged["diff"] = merged["kl_other"] - merged["kl_base"]
    per_text = merged.groupby("text")["diff"].agg(["sum", "count"])
    sums, counts = per_text["sum"].to_numpy(), per_text["count"].to_numpy()
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(sums), size=(n_resamples, len(sums)))
    means = sums[picks].sum(axis=1) / counts[picks].sum(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return {"kl_diff": float(sums.sum() / counts.sum()), "kl_ci_low": float(low), "kl_ci_high": float(high),
            "kl_texts": int(len(sums)), "kl_tokens": int(counts.sum())}


def _format(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _body(parsed: cli.Parsed[Options]) -> int:
    from harness.config import compose
    from harness.quant.calibration import validate_calibration
    from harness.job.pipeline import run

    options = parsed.options
    assert options is not None
    if len(options.sources) < 2:
        raise cli.UsageError(f"sources={options.sources}: give at least two (the first is the baseline)")
    jobs = [(scheme, source) for scheme in options.schemes for source in options.sources]
    configs = {job: compose(job_overrides(options, *job)) for job in jobs}  # every job composes before any runs
    for cfg in configs.values():
        validate_calibration(cfg.quant.calibration)
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    for job, cfg in configs.items():
        start = time.perf_counter()
        summary = run(cfg)
        runs[job] = {"summary": summary, "dir": result_dir(options.results_dir, summary["run_key"]),
                     "wall_s": round(time.perf_counter() - start, 1), "load": os.getloadavg()[0]}
        log.info("%s@%s: %.0f s (load %.1f)", *job, runs[job]["wall_s"], runs[job]["load"])
    table, pairs = [], []
    for (scheme, source), info in runs.items():
        for slice_name in options.slices:
            table.append({"scheme": scheme, "source": source, "slice": slice_name,
                          **against_reference(info["summary"], slice_name), "wall_s": info["wall_s"]})
    baseline = options.sources[0]
    for scheme in options.schemes:
        base_dir = runs[(scheme, baseline)]["dir"]
        base_items, base_tokens = (pd.read_parquet(base_dir / f) for f in ("items.parquet", "tokens.parquet"))
        for source in options.sources[1:]:
            other_dir = runs[(scheme, source)]["dir"]
            items, tokens = (pd.read_parquet(other_dir / f) for f in ("items.parquet", "tokens.parquet"))
            for slice_name in options.slices:
                pairs.append({"scheme": scheme, "source": source, "vs": baseline, "slice": slice_name,
                              **head_to_head(base_items, items, slice_name),
                              **kl_difference(base_tokens, tokens, slice_name)})
    print(_format(table, ["scheme", "source", "slice", *COLUMNS, "wall_s"]))
    print()
    print(_format(pairs, ["scheme", "source", "vs", "slice", "n", "acc_diff", "ci_low", "ci_high",
                          "other_only_right", "base_only_right", "delta_p", "kl_diff", "kl_ci_low", "kl_ci_high"]))
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(json.dumps({
        "options": options.__dict__, "jobs": {f"{s}@{c}": {"overrides": job_overrides(options, s, c),
                                                           "wall_s": runs[(s, c)]["wall_s"], "load": runs[(s, c)]["load"]}
                                              for s, c in jobs},
        "against_reference": table, "head_to_head": pairs, "cpus": os.cpu_count()}, indent=1, default=str))
    print(f"wrote {options.out}")
    return 0


TOOL = cli.Tool(prog="python benchmarks/bench_calibration_domain.py", options=Options,
                summary="Calibration domain as an axis: schemes x calibration sources on slices, against the "
                        "reference and head to head (source vs the first source), on the same items.")


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
