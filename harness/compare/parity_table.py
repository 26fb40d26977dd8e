"""Simulation against served: does the harness's simulation of a scheme answer as the engine serving
its export does, beyond what changing engines alone does?

Three finished runs on the same items:

- ``simulation``: the harness's own quantization of a scheme (``python -m harness quant=fp8``);
- ``served``: that scheme's export, answered by a serving engine (``candidate.serve`` / ``candidate.endpoint``);
- ``floor`` (optional): the unquantized reference, answered by the same engine: the engine-noise floor;
- ``own_floor`` (optional): the scheme's simulation again, with its input embeddings moved in the last bit
  (:mod:`harness.quant.perturb`): the scheme's own noise floor. A scheme whose dynamic activation
  quantization puts values on rounding boundaries changes its greedy replies under any arithmetic
  difference, whatever the engine; a floor measured at ``none`` cannot be that scheme's floor.

Per slice (and overall) :func:`parity_table` reports

- the served artifact's accuracy against the simulation's: Δ = served − simulation with its interval
  and flips, from the same clustered paired score statistic as every verdict (the simulation takes the
  reference's place in the pair);
- the share of items whose answers differ (a generation's reply text, a multiple-choice item's
  chosen answer) between simulation and served, and between the reference in process and the
  reference served (the floor);
- the excess over each floor: Δ of two agreement rates on the same items (agreement of simulation with
  served minus agreement of the floor's pair: the reference with its served self, ``excess_engine``; the
  simulation with its perturbed self, ``excess_own``), each with its interval from the same statistic;
  ``binding_floor`` names the floor that disagrees more (``engine`` or ``scheme``) and ``excess`` is the
  excess over it. ``exceeds_floor`` when the excess over *every* floor given lies wholly below 0: the
  simulation and the engine disagree more than the larger floor. An intersection-union test, so its
  false-flag rate is still at most one paired score test's one-sided level (2.5 % at 95 %), as
  measured for the gate (docs/explanation/gate-operating-characteristics.md) and for these agreement
  rates by ``benchmarks/bench_parity_oc.py``;
- the quality headline: ``verdict``, Δ accuracy served − simulation read against an equivalence margin
  (``margin``), and ``kl_check``, the simulation's exact KL against the served run's bound;
- the token divergence of each run from the reference, as each run measured it (``kl_sim``: the
  simulation's exact KL; ``kl_served`` / ``kl_floor``: a served run's, a lower bound when the server
  returns top-k log-probs only, named in ``kl_served_on``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from harness import stats
from harness.compare.render.parity import LEGEND, headline, parity_markdown  # its text, for callers
from harness.compare.sources import RunData
from harness.errors import UsageError
from harness.results import summary

__all__ = ["LEGEND", "ParityInputs", "agreement_frame", "excess_over_floor", "headline", "parity_markdown",
           "parity_table"]

KEYS = ["item_id"]
DESIGN = ["slice", "sub_slice", "cluster", "stratum"]


@dataclass
class ParityInputs:
    simulation: RunData
    served: RunData
    floor: RunData | None = None
    own_floor: RunData | None = None  # the simulation with its inputs moved in the last bit

    def check(self) -> None:
        """The runs answer the same items of the same model, else one line saying which differ."""
        runs = {"simulation": self.simulation, "served": self.served}
        if self.floor is not None:
            runs["floor"] = self.floor
        if self.own_floor is not None:
            runs["own floor"] = self.own_floor
        models = {name: run.model for name, run in runs.items()}
        if len(set(models.values())) > 1:
            raise UsageError(f"parity compares runs of one model; these are of {models}: pick runs of the same "
                             "model.name")
        ids = {name: set(run.items["item_id"]) for name, run in runs.items()}
        reference = ids["simulation"]
        for name, found in ids.items():
            if found != reference:
                raise UsageError(f"the {name} run answered other items than the simulation ({len(found ^ reference)} "
                                 "differ): run all three with the same slices and eval settings")
        if self.simulation.summary.get("scheme") in (None, "none"):
            raise UsageError("the simulation run is unquantized (quant=none): give the run of the scheme whose "
                             "export was served")


def _answers(items: pd.DataFrame, side: str) -> pd.Series:
    return items.set_index("item_id")[f"response_{side}"].astype(str)


def agreement_frame(inputs: ParityInputs) -> pd.DataFrame:
    """One row per item: its design columns, both runs' correctness and whether answers agree.

    ``correct_ref`` / ``correct_quant`` hold the simulation's and the served artifact's correctness
    (Δ = served − simulation); ``agree_parity`` is 1 where the two answered alike, ``agree_floor``
    where the reference in process and the reference served did (NaN without a floor run), ``agree_own``
    where the simulation and its last-bit perturbed twin did (NaN without that run).
    """
    inputs.check()
    sim = inputs.simulation.items.set_index("item_id")
    served = inputs.served.items.set_index("item_id").loc[sim.index]
    frame = sim[[c for c in DESIGN if c in sim]].copy()
    frame["correct_ref"] = sim["correct_quant"].astype(float)
    frame["correct_quant"] = served["correct_quant"].astype(float)
    frame["agree_parity"] = (_answers(inputs.simulation.items, "quant").loc[sim.index]
                             == _answers(inputs.served.items, "quant").loc[sim.index]).astype(float)
    if inputs.floor is not None:
        floor = inputs.floor.items
        frame["agree_floor"] = (_answers(floor, "ref").loc[sim.index] == _answers(floor, "quant").loc[sim.index]
                                ).astype(float)
    else:
        frame["agree_floor"] = np.nan
    if inputs.own_floor is not None:
        frame["agree_own"] = (_answers(inputs.simulation.items, "quant").loc[sim.index]
                              == _answers(inputs.own_floor.items, "quant").loc[sim.index]).astype(float)
    else:
        frame["agree_own"] = np.nan
    return frame.reset_index()


def _token_column(run: RunData | None, slice_name: str) -> tuple[float, str]:
    """A run's headline KL on a slice from its summary, and what it is measured on."""
    if run is None:
        return float("nan"), ""
    metrics = run.summary.get("metrics", {})
    value = metrics.get(f"{slice_name}/kl_mean", metrics.get(f"{slice_name}/kl_lower_bound_mean"))
    on = "exact" if f"{slice_name}/kl_mean" in metrics else ("top-k lower bound" if value is not None else "")
    return (float(value) if value is not None else float("nan")), on


