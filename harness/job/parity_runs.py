"""``python -m harness.parity``: a scheme's simulation against its export served by an engine, beside the
engine-noise floor, on the same items (:mod:`harness.compare.parity_table` computes the table).

Given finished runs (``simulation=DIR served=DIR [floor=DIR]``) it only compares them. Given a run
config and a serve command instead (``model=... quant=fp8 slices=... serve="<command with {model} and
{port}>"``) it makes the three runs first, each an ordinary job of ``python -m harness`` (so each is
cached, resumable and logged like any other):

1. the simulation: ``quant=<scheme>``;
2. the export, ``python -m harness.export`` into ``<out>/export`` (skipped when it is there), served by
   the command with ``{model}`` = that directory: ``quant=external candidate.serve=...``;
3. the floor: the reference's own weights (:func:`harness.models.loading.serving_directory`) served by
   the same command: ``quant=external candidate.serve=...``.

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
from harness.compare.parity_table import ParityInputs, parity_table
from harness.compare.render.tables import PARITY_LEGEND, parity_markdown
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


def make_runs(overrides: list[str], command: str, out: Path) -> tuple[Path, Path, Path]:
    """The simulation, the served export and the served reference, as three jobs (see the module)."""
    from harness.config import compose
    from harness.models.loading import serving_directory

    if "{model}" not in command or "{port}" not in command:
        raise UsageError(f"serve={command!r} lacks {{model}} or {{port}}: e.g. serve=\"vllm serve {{model}} "
                         "--host 127.0.0.1 --port {port}\"")
    cfg = to_config(compose(overrides))
    if cfg.quant.name in ("none", "external"):
        raise UsageError(f"quant={cfg.quant.name}: parity needs the scheme whose simulation and export are compared, "
                         "e.g. quant=fp8")
    simulation = _job(overrides)
    export = out / "export"
    if not (export / "config.json").exists():
        done = subprocess.run([sys.executable, "-m", "harness.export", *overrides, f"out={export}"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise UsageError(f"the export of quant={cfg.quant.name} failed: "
                             f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    base = [o for o in overrides if not o.startswith(("quant=", "quant."))]
    served = _job([*base, "quant=external", _serve_override(command, export.resolve()),
                   f"candidate.name='{cfg.quant.name}-served'"])  # quoted: a name may hold = and +
    reference = serving_directory(cfg.model, cfg.paths.cache_dir)
    floor = _job([*base, "quant=external", _serve_override(command, reference),
                  "candidate.name=reference-served"])
    return simulation, served, floor


def render(table: pd.DataFrame, inputs: ParityInputs) -> str:
    """``parity.md``: which runs, the table, and what its columns mean."""
    lines = [f"# Parity: {inputs.simulation.model} · {inputs.simulation.scheme}, simulation vs served", "",
             f"- simulation: `{inputs.simulation.source}`", f"- served: `{inputs.served.source}`",
             f"- floor (reference served): `{inputs.floor.source if inputs.floor else 'none'}`", "",
             parity_markdown(table), "", PARITY_LEGEND]
    return "\n".join(lines) + "\n"


def run_parity(inputs: ParityInputs, out: Path, *, ci_level: float = 0.95) -> pd.DataFrame:
    """The table, written to ``out``."""
    table = parity_table(inputs, ci_level=ci_level)
    out.mkdir(parents=True, exist_ok=True)
    table.to_parquet(out / "parity.parquet", index=False)
    (out / "parity.md").write_text(render(table, inputs))
    (out / "parity.json").write_text(json.dumps(
        {"simulation": inputs.simulation.source, "served": inputs.served.source,
         "floor": inputs.floor.source if inputs.floor else None, "ci_level": ci_level,
         "rows": json.loads(table.to_json(orient="records"))}, indent=1) + "\n")
    return table


def _track(out: Path, table: pd.DataFrame, inputs: ParityInputs, cfg: Any) -> None:
    from harness.results import tracking

    metrics: dict[str, float] = {}
    for row in table.to_dict("records"):
        for key in ("delta", "disagree_sim_served", "disagree_floor", "excess"):
            if row[key] is not None and not math.isnan(row[key]):
                metrics[f"parity/{row['slice']}/{key}"] = float(row[key])
        if row["exceeds_floor"] is not None:
            metrics[f"parity/{row['slice']}/exceeds_floor"] = float(row["exceeds_floor"])
    tracking.log_tool_run(out, uri=cfg.tracking.uri, experiment=cfg.tracking.experiment, kind="parity",
                          run_name=f"parity/{inputs.simulation.model}/{inputs.simulation.scheme}",
                          tags={"model": inputs.simulation.model, "scheme": inputs.simulation.scheme,
                                **cfg.tracking.tags},
                          params={"simulation": inputs.simulation.source, "served": inputs.served.source,
                                  "floor": inputs.floor.source if inputs.floor else ""},
                          metrics=metrics)


TOOL = cli.Tool(prog="python -m harness.parity", options=ParityOptions, run_config=True,
                summary="A scheme's simulation against its export served by an engine, beside the engine-noise floor "
                        "(the reference served by the same engine), on the same items: flips, Δ with its interval, "
                        "answer disagreement and its excess over the floor, KL. Compares finished runs "
                        "(simulation=DIR served=DIR floor=DIR) or makes them (model=... quant=... slices=... "
                        "serve=\"<command with {model} and {port}>\").")


def _body(parsed: cli.Parsed[ParityOptions]) -> int:
    options = parsed.options
    assert options is not None
    if options.serve:
        if options.simulation or options.served:
            raise UsageError("give either serve= (the runs are made) or simulation= and served= (finished runs)")
        cfg = to_config(parsed.run)
        out = Path(options.out or Path(cfg.paths.results_dir) / "parity" / f"{cfg.model.name}-{cfg.quant.name}")
        simulation, served, floor = make_runs(list(parsed.overrides), options.serve, out)
    else:
        if not (options.simulation and options.served):
            raise UsageError("give simulation=DIR and served=DIR (and floor=DIR for the engine-noise floor), or serve= "
                             "with model=/quant=/slices= to make the runs")
        simulation, served = Path(options.simulation), Path(options.served)
        floor = Path(options.floor) if options.floor else None
        cfg = to_config(parsed.run)
        out = Path(options.out) if options.out else simulation.parent / "parity" / simulation.name
    inputs = ParityInputs(load_results_dir(simulation), load_results_dir(served),
                          load_results_dir(floor) if floor is not None else None)
    table = run_parity(inputs, out, ci_level=options.ci_level)
    print((out / "parity.md").read_text())
    if options.log and cfg.tracking.enabled:
        _track(out, table, inputs, cfg)
    flagged = table[table["exceeds_floor"] == True]["slice"].tolist()  # noqa: E712 (None: no floor)
    if flagged:
        print(f"simulation and served disagree beyond the engine-noise floor on: {', '.join(flagged)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _body, argv)
