"""``python -m harness.recommend model=... quant=<low-precision scheme> budget.kl_mean=0.2`` (or ``budget.bits=6``).

Which layers must stay in high precision. From the layer sensitivity (harness.planning.sensitivity: the KL
each unit — a decoder block or one linear — causes when it alone is quantized, on the divergence
texts), choose the units the scheme quantizes; the rest stay at 16 bits (the scheme's ``keep``). A
mixture-of-experts layer's experts are one unit (``granularity=linear``: ``<layer>.mlp.experts``, kept as
``<layer>.mlp.experts.*``) or part of their block's; never one expert alone, since a scheme keeps a fused
experts module whole or not at all (harness.quant.coverage):

* ``budget.kl_mean=x``: the fewest bits per weight whose predicted mean KL is ≤ x;
* ``budget.bits=b``: the least predicted KL at ≤ b bits per weight (of the scheme's target linears,
  kept ones at 16, scales included).

Predicted KL is the sum of the units' KLs. Why they add: for small perturbations KL(p‖p+δp) ≈ ½ δᵀFδ
(F the Fisher information), and the cross terms between two units' weight errors average out when the
errors are uncorrelated (independent roundings). The recommendation is then measured (the combined
scheme applied and scored on the same texts) and the two are reported side by side.

Solved exactly as a 0/1 knapsack with ``scipy.optimize.milp`` (HiGHS; one binary per unit; a few hundred
at most). Greedy by KL saved per bit is optimal only for the fractional problem and can miss the best 0/1
choice. HiGHS's absolute tolerances (~1e-6) are the size of an 8-bit scheme's KLs, so the objective and the
budget row are scaled to order one, the relative gap is 0, and the rounded choice is checked against the
budget in exact terms afterwards (a choice over it is re-solved under a budget tightened by the excess).
Bits per weight are :func:`harness.quant.report.bits_per_weight`'s: over every linear but the output head,
the units kept and the linears no unit covers at 16 bits.

Writes under ``<paths.results_dir>/recommend/<model>__<scheme>/`` the sensitivity it computed (reused by
later budgets; ``python -m harness.sensitivity``'s table is reused too) and, in ``<name>/``: ``<name>.yaml`` (a scheme usable as
``quant=<name>`` once in conf/quant/: ``save_as=<name>`` puts it there), ``recommendation.json``,
``units.csv``, ``frontier.csv`` and ``frontier.png`` (bits/weight vs measured KL of the recommendation
against uniform schemes: ``dominated_by_uniform`` lists the uniform schemes with no more bits and no more
KL, ``below_interpolated_uniform_frontier`` compares with the straight line between neighbouring uniform
points — a mix of two formats per layer, which the targets/keep form cannot express); ``run=true`` then runs it through the normal pipeline. Logged to MLflow as a
run tagged ``harness.kind=recommend``.
"""
from __future__ import annotations

import copy
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from harness import cli
from harness.config import CONF_DIR, QuantConfig
from harness.errors import UsageError
from harness.infra.cache import atomic_write_json, atomic_write_text

log = logging.getLogger("harness.recommend")
HIGH_BITS = 16.0
DEFAULT_FRONTIER = ("int4_g128", "int8", "fp8", "nvfp4", "mxfp4")


class BudgetError(UsageError):
    """A budget that cannot be met, or that needs no mixed precision; the message says what would."""


@dataclass
class Unit:
    name: str
    linears: list[str]
    params: int
    quant_bits: float  # storage bits of the unit's weights when quantized (scales included)
    kl: float  # mean KL when this unit alone is quantized
    counted: bool = True  # counts in bits per weight (False: the output head, see harness.quant.report.bits_per_weight)


@dataclass
class Choice:
    quantized: list[bool]
    bits_per_weight: float
    predicted_kl: float


def bits_per_weight(units: list[Unit], quantized: list[bool], other_params: float = 0.0) -> float:
    """Bits per weight of a choice; ``other_params``: linears no unit covers (kept, at 16 bits)."""
    from harness.quant import bits_per_weight as scheme_bits

    chosen = [(u.params, u.quant_bits / u.params) for u, q in zip(units, quantized) if q and u.counted]
    kept = sum(u.params for u, q in zip(units, quantized) if not q and u.counted)
    return scheme_bits(chosen, kept + other_params, HIGH_BITS)


