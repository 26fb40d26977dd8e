"""The gate's criteria: per slice, the outcome read off the one displayed interval (the rule is in
:mod:`harness.decision.gate`'s docstring), and the outcome of a run and of a set of runs.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import scipy.stats as sps

from harness import stats
from harness.config import GateConfig, TokenGateConfig
from harness.decision.gate_inputs import GateInputError, RunResults
from harness.evaluation import sequential_run
from harness.results.report import simulation_lines
from harness.stats.score import restricted_loss

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
EXIT_CODES = {PASS: 0, FAIL: 1, INCONCLUSIVE: 2}
EXIT_BAD_INPUT = 3
_RANK = {PASS: 0, INCONCLUSIVE: 1, FAIL: 2}

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
    notes: list[str] = field(default_factory=list)  # what the verdict leaves out (simulated activations)

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

    @property
    def notes(self) -> list[str]:
        """Every run's notes: what its verdict leaves out."""
        return [note for run in self.runs for note in run.notes]

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "exit_code": self.exit_code, "config": self.config,
                "runs": [{"run_name": r.run_name, "directory": r.directory, "model": r.model, "scheme": r.scheme,
                          "outcome": r.outcome, "slices": r.slice_outcomes(), "notes": r.notes,
                          "criteria": [asdict(c) for c in r.criteria]} for r in self.runs]}


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    return format(value, spec)


def _json_number(value: Any) -> Any:
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
        strata = group["stratum"].to_numpy(dtype=object) if "stratum" in group else None  # missing: one stratum
        ref, quant = group["correct_ref"].to_numpy(float), group["correct_quant"].to_numpy(float)
        shown = stats.paired_compare(ref, quant, clusters=clusters, strata=strata,
                                     n_resamples=int(compare.get("n_resamples", 2000)),
                                     seed=int(compare.get("seed", 0)), ci_level=1 - 2 * cfg.alpha, margin=margin,
                                     min_clusters=1)
        fail_level = 1 - 2 * cfg.alpha / family
        row = shown.to_dict()
        record = (run.summary.get("sequential") or {}).get(name)
        if record is not None:  # a sequential run: its confidence sequence decides, at this gate's α and margin
            sequence = sequential_run.gate_sequence(group, _not_evaluated(run, name), record, margin, cfg.alpha, family)
            row.update(delta_ci_low=sequence.lower, delta_ci_high=sequence.upper, fail_ci_high=sequence.upper,
                       interval="sequence", items_total=sequence.n_total, method=record["method"])
        else:
            codes = stats.paired.cluster_codes(clusters, len(group))
            layers = None if strata is None else stats.strata.estimable_strata(
                stats.stratum_codes(strata, len(group)), codes)
            row.update(fail_ci_high=stats.score_test(quant - ref, codes, layers).interval(fail_level)[1],
                       interval="score")
        row.update(slice=name, chance=slice_chance(cfg, name, group), fail_level=fail_level, family=family,
                   discordance=float(np.abs(quant - ref).mean()))  # mean |d|: the items a fail needs
        out.append(_accuracy_decision(row, cfg, correction))
    return out


# The score test's largest false-pass rate at Δ = -m with few clusters, α = 0.05 (benchmarks/bench_gate_oc.py,
# 2,000 data sets per design, README): why a pass needs gate.min_clusters_pass clusters.
FEW_CLUSTER_FALSE_PASS = ("measured up to 0.108 with 5 clusters and 0.075 with 10, 0.158 with 10 when flips "
                          "concentrate (ICC 0.2); at most 0.060 from 20")


def _clusters_counted(row: dict[str, Any]) -> int:
    """The random clusters gate.min_clusters_pass counts: G - K + 1 (``n_clusters_within``: the clusters left
    once each stratum's mean is taken out; docs/explanation/strata.md), G for rows without it."""
    within = row.get("n_clusters_within")
    return int(row["n_clusters"]) if within is None or math.isnan(float(within)) else int(within)


