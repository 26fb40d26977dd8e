"""What a reviewer sees of a run in MLflow's own UI, computed from a finished results directory.

:mod:`harness.results.tracking` logs a run; this module decides what lands where a reviewer looks:

* :func:`headline` reads the per-slice outcome: the gate's (``gate.json``) when the job was gated, else the
  comparison's verdict label (``item_stats.parquet``) read as pass / fail / inconclusive (:func:`outcome_of`).
* The run's name says scheme, model and outcome (:func:`run_name`, ``int4_g128 · smollm2_135m · FAIL 4/5``);
  its tags ``verdict`` and ``verdict.<slice>`` filter and show as run-list columns; ``mlflow.runColor``
  colours its dot by the worst outcome (:func:`verdict_tags`).
* Its description opens with four short lines, what MLflow 3.17 shows before "Show more"
  (:func:`headline_lines`).
* Its metrics start with a fixed set per slice, in points and rounded (:func:`headline_metrics`); a few
  more follow under ``detail/`` (:func:`detail_metrics`); everything else stays in summary.json and the
  parquet files of the artifacts.
* The forest plot of Δ per slice is an image of its model-metrics tab (:func:`forest_image`).
* ``items`` and ``flips`` are tables of the run (:func:`review_tables`), for MLflow's "Artifact evaluation"
  view of up to 10 runs row by row.
* The experiment gets saved views of its run list (:func:`write_views`): "Headline" (verdict columns, then Δ
  per slice, then flips, and bar charts of Δ per slice), and one per sweep, filtered to that sweep. The saved
  view format belongs to MLflow's UI, not its API: it is written only for the MLflow versions it was checked
  on (:data:`VIEW_FORMAT_VERSIONS`); on another, one log line says so and nothing is written.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

FAIL, INCONCLUSIVE, PASS = "fail", "inconclusive", "pass"
SEVERITY = {PASS: 0, INCONCLUSIVE: 1, FAIL: 2}
# mlflow.runColor: the run's dot in the run list and its bars in the charts
RUN_COLOURS = {FAIL: "#d32f2f", INCONCLUSIVE: "#f9a825", PASS: "#2e7d32"}
VERDICT_TAG = "verdict"
SOURCE_TAG = "harness.verdict_source"  # gate | comparison: where the verdict tags come from
RUN_COLOUR_TAG = "mlflow.runColor"
SWEEP_TAG = "harness.sweep_id"  # the same tag as tracking.SWEEP_TAG (tracking imports this module)

# Metric names of the headline, one per slice each (``<measure>/<slice>``, so MLflow's charts group them by
# measure: one bar chart per slice, a bar per run). Points and percent, rounded as the terminal prints them.
HEADLINE_MEASURES = ("acc_delta_pt", "acc_delta_lo_pt", "acc_delta_hi_pt", "flips_right_to_wrong",
                     "flips_wrong_to_right", "acc_ref_pct", "acc_quant_pct", "kl_mean")
# The per-slice statistics of summary.json also logged, under detail/<slice>/<name> (the rest: summary.json).
DETAIL_STATS = ("n", "n_clusters", "acc_delta", "acc_delta_ci_low", "acc_delta_ci_high", "acc_delta_p_adj",
                "flip_rate", "kl_se", "kl_p99", "kl_reverse_mean", "kl_plain_mean", "kl_prompt_mean", "top1_agree",
                "ppl_ratio", "gen_identical_rate", "kl_lower_bound_mean")
# a thinking run's KL along its replies' traces and answers (harness.evaluation.thinking.kl_split_metrics); its
# trace statistics are the think_* metrics, logged whole
THINKING_DETAIL = tuple(name for part in ("trace", "answer") for name in (
    f"n_tokens_{part}", f"kl_{part}_mean", f"kl_{part}_se", f"kl_{part}_p99", f"top1_agree_{part}"))
DETAIL_QUANT = ("bits_per_weight", "bits_per_param_total", "quantized_fraction", "sqnr_db_mean", "sqnr_db_min",
                "weight_gb", "layers_quantized", "coverage_quantized_share")  # and an MoE's router_* agreement

# MLflow versions whose UI reads the saved views written here (ExperimentPageUIState, checked in its source
# and in a browser by tests/test_tracking_views.py). Another version: no view, one log line.
VIEW_FORMAT_VERSIONS = ("3.17.",)
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
HEADLINE_VIEW_KEY = "harness-headline"
REPLY_CHARS = 2000  # a reply in the per-item tables (items.parquet keeps it whole)
REVIEW_CHARS = 70  # each reply in the one-line review cell
DEFAULT_PROMPT_CHARS = 1500  # the end of each prompt (where the question is) in the per-item tables


@dataclasses.dataclass(frozen=True)
class SliceLine:
    """One row of the headline: a slice, or ``overall``."""
    name: str
    n: int
    acc_ref: float
    acc_quant: float
    delta: float
    lo: float
    hi: float
    right_to_wrong: int
    wrong_to_right: int
    kl: float | None
    kl_name: str  # kl_mean, or kl_lower_bound_mean for a served candidate's top-k bound
    label: str  # the comparison's verdict label ("worse beyond 2.0 pt")
    outcome: str  # pass | fail | inconclusive


@dataclasses.dataclass(frozen=True)
class Headline:
    overall: SliceLine
    slices: list[SliceLine]
    worst: str
    source: str  # gate | comparison
    margin: float | None

    @property
    def rows(self) -> list[SliceLine]:
        return [self.overall, *self.slices]

    def count(self, outcome: str) -> int:
        return sum(s.outcome == outcome for s in self.slices)


def outcome_of(label: str, margin: float | None) -> str:
    """A comparison verdict label as pass / fail / inconclusive.

    fail: the interval lies below −margin (``worse beyond``), or below 0 when no margin is set (``worse``);
    pass: it lies above −margin (``non-inferior``, ``equivalent``, ``better``); anything else is
    inconclusive (``inconclusive``, ``too few clusters``, ``worse`` within the margin, ``no detectable change``).
    """
    text = str(label or "")
    if text.startswith("worse beyond") or (text == "worse" and margin is None):
        return FAIL
    if text.startswith(("non-inferior", "equivalent")) or text == "better":
        return PASS
    return INCONCLUSIVE


def worst(outcomes: Sequence[str]) -> str:
    return max(outcomes, key=lambda o: SEVERITY.get(o, 1), default=INCONCLUSIVE)


def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _gate_outcomes(result_dir: Path) -> dict[str, str]:
    path = result_dir / "gate.json"
    if not path.exists():
        return {}
    try:
        gate = json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("%s is unreadable; verdict tags come from the comparison", path)
        return {}
    out: dict[str, str] = {}
    for run in gate.get("runs", []):
        for name, outcome in (run.get("slices") or {}).items():
            out[str(name)] = worst([out.get(str(name), PASS), str(outcome)]) if name in out else str(outcome)
    return out


def headline(result_dir: str | Path, summary: Mapping[str, Any]) -> Headline | None:
    """The run's outcome per slice, from item_stats.parquet (and gate.json); None without item_stats."""
    import pandas as pd

    result_dir = Path(result_dir)
    path = result_dir / "item_stats.parquet"
    if not path.exists():
        log.warning("%s has no item_stats.parquet; the MLflow run gets no verdict tags", result_dir)
        return None
    stats = pd.read_parquet(path)
    stats = stats[stats["level"].isin(["overall", "slice"])]
    metrics = summary.get("metrics") or {}
    gated = _gate_outcomes(result_dir)
    margin = None
    lines: dict[str, SliceLine] = {}
    for row in stats.to_dict("records"):
        name = "overall" if row["level"] == "overall" else str(row["slice"])
        row_margin = _finite(row.get("margin"))
        margin = margin if margin is not None else row_margin
        label = str(row.get("verdict") or "")
        outcome = gated.get(name) or outcome_of(label, row_margin)
        kl_name = "kl_mean" if f"{name}/kl_mean" in metrics else "kl_lower_bound_mean"
        lines[name] = SliceLine(
            name=name, n=int(row["n"]), acc_ref=float(row["acc_ref"]), acc_quant=float(row["acc_quant"]),
            delta=float(row["delta"]), lo=float(row["delta_ci_low"]), hi=float(row["delta_ci_high"]),
            right_to_wrong=int(row["flips_right_to_wrong"]), wrong_to_right=int(row["flips_wrong_to_right"]),
            kl=_finite(metrics.get(f"{name}/{kl_name}")), kl_name=kl_name, label=label, outcome=outcome)
    if "overall" not in lines:
        return None
    order = [str(s) for s in summary.get("slices", [])]
    slices = [lines[s] for s in order if s in lines] + [v for k, v in lines.items()
                                                         if k != "overall" and k not in order]
    judged = slices or [lines["overall"]]
    overall = lines["overall"]
    if gated and "overall" not in gated:  # the gate judges slices; the overall row takes their worst
        overall = dataclasses.replace(overall, outcome=worst([s.outcome for s in judged]))
    return Headline(overall=overall, slices=slices, worst=worst([s.outcome for s in judged]),
                    source="gate" if gated else "comparison", margin=margin)


