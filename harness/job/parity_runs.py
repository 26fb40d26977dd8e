"""``python -m harness.parity``: a scheme's simulation against its export served by an engine, beside two
floors, on the same items (:mod:`harness.compare.parity_table` computes the table): the engine-noise floor
(the reference served by the same engine) and the scheme's own floor (the simulation against itself with
its input embeddings moved in the last bit, :mod:`harness.quant.perturb`).

Given finished runs (``simulation=DIR served=DIR [floor=DIR] [own_floor=DIR]``) it only compares them.
Given a run config and a serve command instead (``model=... quant=fp8 slices=... serve="<command with
{model} and {port}>"``) it makes the runs first, each an ordinary job of ``python -m harness`` (so each is
cached, resumable and logged like any other):

1. the simulation: ``quant=<scheme>``;
2. the export, ``python -m harness.export`` into ``<out>/export`` (skipped when it is there), served by
   the command with ``{model}`` = that directory: ``quant=external candidate.serve=...``;
3. the floor: the reference's own weights (:func:`harness.models.loading.serving_directory`) served by
   the same command: ``quant=external candidate.serve=...``;
4. the scheme's own floor: ``quant.method=<method>_ulp`` (the same scheme, inputs moved in the last bit;
   ``scheme_floor=false`` leaves it out).

``speed=true`` then measures serving speed, the export against the reference's own weights on the same
engine with the same command (:mod:`harness.engines.perf`, settings ``perf.*``), into ``perf.md`` /
``perf.json`` beside the table; ``speed=only`` measures speed alone (the simulation run still gives the
prompts; cached when it exists).

The table, ``parity.md``, ``parity.parquet`` and ``parity.json`` go to ``out`` (default
``results/parity/<model>-<scheme>``), and to MLflow as one run tagged ``harness.kind=parity`` beside
the three runs it compares.
"""
from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from harness import cli
from harness.compare.parity_table import LEGEND, ParityInputs, headline, parity_markdown, parity_table
from harness.compare.sources import load_results_dir
from harness.config import to_config
from harness.errors import UsageError

log = logging.getLogger(__name__)

__all__ = ["ParityOptions", "main", "render", "run_parity"]


@dataclass
class ParityOptions:
    simulation: str = field(default="", metadata={"help": "results directory of the scheme's simulation run"})
    served: str = field(default="", metadata={"help": "results directory of its export served by an engine"})
    floor: str = field(default="", metadata={"help": "results directory of the reference served by that engine"})
    own_floor: str = field(default="", metadata={"help": "results directory of the simulation with its inputs moved "
                                                         "in the last bit (quant.method=<method>_ulp)"})
    scheme_floor: bool = field(default=True, metadata={"help": "with serve=: also run the scheme's own floor"})
    margin: float = field(default=-1.0, metadata={"help": "equivalence margin of Δ served − simulated (fraction); "
                                                          "negative: compare.margin"})
    speed: str = field(default="false", metadata={"help": "with serve=: measure serving speed of the export and "
                                                          "the reference (true), or only that (only); settings perf.*"})
    serve: str = field(default="", metadata={"help": "make the runs: the server command, with {model} and {port}"})
    out: str = field(default="", metadata={"help": "directory for the table (default results/parity/<model>-<scheme>)"})
    ci_level: float = field(default=0.95, metadata={"help": "level of every interval"})
    log: bool = field(default=True, metadata={"help": "log the table to MLflow (tracking.* of the run config)"})