def _few_clusters_to_pass(row: dict[str, Any], cfg: GateConfig) -> bool:
    """Whether a slice of multi-item clusters has fewer random clusters than a pass needs (strata are not
    counted; a sequence read by betting assumes nothing of the clusters and is exempt)."""
    clustered = int(row["n_clusters"]) < int(row["n"])
    betting = row.get("interval") == "sequence" and row.get("method") == "betting"
    return clustered and not betting and _clusters_counted(row) < cfg.min_clusters_pass


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


def fail_items(discordance: float, design_effect: float, delta: float, margin: float, level: float,
               clusters_per_item: float = 1.0) -> int | None:
    """Items for 80 % power of the fail claim (inferiority beyond ``margin``, the one-sided level-``level``
    score test) if the true Δ were the observed ``delta``, at the observed discordance (mean |d|) and design
    effect; None unless ``delta`` lies beyond ``-margin``. The normal approximation of
    :func:`harness.stats.paired.noninferiority_items` turned round: the score test's null variance at
    Δ = -m of the observed table, the variance of d at Δ = ``delta``, and the critical value of t on the
    clusters n items would bring, less one (more items of the same kind: ``clusters_per_item`` × n)."""
    gap = -margin - delta
    if not gap > 1e-12 or not math.isfinite(design_effect):
        return None
    gains, losses = (discordance + delta) / 2, (discordance - delta) / 2
    sigma0 = math.sqrt(max(2 * float(restricted_loss(-margin, gains, losses, 1.0)) - margin * (1 + margin), 0.0))
    sigma1 = math.sqrt(max(discordance - delta * delta, 0.0))
    z_power = float(sps.norm.ppf(0.8))
    critical, n = float(sps.norm.ppf(1 - level)), 2
    for _ in range(20):
        n_new = max(2, int(math.ceil(design_effect * ((critical * sigma0 + z_power * sigma1) / gap) ** 2)))
        critical = float(sps.t.ppf(1 - level, max(1, math.ceil(clusters_per_item * n_new) - 1)))
        if n_new == n:
            break
        n = n_new
    return n