# -- the run's name, tags and description ----------------------------------------------------------------

def outcome_text(head: Headline) -> str:
    """``FAIL 4/5``: the worst outcome and on how many of the slices."""
    judged = head.slices or [head.overall]
    return f"{head.worst.upper()} {sum(s.outcome == head.worst for s in judged)}/{len(judged)}"


def run_name(head: Headline | None, summary: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    """``<scheme> · <model> · FAIL 4/5``; a name the user chose (tracking.run_name) keeps its words first."""
    chosen = ((config.get("tracking") or {}).get("run_name")) or None
    base = chosen or f"{summary.get('scheme', '?')} · {summary.get('model', '?')}"
    if head is None:
        return str(chosen or summary.get("run_name") or base)
    return f"{base} · {outcome_text(head)}"


def verdict_tags(head: Headline | None) -> dict[str, str]:
    if head is None:
        return {}
    tags = {VERDICT_TAG: head.worst, SOURCE_TAG: head.source, RUN_COLOUR_TAG: RUN_COLOURS[head.worst]}
    tags.update({f"{VERDICT_TAG}.{s.name}": s.outcome for s in head.slices})
    return tags


def pt(value: float, digits: int = 1) -> str:
    """A fraction as signed points with a real minus sign: −0.219 -> ``−21.9``."""
    if value is None or not math.isfinite(value):
        return "n/a"
    text = f"{100 * value:+.{digits}f}"
    return text.replace("-", "−")


def interval(line: SliceLine) -> str:
    return f"{pt(line.delta)} [{pt(line.lo)}, {pt(line.hi)}]"


def reference_text(config: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    """What the reference is, from the run's config: ``smollm2_135m as loaded: <file> dequantized to float32``."""
    model = config.get("model") or {}
    name = model.get("name") or summary.get("model", "?")
    dtype = model.get("dtype") or "float32"
    source = model.get("source")
    if source == "gguf_package":
        how = f"{model.get('gguf_file') or 'the packaged GGUF file'} from {model.get('path') or 'its package'}, " \
              f"dequantized to {dtype}"
    elif source == "tiny_random":
        how = f"random weights in {dtype}"
    else:
        where = model.get("path") or name
        revision = f" @ {model['revision']}" if model.get("revision") else ""
        how = f"{where}{revision} weights in {dtype}"
    return f"{name} as loaded: {how}"


GROUP_ORDER = (FAIL, INCONCLUSIVE, PASS)


def headline_lines(head: Headline, links: Mapping[str, str] | None = None) -> list[str]:
    """The description's first lines, short enough for MLflow's collapsed description (~4 lines in 100 px):
    worst outcome and overall Δ with its interval and flips, then one line per outcome group."""
    over = head.overall
    judged = head.slices or [over]
    first = (f"**{head.worst.upper()}** on {head.count(head.worst) if head.slices else 1} of {len(judged)} "
             f"slice{'s' if len(judged) != 1 else ''} · overall Δ {interval(over)} pt · "
             f"flips {over.right_to_wrong} right→wrong, {over.wrong_to_right} wrong→right")
    if head.source == "gate":
        first += " (gate)"
    lines = [first]
    for outcome in GROUP_ORDER:  # worst Δ first; intervals where they fit on the line (two slices or fewer)
        members = sorted((s for s in head.slices if s.outcome == outcome), key=lambda s: s.delta)
        if members:
            detail = " · ".join(f"{s.name} {interval(s) if len(members) <= 2 else pt(s.delta)}" for s in members)
            lines.append(f"**{outcome}** ({len(members)}): {detail} pt")
    if links:
        lines.append(" · ".join(f"[{text}]({href})" for text, href in links.items()))
    return lines


# -- metrics --------------------------------------------------------------------------------------------

def headline_metrics(head: Headline) -> list[tuple[str, float]]:
    """The fixed headline set per slice (and overall), measure by measure, in points and rounded."""
    values = {
        "acc_delta_pt": lambda s: round(100 * s.delta, 1),
        "acc_delta_lo_pt": lambda s: round(100 * s.lo, 1),
        "acc_delta_hi_pt": lambda s: round(100 * s.hi, 1),
        "flips_right_to_wrong": lambda s: float(s.right_to_wrong),
        "flips_wrong_to_right": lambda s: float(s.wrong_to_right),
        "acc_ref_pct": lambda s: round(100 * s.acc_ref, 1),
        "acc_quant_pct": lambda s: round(100 * s.acc_quant, 1),
    }
    out: list[tuple[str, float]] = []
    for measure in HEADLINE_MEASURES:
        for line in head.rows:
            if measure == "kl_mean":
                if line.kl is not None:
                    out.append((f"{line.kl_name}/{line.name}", round(line.kl, 4)))
                continue
            value = values[measure](line)
            if math.isfinite(value):
                out.append((f"{measure}/{line.name}", value))
    return out


def detail_metrics(summary: Mapping[str, Any], *, everything: bool = False) -> dict[str, float]:
    """Metrics under ``detail/``: the per-slice statistics of :data:`DETAIL_STATS`, the scheme's size, stage times,
    memory and throughput (all of summary.json's ``metrics`` with ``everything``, as in tracking.all_metrics)."""
    out: dict[str, float] = {}
    for key, value in (summary.get("metrics") or {}).items():
        name, _, stat = str(key).rpartition("/")
        number = _finite(value)
        if number is not None and (everything or stat in DETAIL_STATS or stat.startswith("po_")  # po_: your prompts
                                  or stat.startswith("think_") or stat in THINKING_DETAIL
                                  or stat.startswith("judge_")):  # judge_: the pairwise judge
            out[f"detail/{key}"] = number
    for key, value in (summary.get("quant") or {}).items():
        number = _finite(value) if not isinstance(value, bool) else None
        if number is not None and (everything or key in DETAIL_QUANT or key.startswith("router_")):
            out[f"detail/quant/{key}"] = number
    for key, value in (summary.get("timings") or {}).items():
        number = _finite(value) if not isinstance(value, bool) else None
        if number is not None:
            out[f"detail/time/{key}"] = number
    return out


# -- the forest plot ------------------------------------------------------------------------------------

def forest_image(head: Headline, title: str) -> Any:
    """Δ per slice with its interval as a PIL image: markers coloured by outcome, the margin shaded."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from PIL import Image

    rows = head.rows
    fig = Figure(figsize=(7.5, 0.42 * len(rows) + 1.3), dpi=100)
    ax = fig.add_subplot()
    for y, line in enumerate(rows):
        centre, low, high = 100 * line.delta, 100 * line.lo, 100 * line.hi
        colour = RUN_COLOURS.get(line.outcome, "grey")
        ax.errorbar(centre, -y, xerr=[[max(0.0, centre - low)], [max(0.0, high - centre)]], fmt="o", color=colour,
                    capsize=3, markersize=6 if line.name == "overall" else 5)
        ax.annotate(f"{pt(line.delta)} [{pt(line.lo)}, {pt(line.hi)}] · {line.outcome}", (high, -y),
                    xytext=(6, -3), textcoords="offset points", fontsize=7)
    ax.axvline(0, color="black", linewidth=0.8)
    if head.margin:
        ax.axvspan(-100 * head.margin, 100 * head.margin, color="tab:green", alpha=0.12,
                   label=f"±margin ({100 * head.margin:g} pt)")
        ax.legend(loc="lower left", fontsize=7)
    ax.set_yticks([-y for y in range(len(rows))], [line.name for line in rows], fontsize=8)
    ax.set_xlabel("Δ accuracy, points (quantized − reference), 95 % clustered interval", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    left, right = ax.get_xlim()
    ax.set_xlim(left, right + 0.35 * (right - left))  # room for the labels
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    buffer.seek(0)
    with Image.open(buffer) as image:
        return image.convert("RGB")


# -- per-item tables ------------------------------------------------------------------------------------

def _one_line(text: Any, limit: int) -> str:
    flat = " ".join(str(text if text is not None else "").split())
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def _tail(text: Any, limit: int) -> str:
    text = str(text if text is not None else "")
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def _review(ref: float, quant: float, reply_quant: Any, reply_ref: Any) -> str:
    right_ref, right_quant = ref >= 0.5, quant >= 0.5
    mark = ("✗ right→wrong" if right_ref and not right_quant else "✓ wrong→right" if right_quant and not right_ref
            else "= both right" if right_ref else "= both wrong")
    return (f"{mark} | quant: {_one_line(reply_quant, REVIEW_CHARS)} | ref: {_one_line(reply_ref, REVIEW_CHARS)}")


def review_tables(items: pd.DataFrame, *, prompt_chars: int = DEFAULT_PROMPT_CHARS
                  ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(items, flips) for ``mlflow.log_table``: item, a one-line review cell, slice, target, both correctness
    values, both replies and the end of the prompt (``prompt_chars`` characters; 0: no prompt column).
    Flips: the items whose correctness differs, right→wrong first."""
    import pandas as pd

    ref = items["correct_ref"].astype(float)
    quant = items["correct_quant"].astype(float)
    table = pd.DataFrame({
        "item": items["item_id"].astype(str),
        "review": [_review(r, q, a, b) for r, q, a, b in zip(ref, quant, items.get("response_quant", ""),
                                                              items.get("response_ref", ""))],
        "slice": items["slice"].astype(str),
        "target": items["target"].astype(str).map(lambda t: _one_line(t, 300)) if "target" in items else "",
        "correct_ref": ref,
        "correct_quant": quant,
        "reply_quant": items.get("response_quant", pd.Series([""] * len(items))).map(lambda t: _tail(t, REPLY_CHARS)),
        "reply_ref": items.get("response_ref", pd.Series([""] * len(items))).map(lambda t: _tail(t, REPLY_CHARS)),
    })
    if prompt_chars > 0 and "prompt" in items:
        table["prompt"] = items["prompt"].map(lambda t: _tail(t, prompt_chars))
    flipped = table[(ref >= 0.5) != (quant >= 0.5)]
    lost = flipped["correct_ref"] >= 0.5
    flips = pd.concat([flipped[lost], flipped[~lost]]).reset_index(drop=True)
    return table.reset_index(drop=True), flips


# -- saved views of the run list -------------------------------------------------------------------------

def views_supported(version: str | None = None) -> bool:
    if version is None:
        import mlflow
        version = mlflow.__version__
    return str(version).startswith(VIEW_FORMAT_VERSIONS)


def sweep_view_key(sweep_id: str) -> str:
    return f"harness-sweep-{hashlib.sha256(sweep_id.encode()).hexdigest()[:12]}"


def _columns(slices: Sequence[str]) -> dict[str, list[str]]:
    rows = ["overall", *slices]
    return {"verdict": [f"tags.`{VERDICT_TAG}`"] + [f"tags.`{VERDICT_TAG}.{s}`" for s in slices],
            "delta": [f"metrics.`acc_delta_pt/{s}`" for s in rows],
            "flips": [f"metrics.`flips_right_to_wrong/{s}`" for s in rows]
            + ["metrics.`flips_wrong_to_right/overall`"],
            "size": ["metrics.`detail/quant/bits_per_weight`"]}  # what a scheme buys, beside what it costs


def view_state(slices: Sequence[str], sweep_id: str | None = None) -> dict[str, Any]:
    """The run list's UI state of the Headline view (fields of MLflow 3.17's ExperimentPageUIState and its
    search facets): verdict columns first, then Δ per slice, then flips, then bits per weight; bar charts of Δ
    per slice first."""
    columns = _columns(slices)
    selected = [*columns["verdict"], *columns["delta"], *columns["flips"], *columns["size"]]
    widths = {c: (118 if c.startswith("tags.") else 150) for c in selected}
    section = "harness-headline-delta"
    charts = [{"uuid": f"harness-delta-{i}", "type": "BAR", "runsCountToCompare": 20, "metricSectionId": section,
               "deleted": False, "isGenerated": False, "metricKey": f"acc_delta_pt/{name}",
               "displayName": f"Δ accuracy, pt · {name}"} for i, name in enumerate(["overall", *slices])]
    return {
        "selectedColumns": selected,
        "columnOrder": ["attributes.`Run Name`", *selected],
        "columnWidths": {"attributes.`Run Name`": 300, **widths},
        "compareRunCharts": charts,
        "compareRunSections": [{"uuid": section, "name": "Headline: Δ accuracy per slice (points)", "display": True,
                                "isReordered": False, "deleted": False, "isGenerated": False}],
        "isAccordionReordered": True,
        "hideEmptyCharts": True,
        "runListHidden": False,
        "viewMaximized": False,
        "searchFilter": f"tags.`{SWEEP_TAG}` = '{sweep_id}'" if sweep_id else "",
        "orderByKey": "attributes.start_time",
        "orderByAsc": False,
    }


def _slices_of(state: Mapping[str, Any]) -> list[str]:
    prefix = f"tags.`{VERDICT_TAG}."
    return [c[len(prefix):-1] for c in state.get("selectedColumns", []) if c.startswith(prefix)]


def _envelope(name: str, state: Mapping[str, Any], created: int) -> str:
    return json.dumps({"name": name, "createdAt": created, "updatedAt": int(time.time() * 1000),
                       "state": json.dumps(state)})


def _write_view(client: Any, experiment_id: str, key: str, name: str, slices: Sequence[str],
                sweep_id: str | None) -> None:
    """Write (or widen) one saved view: the slices already in it stay, new ones are added after them."""
    tag = f"{VIEW_TAG_PREFIX}{key}"
    old = client.get_experiment(experiment_id).tags.get(tag)
    known: list[str] = []
    created = int(time.time() * 1000)
    if old:
        try:
            envelope = json.loads(old)
            known = _slices_of(json.loads(envelope["state"]))
            created = int(envelope.get("createdAt") or created)
        except (ValueError, KeyError, TypeError):
            known = []
    merged = list(dict.fromkeys([*known, *slices]))
    value = _envelope(name, view_state(merged, sweep_id), created)
    if value != old:
        client.set_experiment_tag(experiment_id, tag, value)


def view_path(experiment_id: str, key: str, mode: str | None = None) -> str:
    """The hash route of a saved view (relative: it works from any MLflow UI address)."""
    query = {"viewStateShareKey": key, "workflowType": "machine_learning"}
    if mode:
        query["compareRunsMode"] = mode
    return f"#/experiments/{experiment_id}/runs?{urllib.parse.urlencode(query)}"


def view_keys(sweep_id: str | None) -> dict[str, str]:
    """{key: name} of the views a run of this sweep belongs to."""
    keys = {HEADLINE_VIEW_KEY: "Headline (quant-harness)"}
    if sweep_id:
        keys[sweep_view_key(sweep_id)] = f"Headline · sweep {sweep_id}"[:200]
    return keys


def write_views(client: Any, experiment_id: str, slices: Sequence[str], sweep_id: str | None = None
                ) -> dict[str, str]:
    """Write the Headline view (and this sweep's) as experiment tags; returns {key: relative link}.

    Never raises: an MLflow whose UI format is unknown here, or a failure, logs one line and returns {}."""
    import mlflow

    if not views_supported():
        log.info("MLflow %s: its run-list view format is known here for %s only; no Headline view written",
                 mlflow.__version__, ", ".join(v.rstrip(".") for v in VIEW_FORMAT_VERSIONS))
        return {}
    try:
        out = {}
        for key, name in view_keys(sweep_id).items():
            _write_view(client, experiment_id, key, name, slices,
                        sweep_id if key != HEADLINE_VIEW_KEY else None)
            out[key] = view_path(experiment_id, key)
        return out
    except Exception as exc:  # a view is a convenience: never fail the logging for it
        log.warning("MLflow Headline view not written (%s: %s)", type(exc).__name__, exc)
        return {}


def absolute(uri: str, path: str) -> str:
    """A relative UI link made absolute for a terminal: the server's address, or ``mlflow ui``'s default."""
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return f"{base}/{path}"