def excess_over_floor(items: pd.DataFrame, floor_col: str = "agree_floor", **settings) -> dict:
    """Agreement of simulation with served minus agreement of a floor's pair (``floor_col``: the reference with
    its served self, ``agree_floor``; the simulation with its perturbed self, ``agree_own``), on the same
    items, with its interval from the clustered paired score statistic (``settings``:
    :func:`harness.stats.compare_frame`'s), and whether it lies wholly below 0."""
    row = stats.compare_frame(items.assign(overall="overall"), by=["overall"], ref_col=floor_col,
                              quant_col="agree_parity", **settings).iloc[0]
    return {"excess": row["delta"], "excess_ci_low": row["delta_ci_low"], "excess_ci_high": row["delta_ci_high"],
            "exceeds_floor": bool(row["delta_ci_high"] < 0)}


def _floors(part: pd.DataFrame, common: dict) -> dict:
    """The excess over each floor given, the binding (larger) floor, and the flag (see the module)."""
    out: dict = {}
    given = {}
    for name, column in (("engine", "agree_floor"), ("own", "agree_own")):
        if part[column].notna().all():
            found = excess_over_floor(part, column, **common)
            given[name] = found
            out.update({f"excess_{name}": found["excess"], f"excess_{name}_ci_low": found["excess_ci_low"],
                        f"excess_{name}_ci_high": found["excess_ci_high"]})
        else:
            out.update({f"excess_{name}": np.nan, f"excess_{name}_ci_low": np.nan, f"excess_{name}_ci_high": np.nan})
    if not given:
        return {**out, "binding_floor": None, "excess": np.nan, "excess_ci_low": np.nan, "excess_ci_high": np.nan,
                "exceeds_floor": None}
    # the floor whose pair agrees less binds; on a tie the engine's
    binding = min(given, key=lambda name: (-given[name]["excess"], name != "engine"))
    return {**out, "binding_floor": "engine" if binding == "engine" else "scheme",
            "excess": given[binding]["excess"], "excess_ci_low": given[binding]["excess_ci_low"],
            "excess_ci_high": given[binding]["excess_ci_high"],
            "exceeds_floor": all(found["exceeds_floor"] for found in given.values())}