def _unsettleable_reason(delta: float, margin: float, n: int, n_fail: int | None) -> str:
    """Why more items cannot make a slice observed at or beyond the margin pass, and what they can do."""
    if n_fail is None:  # Δ̂ at the margin: in expectation neither bound ever clears it
        return (f"cannot be settled by more items: Δ̂ {100 * delta:+.1f} pt is at the margin "
                f"-{100 * margin:.1f} pt, so neither a pass nor a fail is expected")
    return (f"a pass is out of reach (Δ̂ {100 * delta:+.1f} pt is beyond the margin -{100 * margin:.1f} pt), but more "
            f"items would settle it as a fail: about {n_fail} items ({n} now) give 80 % power if the true Δ "
            f"is Δ̂, at this slice's discordance and design effect")


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
        counted = _clusters_counted(row)
        strata = "" if counted == clusters else f"; counted with its strata taken out, of {clusters} clusters in all"
        reasons = [f"non-inferior on its interval, but a pass needs {cfg.min_clusters_pass} random clusters "
                   f"(gate.min_clusters_pass; this slice has {counted} of {n} items{strata}): with fewer the measured "
                   f"false-pass rate at the margin exceeds α ({FEW_CLUSTER_FALSE_PASS})"]
    elif low > -margin and headroom < cfg.min_headroom:
        outcome = INCONCLUSIVE
        reasons = [f"reference near floor/chance (acc ref {100 * row['acc_ref']:.1f} % - chance {100 * row['chance']:.1f} % "
                   f"= {100 * headroom:.1f} pt < gate.min_headroom={cfg.min_headroom}): it cannot show a loss"]
    elif low > -margin:
        outcome = PASS
    else:
        outcome = INCONCLUSIVE
        reasons = [f"non-inferiority not shown: lower bound {100 * low:+.1f} pt <= -{100 * margin:.1f} pt"]
        if fail_high >= -margin and high < 0:
            reasons.append("a drop is shown, its size against the margin is not")
        if row["mde"] > margin and row.get("interval") != "sequence":
            reasons.append(f"MDE {100 * row['mde']:.1f} pt exceeds the margin {100 * margin:.1f} pt")
    # More items settle it unless Δ̂ is at/beyond the margin, the reference is at the floor, or clusters are few.
    settleable = bool(row["settleable"]) and row.get("interval") != "sequence"  # a sequence used what it had
    settles = outcome == INCONCLUSIVE and settleable and headroom >= cfg.min_headroom and clusters >= cfg.min_clusters
    n_fail: int | None = None
    if outcome == INCONCLUSIVE and row.get("interval") == "sequence" and not any(r.startswith("too few") for r in reasons):
        reasons.append(f"the confidence sequence did not settle on the slice's {row['items_total']} items")
    elif outcome == INCONCLUSIVE and not settleable and not any(r.startswith("too few") for r in reasons):
        n_fail = fail_items(float(row["discordance"]), float(row["design_effect"]), float(row["delta"]), margin,
                            (1 - float(row["fail_level"])) / 2, clusters_per_item=clusters / n)
        reasons.append(_unsettleable_reason(float(row["delta"]), margin, n, n_fail))
    numbers = {key: _json_number(row[key]) for key in ("n", "n_clusters", "acc_ref", "acc_quant", "delta", "delta_ci_low",
                                                 "delta_ci_high", "delta_se", "delta_p", "design_effect",
                                                 "flips_right_to_wrong", "flips_wrong_to_right", "noninferiority_p",
                                                 "inferiority_p", "mde", "fail_ci_high", "fail_level")}
    numbers.update({"margin": margin, "alpha": cfg.alpha, "ci_level": 1 - 2 * cfg.alpha, "correction": correction,
                    "family": family, "chance": row["chance"], "headroom": headroom, "settleable": settleable,
                    "n_needed": _json_number(row["n_needed"]) if settles else None,
                    "n_fail": n_fail if outcome == INCONCLUSIVE else None})
    interval = (f"confidence sequence: lower bound (level {cfg.alpha:g}) {100 * low:+.1f} pt" if row.get("interval") == "sequence"
                else f"{level:.4g} % CI [{100 * low:+.1f}, {100 * high:+.1f}]")
    if row.get("interval") == "sequence":
        adjusted = adjusted.replace("upper bound", "sequence upper bound")
        numbers["items_total"] = int(row["items_total"])
        numbers["interval"] = "sequence"
    message = (f"{outcome}: delta {100 * row['delta']:+.1f} pt, {interval} "
               f"vs margin -{100 * margin:.1f} pt ({adjusted} {100 * fail_high:+.1f}); acc ref {100 * row['acc_ref']:.1f} %, "
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
            bound = metrics.get(f"{name}/kl_lower_bound_mean") if metric == "kl_mean" else None
            if value is None and bound is not None:  # a served candidate: the KL on the server's top-k partition
                # the exact KL is at least the bound: a bound above the limit fails, one below it shows nothing
                failed = bound > limit
                out.append(Criterion(
                    name, metric, FAIL if failed else INCONCLUSIVE,
                    (f"fail: kl_mean >= {bound:.4g} (a lower bound from the server's top-k log-probs), required <= "
                     f"{limit:g}") if failed else
                    (f"inconclusive: only a lower bound of kl_mean is known ({bound:.4g}, from the server's top-k "
                     f"log-probs); it cannot show kl_mean <= {limit:g}"),
                    [f"kl_mean lower bound {bound:.4g} not <= {limit:g}" if failed else "kl_mean: lower bound only"],
                    {"lower_bound": bound, "limit": limit}))
                continue
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


# gate.outcomes keys: the metric each reads (po_<key>_delta: an increase is worse; po_<key>_lost_delta: a loss)
RISING_OUTCOMES = ("refused", "loop", "empty", "cap_hit")
KEPT_OUTCOMES = ("json", "code", "language")


def check_outcome_limits(cfg: GateConfig) -> None:
    """gate.outcomes names known outcomes with limits in [0, 1], else one line saying which and what to use."""
    for key, limit in dict(cfg.outcomes).items():
        if key not in RISING_OUTCOMES + KEPT_OUTCOMES:
            raise GateInputError(f"gate.outcomes.{key}: unknown outcome; use one of "
                                 f"{', '.join(RISING_OUTCOMES + KEPT_OUTCOMES)}")
        if not 0 <= float(limit) < 1:
            raise GateInputError(f"gate.outcomes.{key}={limit}: give the largest change allowed as a fraction in "
                                 "[0, 1), e.g. 0.02 for 2 points")


def outcome_criteria(run: RunResults, cfg: GateConfig, slices: list[str]) -> list[Criterion]:
    """A prompt log's gold-free outcomes against ``gate.outcomes``: the change (an increase of refusals, loops,
    empty replies or cap hits; a loss of JSON, code or language kept) read off its displayed interval
    (compare.ci_level, two-sided): pass when the whole interval is within the limit, fail when the whole interval
    is beyond it, inconclusive otherwise or with fewer than gate.min_items prompts."""
    check_outcome_limits(cfg)
    metrics = run.summary.get("metrics", {})
    out = []
    for name in slices:
        n = metrics.get(f"{name}/po_n")
        if n is None:
            continue
        for key, limit in dict(cfg.outcomes).items():
            stem = f"{name}/po_{key}_delta" if key in RISING_OUTCOMES else f"{name}/po_{key}_lost_delta"
            worse = "increase" if key in RISING_OUTCOMES else "loss"
            sign = 1.0 if key in RISING_OUTCOMES else -1.0  # the change, made "larger is worse"
            delta, low, high = (metrics.get(stem), metrics.get(f"{stem}_ci_low"), metrics.get(f"{stem}_ci_high"))
            count = n if key in RISING_OUTCOMES else metrics.get(f"{name}/po_{key}_eligible", 0)
            criterion = f"outcome_{key}"
            if delta is None or low is None or high is None or (count or 0) < cfg.min_items:
                out.append(Criterion(name, criterion, INCONCLUSIVE,
                                     f"inconclusive: {key} {worse} has {int(count or 0)} prompts to judge (gate."
                                     f"min_items={cfg.min_items}) or no interval", [f"{key}: too few prompts"],
                                     {"limit": limit, "n": count}))
                continue
            change, lo, hi = sign * delta, min(sign * low, sign * high), max(sign * low, sign * high)
            outcome = PASS if hi <= limit else FAIL if lo > limit else INCONCLUSIVE
            shown = f"{100 * change:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] pt"
            out.append(Criterion(name, criterion, outcome,
                                 f"{outcome}: {key} {worse} {shown}, allowed at most {100 * limit:.1f} pt",
                                 [] if outcome == PASS else [f"{key} {worse} {shown} vs {100 * limit:.1f} pt"],
                                 {"change": change, "ci_low": lo, "ci_high": hi, "limit": limit, "n": count}))
    return out


# gate.thinking keys: the metric each reads (think_tokens_ratio - 1; think_<key>_delta), an increase is worse
THINKING_KEYS = ("trace_ratio", "cap_hit", "unclosed", "loop")


def check_thinking_limits(cfg: GateConfig, thinking_on: bool | None = None) -> None:
    """gate.thinking names known keys with limits in range, and only for a thinking model (``thinking_on`` False:
    model.thinking=none), else one line saying which and what to use."""
    limits = dict(cfg.thinking)
    if limits and thinking_on is False:
        raise GateInputError(f"gate.thinking={limits} gates a reasoning model's trace, and model.thinking=none: set "
                             "model.thinking=tags (or harmony) for a thinking model, or drop gate.thinking")
    for key, limit in limits.items():
        if key not in THINKING_KEYS:
            raise GateInputError(f"gate.thinking.{key}: unknown; use one of {', '.join(THINKING_KEYS)}")
        value = float(limit)
        if key == "trace_ratio" and not (math.isfinite(value) and value >= 0):
            raise GateInputError(f"gate.thinking.trace_ratio={limit}: give the largest increase of trace tokens "
                                 "allowed as a fraction >= 0, e.g. 0.2 for 20 % longer")
        if key != "trace_ratio" and not 0 <= value < 1:
            raise GateInputError(f"gate.thinking.{key}={limit}: give the largest increase allowed as a fraction in "
                                 "[0, 1), e.g. 0.02 for 2 points")


def thinking_criteria(run: RunResults, cfg: GateConfig, slices: list[str]) -> list[Criterion]:
    """A thinking model's trace against ``gate.thinking``: the increase of trace tokens (candidate / reference - 1,
    its paired cluster-bootstrap interval) or of the cap-hit, unclosed or loop rates (the paired clustered score
    interval), each read off the interval the report shows (compare.ci_level, two-sided): pass when the whole
    interval is within the limit, fail when the whole interval is beyond it, inconclusive otherwise or with fewer
    than gate.min_items generation items. A slice without generation items has no trace and is not judged."""
    check_thinking_limits(cfg)
    limits = dict(cfg.thinking)
    if not limits:
        return []
    metrics = run.summary.get("metrics", {})
    if not any(key.endswith("/think_n") for key in metrics):
        if str((run.config.get("model") or {}).get("thinking") or "none") != "none":
            return []  # a thinking run without generation items: no trace to judge
        raise GateInputError(f"gate.thinking={limits}, and {run.directory} has no trace metrics (not a thinking "
                             "run: model.thinking=none); drop gate.thinking for it")
    out = []
    for name in slices:
        n = metrics.get(f"{name}/think_n")
        if n is None:
            continue
        for key, limit in limits.items():
            limit = float(limit)
            if key == "trace_ratio":
                stem, shift, unit = f"{name}/think_tokens_ratio", 1.0, "%"
            else:
                stem, shift, unit = f"{name}/think_{key}_delta", 0.0, "pt"
            value, low, high = (metrics.get(stem), metrics.get(f"{stem}_ci_low"), metrics.get(f"{stem}_ci_high"))
            criterion = f"thinking_{key}"
            if value is None or low is None or high is None or n < cfg.min_items:
                out.append(Criterion(name, criterion, INCONCLUSIVE,
                                     f"inconclusive: {key} has {int(n)} items to judge (gate.min_items="
                                     f"{cfg.min_items}) or no interval", [f"{key}: too few items or no interval"],
                                     {"limit": limit, "n": n}))
                continue
            change, lo, hi = value - shift, low - shift, high - shift
            outcome = PASS if hi <= limit else FAIL if lo > limit else INCONCLUSIVE
            shown = f"{100 * change:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] {unit}"
            what = "trace tokens" if key == "trace_ratio" else f"{key} rate"
            reasons = [] if outcome == PASS else [f"{what} increase {shown} vs {100 * limit:.1f} {unit}"]
            clusters = metrics.get(f"{name}/think_n_clusters")
            if outcome == PASS and clusters is not None and clusters < n and clusters < cfg.min_clusters_pass:
                outcome = INCONCLUSIVE  # as for accuracy: with few clusters the interval passes too often
                reasons = [f"within the limit, but a pass needs {cfg.min_clusters_pass} clusters "
                           f"(gate.min_clusters_pass; {int(clusters)} of {int(n)} items here)"]
            out.append(Criterion(name, criterion, outcome,
                                 f"{outcome}: {what} increase {shown}, allowed at most {100 * limit:.1f} {unit}"
                                 + ("; " + reasons[0] if outcome == INCONCLUSIVE and reasons else ""), reasons,
                                 {"change": change, "ci_low": lo, "ci_high": hi, "limit": limit, "n": n,
                                  "clusters": clusters}))
    return out


# ---------------------------------------------------------------- the pairwise judge (gate.judge_loss_max)
# Read off the interval the report shows (``<slice>/judge_loss_minus_win``, compare.ci_level two-sided, clustered and
# stratified: harness.evaluation.judge_stats) as gate.outcomes is: pass when the whole interval is at or below the
# limit, fail when it is all above, inconclusive otherwise or with fewer than gate.min_items judged prompts; its
# false-pass rate at the limit is measured in benchmarks/bench_judge_gate.py (docs/benchmarks/judge.md).
JUDGE_CRITERION = "judge_loss"  # gate.judge_loss_max against the pairwise judge's loss − win


def _judge_readable(loss_minus_win: float | None, low: float | None, high: float | None, decided: float | None,
                    min_items: int) -> bool:
    """Whether a slice's judge numbers can be read off at all: an interval, over at least ``min_items`` prompts."""
    return not (loss_minus_win is None or low is None or high is None or (decided or 0) < min_items)


def judge_outcome(loss_minus_win: float | None, low: float | None, high: float | None, decided: float | None,
                  limit: float, min_items: int) -> str:
    """pass / fail / inconclusive of one slice (module docstring)."""
    if not _judge_readable(loss_minus_win, low, high, decided, min_items):
        return INCONCLUSIVE
    return PASS if high <= limit else FAIL if low > limit else INCONCLUSIVE


def judge_criteria(run: RunResults, cfg: GateConfig, slices: list[str]) -> list[Criterion]:
    """One criterion per judged slice of ``slices`` when gate.judge_loss_max is set ([] otherwise, or for a run the
    judge did not read)."""
    if cfg.judge_loss_max is None:
        return []
    limit = float(cfg.judge_loss_max)
    metrics = run.summary.get("metrics", {})
    out = []
    for name in slices:
        stem = f"{name}/judge_loss_minus_win"
        if metrics.get(f"{name}/judge_n") is None:
            continue
        value, low, high = metrics.get(stem), metrics.get(f"{stem}_ci_low"), metrics.get(f"{stem}_ci_high")
        decided = metrics.get(f"{name}/judge_decided")
        unparsable = int(metrics.get(f"{name}/judge_unparsable") or 0)
        outcome = judge_outcome(value, low, high, decided, limit, int(cfg.min_items))
        numbers = {"change": value, "ci_low": low, "ci_high": high, "limit": limit, "n": decided,
                   "unparsable": unparsable, "consistency": metrics.get(f"{name}/judge_consistency")}
        if not _judge_readable(value, low, high, decided, int(cfg.min_items)):
            out.append(Criterion(name, JUDGE_CRITERION, INCONCLUSIVE,
                                 f"inconclusive: the judge decided {int(decided or 0)} prompts (gate.min_items="
                                 f"{cfg.min_items}) or gave no interval; {unparsable} unparsable",
                                 ["judge: too few judged prompts"], numbers))
            continue
        shown = f"{100 * value:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] pt"
        out.append(Criterion(name, JUDGE_CRITERION, outcome,
                             f"{outcome}: judge loss − win {shown}, allowed at most {100 * limit:.1f} pt "
                             f"({int(decided)} prompts judged, {unparsable} unparsable)",
                             [] if outcome == PASS else [f"judge loss − win {shown} vs {100 * limit:.1f} pt"], numbers))
    return out


def decide_run(run: RunResults, cfg: GateConfig) -> RunDecision:
    accuracy = accuracy_criteria(run, cfg)
    slices = [c.slice for c in accuracy]
    tokens = token_criteria(run, cfg, slices)
    outcomes = outcome_criteria(run, cfg, slices)
    traces = thinking_criteria(run, cfg, slices)
    judged = judge_criteria(run, cfg, slices)
    order = {s: i for i, s in enumerate(slices)}
    criteria = sorted(accuracy + tokens + outcomes + traces + judged, key=lambda c: order[c.slice])
    notes = [f"{run.summary.get('scheme', '')}: {line}" for line in simulation_lines(run.summary)]
    return RunDecision(str(run.summary.get("run_name", run.directory.name)), str(run.directory),
                       str(run.summary.get("model", "")), str(run.summary.get("scheme", "")), criteria, notes)