def _choice(units: list[Unit], quantized: list[bool], other_params: float = 0.0) -> Choice:
    return Choice(list(quantized), bits_per_weight(units, quantized, other_params),
                  float(sum(u.kl for u, q in zip(units, quantized) if q)))


def _milp(objective: np.ndarray, row: np.ndarray, low: float, high: float) -> np.ndarray:
    """min objective·x over x ∈ {0,1}ⁿ with low ≤ row·x ≤ high, scaled for HiGHS's tolerances."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    objective_scale = float(np.abs(objective).max()) or 1.0
    row_scale = max(abs(v) for v in (low, high) if np.isfinite(v)) or 1.0
    result = milp(objective / objective_scale, constraints=[LinearConstraint(row[None, :] / row_scale,
                                                                             low / row_scale, high / row_scale)],
                  integrality=np.ones(len(objective)), bounds=Bounds(0, 1), options={"mip_rel_gap": 0.0})
    if not result.success:
        raise BudgetError(f"no choice of units meets the budget ({result.message})")
    return np.round(result.x).astype(bool)


def solve(units: list[Unit], *, kl_budget: float | None = None, bits_budget: float | None = None,
          other_params: float = 0.0) -> Choice:
    """The exact 0/1 choice for one budget (see the module doc); infeasible or trivial budgets raise.

    ``other_params``: parameters of the linears that count in bits per weight but are no unit (the
    base scheme keeps them at 16 bits).
    """
    if (kl_budget is None) == (bits_budget is None):
        raise BudgetError("give exactly one budget: budget.kl_mean=<nats> or budget.bits=<bits per weight>")
    if not units:
        raise BudgetError("no units to choose from: the scheme quantizes no linear of this model")
    everything = _choice(units, [True] * len(units), other_params)
    # Bits per weight saved by quantizing a unit, times the counted parameters (a constant).
    saving = np.array([u.params * HIGH_BITS - u.quant_bits if u.counted else 0.0 for u in units])
    kl = np.array([u.kl for u in units])
    counted = sum(u.params for u in units if u.counted) + other_params
    if kl_budget is not None:
        if kl_budget <= 0:
            raise BudgetError(f"budget.kl_mean={kl_budget} cannot be met: only the unquantized model has KL 0; give "
                              "a positive budget (every unit quantized is predicted at "
                              f"{everything.predicted_kl:.4g})")
        if everything.predicted_kl <= kl_budget:
            raise BudgetError(f"budget.kl_mean={kl_budget} is met by the uniform scheme already (predicted KL "
                              f"{everything.predicted_kl:.4g} at {everything.bits_per_weight:.3f} bits/weight): use the "
                              "scheme as it is, or a lower-bit scheme, or a budget below that")
        limit = kl_budget
        for _ in range(5):  # the solver's feasibility tolerance can admit a choice just over the budget
            choice = _choice(units, _milp(-saving, kl, -np.inf, limit).tolist(), other_params)
            if choice.predicted_kl <= kl_budget:
                return choice
            limit -= max(choice.predicted_kl - kl_budget, kl_budget * 1e-12)
        raise BudgetError(f"budget.kl_mean={kl_budget}: the solver's choices kept exceeding the budget; give a "
                          "slightly larger or smaller budget")
    assert bits_budget is not None
    if bits_budget < everything.bits_per_weight:
        raise BudgetError(f"budget.bits={bits_budget} cannot be met: even every unit quantized is "
                          f"{everything.bits_per_weight:.3f} bits/weight; raise the budget or pick a lower-bit "
                          "scheme")
    if bits_budget >= HIGH_BITS:
        raise BudgetError(f"budget.bits={bits_budget} is met by the unquantized model ({HIGH_BITS:g} bits, KL 0); "
                          f"give a budget between {everything.bits_per_weight:.3f} and {HIGH_BITS:g}")
    needed = (HIGH_BITS - bits_budget) * counted
    for _ in range(5):
        chosen = _milp(kl, saving, needed, np.inf)
        choice = _choice(units, chosen.tolist(), other_params)
        if choice.bits_per_weight <= bits_budget:
            return choice
        needed += max((choice.bits_per_weight - bits_budget) * counted, needed * 1e-12)
    raise BudgetError(f"budget.bits={bits_budget}: the solver's choices kept exceeding the budget; give a slightly "
                      "larger or smaller budget")


def recommended_scheme(scheme: QuantConfig, units: list[Unit], choice: Choice, name: str,
                       granularity: str) -> QuantConfig:
    """``scheme`` with the units not chosen added to ``keep``: a unit of several matrices (a block, a MoE
    layer's experts) as ``<unit>.*``, a linear by name."""
    out = copy.deepcopy(scheme)
    out.name = name
    kept = [f"{u.name}.*" if u.linears != [u.name] else u.name
            for u, quantized in zip(units, choice.quantized) if not quantized]
    out.keep = list(scheme.keep) + kept
    return out


def scheme_yaml(scheme: QuantConfig, header: str) -> str:
    body = OmegaConf.to_yaml(OmegaConf.structured(scheme))
    return "".join(f"# {line}\n" for line in header.splitlines()) + body


# ----------------------------------------------------------------------------- measuring
def _measure(model: Any, scheme: QuantConfig, reference: list, context: Any) -> dict[str, float]:
    """Apply ``scheme``, score KL on ``reference``, put the model back exactly."""
    from harness import quant
    from harness.divergence import scoring as divergence
    from harness.planning.sensitivity import _Snapshot  # the bitwise restore the sensitivity scan uses

    snapshot = _Snapshot(model)
    try:
        report = quant.apply(model, scheme, context)
        frame = divergence.compare_to_reference(model, reference, "recommend")
    finally:
        snapshot.restore()
    return {"kl_mean": float(frame["kl"].mean()), "bits_per_weight": float(report.summary()["bits_per_weight"])
            if report.layers else HIGH_BITS, "top1_agree": float((frame["top1_ref"] == frame["top1_quant"]).mean())}


def unit_table(model: Any, scheme: QuantConfig, sensitivity: pd.DataFrame, granularity: str) -> list[Unit]:
    from harness.planning.sensitivity import sensitivity_units, target_matrices
    from harness.quant import linear_census
    from harness.quant.format_table import storage_bits

    assert scheme.weights is not None
    linears = sensitivity_units(model, scheme, granularity)  # type: ignore[arg-type]
    shapes = target_matrices(model, scheme)  # Linears and per-expert matrices of fused experts alike
    kl = dict(zip(sensitivity["unit"], sensitivity["kl_mean"]))
    missing = sorted(set(linears) - set(kl))
    if missing:
        raise UsageError(f"the sensitivity table lacks units {missing[:3]} (of {len(missing)}); it was made for "
                             "another scheme or granularity: rerun with force_sensitivity=true")
    head = linear_census(model, [])[1]
    units = []
    for name, members in linears.items():
        params = sum(shapes[m][0] * shapes[m][1] for m in members)
        quant_bits = sum(shapes[m][0] * shapes[m][1] * storage_bits(scheme.weights, *shapes[m]) for m in members)
        units.append(Unit(name, members, params, quant_bits, max(float(kl[name]), 0.0), counted=head not in members))
    return units


def uncovered_params(model: Any, scheme: QuantConfig) -> int:
    """Parameters the scheme keeps at 16 bits (no unit) that count in bits per weight: from the coverage account
    (harness.quant.coverage), as the applied scheme's bits per weight are; the kept linears but the output head
    on a dense model, and also the routers (not Linears) of a mixture of experts."""
    from harness.quant import coverage_of

    return sum(e.numel for e in coverage_of(model, scheme).entries if e.counted and e.status != "quantized")


def plot_frontier(frontier: pd.DataFrame, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    uniform = frontier[frontier["kind"] == "uniform"].sort_values("bits_per_weight")
    ax.scatter(uniform["bits_per_weight"], uniform["kl_mean"], color="#4c72b0", label="uniform schemes")
    pareto = uniform[uniform["kl_mean"] < uniform["kl_mean"].cummin().shift(fill_value=np.inf)]
    ax.plot(pareto["bits_per_weight"], pareto["kl_mean"], "--", color="#4c72b0", label="uniform frontier")
    for row in uniform.itertuples():
        ax.annotate(row.scheme, (row.bits_per_weight, row.kl_mean), fontsize=8, xytext=(3, 3),
                    textcoords="offset points")
    rec = frontier[frontier["kind"] == "recommended"]
    ax.scatter(rec["bits_per_weight"], rec["kl_mean"], color="#c44e52", marker="*", s=160, zorder=3,
               label="recommended (measured)")
    ax.scatter(rec["bits_per_weight"], rec["predicted_kl"], facecolors="none", edgecolors="#c44e52", s=60,
               label="recommended (predicted)")
    ax.set_xlabel("bits per weight (target linears, scales included)")
    ax.set_ylabel("mean KL(ref‖quant), nats/token")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def dominated_by(frontier: pd.DataFrame, bits: float, kl: float) -> list[str]:
    """Uniform schemes at no more bits and no more KL (with one strictly less): empty = on the Pareto frontier."""
    uniform = frontier[frontier["kind"] == "uniform"]
    better = uniform[(uniform["bits_per_weight"] <= bits) & (uniform["kl_mean"] <= kl)
                     & ((uniform["bits_per_weight"] < bits) | (uniform["kl_mean"] < kl))]
    return better["scheme"].tolist()


def below_frontier(frontier: pd.DataFrame, bits: float, kl: float) -> bool:
    """Whether (bits, kl) lies on or below the piecewise-linear frontier of the uniform schemes."""
    uniform = frontier[frontier["kind"] == "uniform"].sort_values("bits_per_weight")
    xs, ys = uniform["bits_per_weight"].to_numpy(), uniform["kl_mean"].to_numpy()
    if len(xs) == 0 or bits < xs[0]:
        return bool(len(xs) == 0 or kl <= ys[0])
    hull = np.minimum.accumulate(ys)  # more bits never need more KL: the lower envelope
    return bool(kl <= float(np.interp(bits, xs, hull)) * (1 + 1e-9))


# -------------------------------------------------------------------------------- the tool
@dataclass
class Budget:
    kl_mean: Optional[float] = None  # mean KL(ref‖quant) in nats/token the recommendation may cause
    bits: Optional[float] = None  # bits per weight of the target linears it may use


@dataclass
class RecommendOptions:
    budget: Budget = field(default_factory=Budget, metadata={"help": "budget.kl_mean=<nats> or budget.bits=<bits>"})
    granularity: str = field(default="block", metadata={"help": "block | linear: the unit kept or quantized"})
    texts: int = field(default=8, metadata={"help": "divergence texts for the sensitivity and the measurements"})
    frontier: list[str] = field(default_factory=lambda: list(DEFAULT_FRONTIER),
                                metadata={"help": "uniform schemes measured for the bits-vs-KL plot"})
    save_as: Optional[str] = field(default=None, metadata={"help": "also write conf/quant/<name>.yaml"})
    run: bool = field(default=False, metadata={"help": "run the recommendation through the pipeline (needs save_as)"})
    force_sensitivity: bool = field(default=False, metadata={"help": "recompute the cached sensitivity"})
    out: Optional[str] = field(default=None, metadata={"help": "output dir (default results/recommend/...)"})


def _budget_label(budget: Budget) -> str:
    value = budget.kl_mean if budget.kl_mean is not None else budget.bits
    return ("kl" if budget.kl_mean is not None else "bits") + re.sub(r"[^0-9]+", "p", f"{value:g}")


def cached_sensitivity(directories: list[Path], meta: dict[str, Any]) -> pd.DataFrame | None:
    """A sensitivity table made for the same model, scheme, granularity, texts and slices, if any."""
    for directory in directories:
        summary = directory / "summary.json" if (directory / "summary.json").exists() else directory / "sensitivity.json"
        table = directory / "sensitivity.csv"
        if not (summary.exists() and table.exists()):
            continue
        saved = json.loads(summary.read_text())
        if all(saved.get(key) == value for key, value in meta.items()):
            log.info("sensitivity reused from %s", table)
            return pd.read_csv(table)
    return None


def recommend(cfg: Any, options: RecommendOptions, overrides: list[str] | None = None) -> dict[str, Any]:
    """Sensitivity (cached) → exact choice → scheme YAML → measured KL vs uniform schemes → files."""
    from harness import quant
    from harness.config import compose
    from harness.planning.sensitivity import layer_sensitivity, reference_texts
    from harness.sizing.report_quant import output_dir, prepare

    if options.granularity not in ("block", "linear"):
        raise UsageError(f"granularity={options.granularity!r}: use block or linear (granularity=expert is "
                         "python -m harness.sensitivity's per-expert detail; a scheme keeps a layer's experts whole)")
    if (options.budget.kl_mean is None) == (options.budget.bits is None):
        raise BudgetError("give exactly one budget: budget.kl_mean=<nats> or budget.bits=<bits per weight>")
    if options.run and not options.save_as:
        raise UsageError("run=true needs save_as=<name> (the pipeline reads schemes from conf/quant/)")
    if options.save_as and (CONF_DIR / "quant" / f"{options.save_as}.yaml").exists():
        raise UsageError(f"conf/quant/{options.save_as}.yaml exists; choose another save_as name")
    frontier_cfgs = [OmegaConf.to_object(compose([f"model={cfg.model.name}", f"quant={name}"])).quant
                     for name in options.frontier]  # unknown scheme names fail here, before the model loads
    timings: dict[str, float] = {}
    start = time.perf_counter()
    prepared = prepare(cfg)
    model = prepared.loaded.model
    reference = reference_texts(prepared.loaded, cfg, options.texts)
    timings["load_and_reference"] = time.perf_counter() - start
    out = Path(options.out) if options.out else output_dir(cfg, "recommend")
    out.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    meta = {"model": cfg.model.name, "scheme": cfg.quant.name, "granularity": options.granularity,
            "texts": len(reference), "slices": list(cfg.slices)}
    table = None if options.force_sensitivity else cached_sensitivity([output_dir(cfg, "sensitivity"), out], meta)
    if table is None:
        table = layer_sensitivity(model, prepared.scheme, reference, granularity=options.granularity,  # type: ignore[arg-type]
                                  context=prepared.context)
        table.drop(columns="order").to_csv(out / "sensitivity.csv", index=False)
        atomic_write_json(out / "sensitivity.json", meta)
    timings["sensitivity"] = time.perf_counter() - start
    units = unit_table(model, prepared.scheme, table, options.granularity)
    other = uncovered_params(model, prepared.scheme)
    start = time.perf_counter()
    choice = solve(units, kl_budget=options.budget.kl_mean, bits_budget=options.budget.bits, other_params=other)
    timings["solve"] = time.perf_counter() - start

    # a scheme name with overridden fields (int8+weights.bits=6) is no file name a quant= option can select
    base = re.sub(r"[^A-Za-z0-9_]+", "_", str(cfg.quant.name)).strip("_")
    name = options.save_as or f"{base}_rec_{_budget_label(options.budget)}"
    scheme = recommended_scheme(prepared.scheme, units, choice, name, options.granularity)
    start = time.perf_counter()
    measured = _measure(model, scheme, reference, prepared.context)
    rows = [{"scheme": name, "kind": "recommended", "predicted_kl": choice.predicted_kl,
             "bits_per_weight": choice.bits_per_weight, "kl_mean": measured["kl_mean"],
             "top1_agree": measured["top1_agree"]}]
    for uniform in frontier_cfgs:
        uniform = quant.with_model_defaults(uniform, cfg.model.ragged_groups)
        try:
            quant.validate_for_model(model, uniform)
        except quant.SchemeError as exc:
            log.warning("frontier: %s skipped on this model (%s)", uniform.name, exc)
            continue
        point = _measure(model, uniform, reference, prepared.context)
        rows.append({"scheme": uniform.name, "kind": "uniform", "predicted_kl": None, **point})
    timings["measure"] = time.perf_counter() - start
    frontier = pd.DataFrame(rows)
    below_line = below_frontier(frontier, choice.bits_per_weight, measured["kl_mean"])
    dominating = dominated_by(frontier, choice.bits_per_weight, measured["kl_mean"])

    kept = [u.name for u, q in zip(units, choice.quantized) if not q]
    cache_dir, out = out, out / name  # the sensitivity is shared by every budget; the rest is per recommendation
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": cfg.model.name, "scheme": cfg.quant.name, "recommended": name, "budget": vars(options.budget),
              "granularity": options.granularity, "units": len(units), "kept_units": kept,
              "bits_per_weight": choice.bits_per_weight, "applied_bits_per_weight": measured["bits_per_weight"],
              "predicted_kl": choice.predicted_kl, "measured_kl": measured["kl_mean"], "measured_top1_agree": measured["top1_agree"],
              "dominated_by_uniform": dominating, "below_interpolated_uniform_frontier": below_line,
              "texts": len(reference),
              "all_units_predicted_kl": float(sum(u.kl for u in units)), "timings": timings, "solver": "scipy milp"}
    header = (f"{name}: {cfg.quant.name} with {len(kept)} of {len(units)} {options.granularity}s kept in high precision\n"
              f"(harness.planning.recommend, budget {vars(options.budget)}): {choice.bits_per_weight:.3f} bits/weight, "
              f"predicted KL {choice.predicted_kl:.4g}, measured {measured['kl_mean']:.4g} on {len(reference)} texts.")
    atomic_write_text(out / f"{name}.yaml", scheme_yaml(scheme, header))
    if options.save_as:
        atomic_write_text(CONF_DIR / "quant" / f"{name}.yaml", scheme_yaml(scheme, header))
    pd.DataFrame([{"unit": u.name, "params": u.params, "quant_bits_per_weight": u.quant_bits / u.params, "kl": u.kl,
                   "quantized": q} for u, q in zip(units, choice.quantized)]).to_csv(out / "units.csv", index=False)
    frontier.to_csv(out / "frontier.csv", index=False)
    plot_frontier(frontier, out / "frontier.png", f"{cfg.model.name}: {name} vs uniform schemes")
    atomic_write_json(out / "recommendation.json", result)
    if options.run:
        from harness.job import pipeline
        given = [o for o in (overrides or []) if not re.match(r"[+~]?quant[.=/]", o)]
        result["pipeline"] = pipeline.run(compose(given + [f"quant={name}"]))["metrics"]
    if cfg.tracking.enabled:
        _track_recommendation(out, cfg, result)
    result["directory"], result["sensitivity_dir"] = str(out), str(cache_dir)
    return result


def _track_recommendation(directory: Path, cfg: Any, result: dict[str, Any]) -> None:
    from harness.results import tracking

    tracking.log_tool_run(
        directory, uri=cfg.tracking.uri, experiment=cfg.tracking.experiment, kind="recommend",
        run_name=f"recommend/{cfg.model.name}/{result['recommended']}",
        tags={"model": cfg.model.name, "scheme": result["recommended"]},
        params={"base_scheme": cfg.quant.name, "granularity": result["granularity"],
                **{f"budget.{k}": v for k, v in result["budget"].items() if v is not None}},
        metrics={k: float(result[k]) for k in ("bits_per_weight", "predicted_kl", "measured_kl",
                                               "measured_top1_agree")})


TOOL = cli.Tool(prog="python -m harness.recommend", options=RecommendOptions, run_config=True,
                summary="Mixed precision from the layer sensitivity: which units the scheme quantizes (the rest kept "
                        "at 16 bits) for a KL budget (fewest bits) or a bits budget (least KL), solved exactly; "
                        "writes a scheme YAML, measures it against uniform schemes and plots the frontier.")


def _body(parsed: cli.Parsed[RecommendOptions]) -> int:
    assert parsed.options is not None
    result = recommend(parsed.run, parsed.options, parsed.overrides)
    shown = {k: v for k, v in result.items() if k not in ("kept_units", "pipeline")}
    print(json.dumps(shown, indent=1, default=str))
    print(f"kept in high precision: {', '.join(result['kept_units']) or 'none'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