def _kl_check(kl_sim: float, kl_served: float, on: str) -> str:
    """The simulation's KL from the reference against the served run's (a bound where ``on`` says so)."""
    if np.isnan(kl_sim) or np.isnan(kl_served):
        return ""
    if on == "top-k lower bound":
        if kl_served > kl_sim:
            return "served further from the reference than simulated (its lower bound exceeds the simulation's KL)"
        return "consistent (the served lower bound does not exceed the simulation's KL)"
    return "served further from the reference than simulated" if kl_served > kl_sim else \
        "served not further from the reference than simulated"


def parity_table(inputs: ParityInputs, *, ci_level: float = 0.95, seed: int = 0,
                 min_clusters: int = stats.MIN_CLUSTERS, margin: float = 0.02) -> pd.DataFrame:
    """Per slice and overall: accuracy Δ (served − simulation) and its verdict against ``margin`` (the quality
    headline), answer agreement, the excess over each floor, the flag, KL."""
    frame = agreement_frame(inputs).assign(overall="overall")
    strata = summary.design_strata(frame)  # slice x declared stratum, as every run's own statistics
    if strata is not None:
        frame["design_stratum"] = strata
    # n_resamples: the flip-rate intervals' bootstrap, not shown here
    common = dict(cluster_col="cluster" if "cluster" in frame else None,
                  stratum_col=None if strata is None else "design_stratum", seed=seed,
                  correction="none", ci_level=ci_level, min_clusters=min_clusters, n_resamples=200)
    rows = []
    for by in (["overall"], ["slice"]):
        accuracy = stats.compare_frame(frame, by=by, margin=margin, **common)
        for _, row in accuracy.iterrows():
            name = row[by[0]]
            part = frame if name == "overall" else frame[frame["slice"] == name]
            out = {"slice": name, "n": len(part), "acc_sim": row["acc_ref"], "acc_served": row["acc_quant"],
                   "delta": row["delta"], "delta_ci_low": row["delta_ci_low"], "delta_ci_high": row["delta_ci_high"],
                   "sim_right_served_wrong": int(row["flips_right_to_wrong"]),
                   "sim_wrong_served_right": int(row["flips_wrong_to_right"]),
                   "verdict": row["verdict"], "margin": margin,
                   "disagree_sim_served": 1.0 - float(part["agree_parity"].mean()),
                   "disagree_floor": 1.0 - float(part["agree_floor"].mean()),
                   "disagree_own_floor": 1.0 - float(part["agree_own"].mean())}
            out.update(_floors(part, common))
            kl_slice = "overall" if name == "overall" else name
            out["kl_sim"], _ = _token_column(inputs.simulation, kl_slice)
            out["kl_served"], out["kl_served_on"] = _token_column(inputs.served, kl_slice)
            out["kl_floor"], _ = _token_column(inputs.floor, kl_slice)
            out["kl_own_floor"], _ = _token_column(inputs.own_floor, kl_slice)
            out["kl_check"] = _kl_check(out["kl_sim"], out["kl_served"], out["kl_served_on"])
            rows.append(out)
    return pd.DataFrame(rows)
