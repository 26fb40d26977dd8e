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
  ``min_clusters_pass`` (20) random clusters — strata are not counted: G − K + 1, the clusters left once
  each stratum's mean is taken out (there the score test's measured false-pass rate exceeds α:
  flips concentrated in a few sources that a handful of clusters may not include), the reference near the floor or chance (accuracy − chance < ``min_headroom``:
  a slice the reference mostly gets wrong cannot show a loss; checked before a pass, not before a
  fail), or the interval straddles -m. Then ``n_needed`` is the number of items that would give
  80 % power if the true Δ were 0 (at the slice's observed discordance and design effect). When the
  estimate itself lies beyond -m no number of items shows a pass, but more items settle it as a
  fail: ``n_fail`` gives the items for 80 % power of the fail if the true Δ were the estimate; an
  estimate exactly at -m "cannot be settled by more items".

The false-pass rate at Δ = -m and the power at Δ = 0 and -m/2 of this rule, over sizes, cluster
structures, accuracies, flip patterns and partial credit, are in the README (bench_gate_oc).

A sequential run (``eval.sequential=true``, :mod:`harness.evaluation.sequential_run`) is read off its confidence
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

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from harness import cli
from harness.config import GateConfig
from harness.decision.criteria import (  # noqa: F401
    EXIT_BAD_INPUT,
    EXIT_CODES,
    FAIL,
    INCONCLUSIVE,
    PASS,
    Criterion,
    GateDecision,
    RunDecision,
    accuracy_criteria,
    check_outcome_limits,
    decide_run,
    outcome_criteria,
    slice_chance,
    token_criteria,
    worst,
)
from harness.decision.gate_inputs import (  # noqa: F401
    GateInputError,
    RunResults,
    check_config,
    check_same_model,
    check_slice_names,
    find_runs,
    load_run,
    run_identity,
)
from harness.decision.gate_output import junit_xml, render, table, write  # noqa: F401
from harness.results.tracking import SWEEP_TAG

log = logging.getLogger("harness.gate")


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
    check_same_model(runs, paths)
    check_slice_names(cfg, runs)
    return GateDecision([decide_run(r, cfg) for r in runs], OmegaConf.to_container(OmegaConf.structured(cfg)))



def gate_results(results_dir: str | Path, gate_cfg: GateConfig) -> GateDecision:
    """The pipeline's call at the end of a job: gate this run, write gate.json/gate.xml beside its results."""
    decision = decide([Path(results_dir)], gate_cfg)
    write(decision, Path(results_dir))
    log.info("gate: %s\n%s%s", decision.outcome, table(decision).to_string(index=False),
             "".join(f"\nnote: {note}" for note in decision.notes))
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
    print(render(decision, json_path, xml_path))
    return decision.exit_code


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