def _job(overrides: list[str]) -> Path:
    """One ``python -m harness`` job in process; its results directory."""
    from harness.config import compose
    from harness.job import pipeline

    cfg = compose(overrides)
    result = pipeline.run(cfg)
    key = result.get("run_key")
    root = Path(to_config(cfg).paths.results_dir)
    for summary in sorted(root.glob("*/summary.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        if json.loads(summary.read_text()).get("run_key") == key:
            return summary.parent
    raise RuntimeError(f"the job of {overrides} wrote no summary.json with run_key {key} under {root}")


def _serve_override(command: str, directory: Path) -> str:
    return "candidate.serve='" + command.replace("{model}", str(directory)).replace("'", "\\'") + "'"


def scheme_floor_overrides(overrides: list[str], scheme: Any) -> list[str]:
    """The simulation's overrides for its last-bit perturbed twin (:mod:`harness.quant.perturb`)."""
    from harness.quant.perturb import SUFFIX

    plugins = [p for p in scheme.plugins if p != "harness.quant.perturb"] + ["harness.quant.perturb"]
    return [*overrides, f"quant.method={scheme.method}{SUFFIX}", f"quant.plugins=[{','.join(plugins)}]",
            f"quant.name={scheme.name}{SUFFIX}"]


def _export(overrides: list[str], scheme_name: str, out: Path) -> Path:
    export = out / "export"
    if not (export / "config.json").exists():
        done = subprocess.run([sys.executable, "-m", "harness.export", *overrides, f"out={export}"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise UsageError(f"the export of quant={scheme_name} failed: "
                             f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return export


def _check_serve(command: str, overrides: list[str]) -> Any:
    if "{model}" not in command or "{port}" not in command:
        raise UsageError(f"serve={command!r} lacks {{model}} or {{port}}: e.g. serve=\"vllm serve {{model}} "
                         "--host 127.0.0.1 --port {port}\"")
    from harness.config import compose
    cfg = to_config(compose(overrides))
    if cfg.quant.name in ("none", "external"):
        raise UsageError(f"quant={cfg.quant.name}: parity needs the scheme whose simulation and export are compared, "
                         "e.g. quant=fp8")
    return cfg


def make_runs(overrides: list[str], command: str, out: Path, *,
              scheme_floor: bool = True) -> tuple[Path, Path, Path, Path | None]:
    """The simulation, the served export, the served reference and the scheme's own floor (None unless
    ``scheme_floor``), as jobs (see the module)."""
    from harness.models.loading import serving_directory

    cfg = _check_serve(command, overrides)
    simulation = _job(overrides)
    own = _job(scheme_floor_overrides(overrides, cfg.quant)) if scheme_floor else None
    export = _export(overrides, cfg.quant.name, out)
    base = [o for o in overrides if not o.startswith(("quant=", "quant."))]
    served = _job([*base, "quant=external", _serve_override(command, export.resolve()),
                   f"candidate.name='{cfg.quant.name}-served'"])  # quoted: a name may hold = and +
    reference = serving_directory(cfg.model, cfg.paths.cache_dir)
    floor = _job([*base, "quant=external", _serve_override(command, reference),
                  "candidate.name=reference-served"])
    return simulation, served, floor, own


def render(table: pd.DataFrame, inputs: ParityInputs) -> str:
    """``parity.md``: which runs, the table, and what its columns mean."""
    lines = [f"# Parity: {inputs.simulation.model} · {inputs.simulation.scheme}, simulation vs served", "",
             *[f"**{line}**" for line in headline(table)], "",
             f"- simulation: `{inputs.simulation.source}`", f"- served: `{inputs.served.source}`",
             f"- engine floor (reference served): `{inputs.floor.source if inputs.floor else 'none'}`",
             f"- scheme's own floor (simulation, inputs moved in the last bit): "
             f"`{inputs.own_floor.source if inputs.own_floor else 'none'}`", "",
             parity_markdown(table), "", LEGEND]
    return "\n".join(lines) + "\n"


def run_parity(inputs: ParityInputs, out: Path, *, ci_level: float = 0.95, margin: float = 0.02) -> pd.DataFrame:
    """The table, written to ``out``."""
    table = parity_table(inputs, ci_level=ci_level, margin=margin)
    out.mkdir(parents=True, exist_ok=True)
    table.to_parquet(out / "parity.parquet", index=False)
    (out / "parity.md").write_text(render(table, inputs))
    (out / "parity.json").write_text(json.dumps(
        {"simulation": inputs.simulation.source, "served": inputs.served.source,
         "floor": inputs.floor.source if inputs.floor else None,
         "own_floor": inputs.own_floor.source if inputs.own_floor else None, "ci_level": ci_level,
         "margin": margin, "headline": headline(table),
         "rows": json.loads(table.to_json(orient="records"))}, indent=1) + "\n")
    return table


def _track(out: Path, table: pd.DataFrame, inputs: ParityInputs, cfg: Any, perf_result: dict | None = None) -> None:
    from harness.results import tracking

    metrics: dict[str, float] = dict((perf_result or {}).get("metrics", {}))
    for row in table.to_dict("records"):
        for key in ("delta", "disagree_sim_served", "disagree_floor", "disagree_own_floor", "excess",
                    "excess_engine", "excess_own"):
            if row[key] is not None and not math.isnan(row[key]):
                metrics[f"parity/{row['slice']}/{key}"] = float(row[key])
        if row["exceeds_floor"] is not None:
            metrics[f"parity/{row['slice']}/exceeds_floor"] = float(row["exceeds_floor"])
    tracking.log_tool_run(out, uri=cfg.tracking.uri, experiment=cfg.tracking.experiment, kind="parity",
                          run_name=f"parity/{inputs.simulation.model}/{inputs.simulation.scheme}",
                          tags={"model": inputs.simulation.model, "scheme": inputs.simulation.scheme,
                                **cfg.tracking.tags},
                          params={"simulation": inputs.simulation.source, "served": inputs.served.source,
                                  "floor": inputs.floor.source if inputs.floor else "",
                                  "own_floor": inputs.own_floor.source if inputs.own_floor else ""},
                          metrics=metrics)


TOOL = cli.Tool(prog="python -m harness.parity", options=ParityOptions, run_config=True,
                summary="A scheme's simulation against its export served by an engine, on the same items: Δ accuracy "
                        "with its interval and verdict, flips, KL, and answer disagreement against two floors (the "
                        "reference served by the same engine, and the simulation with its inputs moved in the last "
                        "bit). Compares finished runs (simulation=DIR served=DIR floor=DIR own_floor=DIR) or makes "
                        "them (model=... quant=... slices=... serve=\"<command with {model} and {port}>\"); "
                        "speed=true also measures serving speed against the reference on that engine.")


def run_perf(overrides: list[str], command: str, out: Path, simulation: Path, cfg: Any) -> dict:
    """Serving speed of the export against the reference's own weights on the engine ``command`` starts, on the
    simulation run's generation prompts (:func:`harness.engines.perf.measure_pair`); ``perf.json``, ``perf.md``."""
    from harness.engines import perf
    from harness.sizing import measured
    from harness.models.loading import serving_directory

    export = _export(overrides, cfg.quant.name, out)
    prompts = perf.prompts_from_run(simulation, cfg.perf.n_prompts)
    result = perf.measure_pair(command, export.resolve(), serving_directory(cfg.model, cfg.paths.cache_dir),
                               prompts, cfg.perf, out)
    measured.describe_run(result, simulation)  # the run it measured, and the ledger's prediction beside the measurement
    line = perf.headline(result, f"{cfg.quant.name} (served)")
    result["headline"] = line
    result["metrics"] = perf.flat_metrics(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "perf.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    (out / "perf.md").write_text(f"# Serving speed: {cfg.model.name} · {cfg.quant.name} against the reference, "
                                 f"same engine\n\n**{line}**\n\n- engine command: `{command}`\n\n"
                                 + perf.perf_markdown(result) + "\n")
    return result


def _body(parsed: cli.Parsed[ParityOptions]) -> int:
    options = parsed.options
    assert options is not None
    options.speed = str(options.speed).lower()  # speed=true arrives as a boolean's text
    if options.speed not in ("false", "true", "only"):
        raise UsageError(f"speed={options.speed!r}: use speed=true (parity and speed), speed=only (speed) or "
                         "speed=false")
    cfg = to_config(parsed.run)
    margin = options.margin if options.margin >= 0 else cfg.compare.margin
    own = None
    if options.serve:
        if options.simulation or options.served:
            raise UsageError("give either serve= (the runs are made) or simulation= and served= (finished runs)")
        out = Path(options.out or Path(cfg.paths.results_dir) / "parity" / f"{cfg.model.name}-{cfg.quant.name}")
        overrides = list(parsed.overrides)
        if options.speed == "only":
            _check_serve(options.serve, overrides)
            result = run_perf(overrides, options.serve, out, _job(overrides), cfg)
            print((out / "perf.md").read_text())
            return 0
        simulation, served, floor, own = make_runs(overrides, options.serve, out, scheme_floor=options.scheme_floor)
    else:
        if options.speed != "false":
            raise UsageError("speed= measures servers the command starts: give serve= with model=/quant=/slices=")
        if not (options.simulation and options.served):
            raise UsageError("give simulation=DIR and served=DIR (and floor=DIR for the engine-noise floor, own_floor=DIR "
                             "for the scheme's own), or serve= with model=/quant=/slices= to make the runs")
        simulation, served = Path(options.simulation), Path(options.served)
        floor = Path(options.floor) if options.floor else None
        own = Path(options.own_floor) if options.own_floor else None
        out = Path(options.out) if options.out else simulation.parent / "parity" / simulation.name
    inputs = ParityInputs(load_results_dir(simulation), load_results_dir(served),
                          load_results_dir(floor) if floor is not None else None,
                          load_results_dir(own) if own is not None else None)
    table = run_parity(inputs, out, ci_level=options.ci_level, margin=margin)
    print((out / "parity.md").read_text())
    result = None
    if options.speed == "true":
        result = run_perf(list(parsed.overrides), options.serve, out, simulation, cfg)
        print((out / "perf.md").read_text())
    if options.log and cfg.tracking.enabled:
        _track(out, table, inputs, cfg, result)
    flagged = table[table["exceeds_floor"] == True]["slice"].tolist()  # noqa: E712 (None: no floor)
    if flagged:
        print(f"simulation and served disagree beyond the larger noise floor on: {', '.join(flagged)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _body, argv)
