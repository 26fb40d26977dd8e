"""MLflow logging, fed from a finished results directory (the source of truth).

A run is logged only once its results are complete on disk, so a job killed mid-way
never leaves a half-logged MLflow run, and a job whose tracking server was down is
logged later by ``python -m harness.sync`` with the very same function. Logging is
idempotent: a finished MLflow run tagged with the same run key is reused, never duplicated.

What a reviewer sees in the MLflow UI (3.17): each run spans the job's own start and end
(:func:`job_times`); each slice is a dataset input, so the Dataset column reads
``math (<digest>)`` (:func:`slice_datasets`); the experiment is tagged for the classic runs
view. MLflow 3.17's UI picks its GenAI or "Model training" view from a global switch (the
``workflowType`` URL parameter, else the browser's last choice, GenAI by default), so the
links logged here (:func:`experiment_url`) carry ``workflowType=machine_learning``.

Where a reviewer lands, the run page, says the answer first (:mod:`harness.results.mlflow_views`):
the run's name carries scheme, model and outcome (``int4_g128 · smollm2_135m · FAIL 4/5``), its tags
``verdict`` / ``verdict.<slice>`` and colour the outcome, its description (:func:`run_description`,
the ``mlflow.note.content`` tag) opens with four short lines (worst outcome, overall Δ, flips, one line
per outcome group) above the terminal table and the gate's rows, and its metrics open with a fixed
headline set per slice in points (``acc_delta_pt/<slice>``, ...), the rest under ``detail/``. The
forest plot is an image of the run; ``items`` and ``flips`` are tables of it (MLflow's "Artifact
evaluation" view). The experiment's description (:data:`EXPERIMENT_DESCRIPTION`) says what a run is,
and its saved "Headline" views (one per sweep) put runs side by side.

A sweep's runs share the tag ``harness.sweep_id`` (see :mod:`harness.job.sweep`); there is no
parent run: a sweep's jobs are independent processes (Slurm jobs, possibly on several machines) that
finish in any order, and none of them knows it is the last, so a parent created by the first to finish
would race with the others and hold a comparison made before the sweep ended. The sweep's side-by-side
is its saved view instead (each run's description links to it), and ``python -m harness.compare
sweep=<id>`` logs the sweep's comparison as a run of its own (``harness.kind=comparison``). To group
runs: *Group by* -> ``harness.sweep_id`` in the runs table; to see one sweep: the link logged with each
of its runs, or the filter ``tags.`harness.sweep_id` = '<id>'``.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from harness.errors import TrackingError  # noqa: F401  (raised by callers as tracking.TrackingError)

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

RUN_KEY_TAG = "harness.run_key"
SWEEP_TAG = "harness.sweep_id"
# MLflow 3 UI: which page an experiment opens on; this value is the classic runs table.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
CLASSIC_EXPERIMENT_KIND = "custom_model_development"
NOTE_TAG = "mlflow.note.content"  # the description of a run or experiment in the UI (Markdown)
MAX_NOTE_CHARS = 8000  # MLflow's limit on a run tag's value
EXPERIMENT_DESCRIPTION = (
    "Each run is one job of the quant-harness: a quantized model (the run's `scheme` tag) against its reference "
    "(`model` as the job loaded it: a hub model's own weights, or a packaged GGUF file dequantized to float32; "
    "each run's description says which), on the same items of each slice (`slices`; the Dataset column gives "
    "each slice's item digest). A run's name ends with its outcome (FAIL 4/5: fail on 4 of 5 slices); its tags "
    "`verdict` and `verdict.<slice>` say pass / fail / inconclusive per slice. Open a run: its description starts "
    "with the outcome, the overall Δ and the flips, then holds the terminal's per-slice table; its metrics start "
    "with Δ per slice in points (`acc_delta_pt/<slice>`); the tables items.json and flips.json hold every item "
    "with both replies. The Views menu's Headline view puts runs side by side. Runs of one sweep share the tag "
    "`harness.sweep_id` (Group by it).")


def resolve_uri(uri: str | None) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else an SQLite file in the working directory."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def check_tracking(uri: str, timeout: float = 5.0) -> str | None:
    """None when the store looks usable, else a message naming the problem and the fix."""
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as response:
                if response.status == 200:
                    return None
                return f"MLflow server {uri} answered HTTP {response.status} on /health"
        except (urllib.error.URLError, OSError) as exc:
            return (f"MLflow tracking server {uri} is unreachable ({exc}). Results stay in results/; "
                    f"log them later with `python -m harness.sync <results dir>` once the server is up")
    if uri.startswith("sqlite:///"):
        directory = Path(uri[len("sqlite:///"):]).expanduser().resolve().parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass
        if not os.access(directory, os.W_OK):
            return f"cannot write the MLflow database in {directory}; set tracking.uri or MLFLOW_TRACKING_URI"
    return None


def _flatten(prefix: str, obj: Any, out: dict[str, str]) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), value, out)
    else:
        out[prefix] = json.dumps(obj) if isinstance(obj, (list, tuple)) else str(obj)


def flatten_config(config: dict) -> dict[str, str]:
    out: dict[str, str] = {}
    _flatten("", config, out)
    return {k[:250]: v[:6000] for k, v in out.items()}


def ensure_experiment(client: Any, name: str) -> str:
    """The id of experiment ``name``, created when missing, marked for MLflow's classic run view.

    MLflow 3's UI opens an experiment by its ``mlflow.experimentKind`` tag; without one it may
    guess "GenAI apps & agents" and open the traces overview, where none of the harness's
    runs, metrics or datasets show. An existing experiment without the tag gets it; one whose
    kind someone chose (in the UI or by tag) is left alone.
    """
    exp = client.get_experiment_by_name(name)
    if exp is None:
        return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: CLASSIC_EXPERIMENT_KIND,
                                                    NOTE_TAG: EXPERIMENT_DESCRIPTION})
    if EXPERIMENT_KIND_TAG not in exp.tags:
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, CLASSIC_EXPERIMENT_KIND)
    if NOTE_TAG not in exp.tags:  # a description someone wrote is theirs
        client.set_experiment_tag(exp.experiment_id, NOTE_TAG, EXPERIMENT_DESCRIPTION)
    return exp.experiment_id


def _first_table(markdown: str) -> str:
    """The first Markdown table of ``markdown`` (report.md's first is the terminal table)."""
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        return ""
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(line.rstrip() for line in lines[start:end])


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def gate_markdown(gate: Mapping[str, Any]) -> str:
    """gate.json as a headline and one row per slice and criterion."""
    lines = [f"**Gate: {gate.get('outcome', '?')}** (exit code {gate.get('exit_code', '?')})", ""]
    rows = [c for run in gate.get("runs", []) for c in run.get("criteria", [])]
    if rows:
        lines += ["| slice | criterion | outcome | why |", "|:--|:--|:--|:--|"]
        lines += [f"| {_cell(c.get('slice', ''))} | {_cell(c.get('criterion', ''))} | {_cell(c.get('outcome', ''))} "
                  f"| {_cell(c.get('message', ''))} |" for c in rows]
    return "\n".join(lines)


_AUTO: Any = object()


def run_description(result_dir: Path, summary: Mapping[str, Any], config: Mapping[str, Any] | None = None, *,
                    head: Any = _AUTO, links: Mapping[str, str] | None = None) -> str:
    """The run page's description (Markdown): the answer first, then what was compared, the terminal table
    and the gate's outcome.

    The first lines (:func:`harness.results.mlflow_views.headline_lines`: worst outcome, overall Δ, flips, one
    line per outcome group, then ``links``) fit what MLflow shows before "Show more". Read from the results
    directory (item_stats.parquet, report.md, gate.json, config.json), so ``harness.results.sync`` writes the
    same one later. Within MLflow's 8,000 characters: the gate's rows are dropped first, then the table's.
    """
    from harness.results import mlflow_views

    result_dir = Path(result_dir)
    if config is None:
        path = result_dir / "config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
    if head is _AUTO:
        head = mlflow_views.headline(result_dir, summary)
    # the job's own phrase when summary.json has one, else read from the config the same way
    reference = summary.get("reference") or f"the reference ({mlflow_views.reference_text(config, summary)})"
    quant = summary.get("quant", {})
    bits = quant.get("bits_per_weight")
    what = (f"**{summary.get('model', '?')} · {summary.get('scheme', '?')}**"
            + (f" ({float(bits):.3f} bits/weight)" if isinstance(bits, (int, float)) else "")
            + (f" — {float(quant['coverage_uncovered_share']):.1%} of matrix weights NOT COVERED"
               if float(quant.get("coverage_uncovered_share") or 0) > 0 else "")
            + f" vs {reference}; run key `{summary.get('run_key', '')}`")
    first = "  \n".join(mlflow_views.headline_lines(head, links)) if head is not None else ""
    report = result_dir / "report.md"
    table = _first_table(report.read_text()) if report.exists() else ""
    gate_path = result_dir / "gate.json"
    gate = gate_markdown(json.loads(gate_path.read_text())) if gate_path.exists() else ""
    foot = ("Details under Artifacts: report.md (sub-slices, generation, KL by position), items.json and flips.json "
            "(every item, both replies), job.log (every message).")
    from harness.results.report import sequential_lines
    stops = sequential_lines(dict(summary))  # a sequential run: where each slice stopped and why
    if stops:
        what += "\n\n" + "\n".join(f"- {line.strip()}" for line in stops)

    def joined() -> str:
        return "\n\n".join(p for p in [first, what, table, gate, foot] if p)

    text = joined()
    while len(text) > MAX_NOTE_CHARS and (gate or table):
        if gate:
            gate = "\n".join(gate.splitlines()[:-1]) if len(gate.splitlines()) > 3 else ""
        else:
            table = "\n".join(table.splitlines()[:-1]) if len(table.splitlines()) > 3 else ""
        text = joined()
    return text[:MAX_NOTE_CHARS]


# Stages of run.py's timings that end after ``finished_at`` is stamped; ``model_*`` entries
# are sub-timings of the ``load`` stage (counted there).
_AFTER_FINISH = ("write", "logging")


def _epoch_seconds(value: Any) -> float | None:
    """Epoch seconds from a number, a numeric string or an ISO-8601 time; None when unusable."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                stamp = datetime.datetime.fromisoformat(text)
            except ValueError:
                return None
            if stamp.tzinfo is None:  # a naive time is the machine's local time, as time.strftime wrote it
                stamp = stamp.astimezone()
            seconds = stamp.timestamp()
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def job_times(summary: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(start, end) of the job in epoch seconds, read from its summary; None where unknown.

    Preferred: ``started_at`` and ``ended_at`` (epoch seconds, or ISO-8601 strings), written by
    the job itself. Older summaries have only ``finished_at`` (stamped just before the results
    are written, one-second resolution) and the stage durations in ``timings``: the start is
    ``finished_at`` less the stages that ran before it, the end ``finished_at`` plus ``write``.
    A start after the end is discarded. MLflow falls back to the logging time for a None.
    """
    timings = {k: float(v) for k, v in (summary.get("timings") or {}).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0}
    before = sum(v for k, v in timings.items() if not k.startswith("model_") and k not in _AFTER_FINISH)
    finished = _epoch_seconds(summary.get("finished_at"))
    start = _epoch_seconds(summary.get("started_at"))
    end = _epoch_seconds(summary.get("ended_at"))
    if end is None and finished is not None:
        end = finished + timings.get("write", 0.0)
    if start is None and finished is not None and timings:
        start = finished - before
    if end is None and start is not None and timings:
        end = start + before + timings.get("write", 0.0)
    if start is not None and end is not None and start > end:
        log.warning("summary's start time %.0f is after its end %.0f; logging the end only", start, end)
        start = None
    return start, end


# Columns of items.parquet that say which items a slice holds (not how a model did on them).
_ITEM_COLUMNS = ("item_id", "task", "sub_slice", "cluster", "target")


def slice_digest(items: pd.DataFrame) -> str:
    """What a slice evaluated, in 16 hex digits: SHA-256 of its sorted ``item_id<TAB>target`` lines.

    Independent of row order and of the models' answers, so two runs on the same items show
    the same digest in MLflow's Dataset column, and a changed item or answer key a new one.
    """
    import hashlib

    targets = items["target"].astype(str) if "target" in items else [""] * len(items)
    lines = sorted(f"{item}\t{target}" for item, target in zip(items["item_id"].astype(str), targets))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def slice_datasets(result_dir: Path, slices: list[str], artifact_uri: str) -> list[Any]:
    """One MLflow dataset input per slice: name, :func:`slice_digest`, size, item schema.

    Read from the results' ``items.parquet`` (its source points at the run's copy of it);
    results without one (written before it existed) log no datasets, with a warning.
    """
    import pandas as pd
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    path = result_dir / "items.parquet"
    if not path.exists():
        log.warning("%s has no items.parquet; its slices are not logged as MLflow datasets", result_dir)
        return []
    import pyarrow.parquet as pq

    present = set(pq.read_schema(path).names)
    columns = [c for c in _ITEM_COLUMNS if c in present]
    items = pd.read_parquet(path, columns=columns + (["slice"] if "slice" in present else []))
    inputs = []
    for name in slices:
        rows = items.loc[items["slice"] == name, columns] if "slice" in items else items.iloc[0:0]
        if rows.empty:
            log.warning("slice %s has no items in %s; not logged as an MLflow dataset", name, path)
            continue
        profile = {"num_rows": len(rows), "num_elements": int(rows.size)}
        for column in ("task", "sub_slice", "cluster"):
            if column in rows:
                profile[f"num_{column}s"] = int(rows[column].nunique())
        schema = {"mlflow_colspec": [{"type": "string", "name": c, "required": True} for c in columns]}
        source = {"uri": f"{artifact_uri.rstrip('/')}/items.parquet", "filter": f"slice == '{name}'"}
        dataset = Dataset(name=name, digest=slice_digest(rows), source_type="harness_results",
                          source=json.dumps(source), schema=json.dumps(schema), profile=json.dumps(profile))
        inputs.append(DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, "eval")]))
    return inputs


def log_tool_run(directory: Path, *, uri: str | None, experiment: str, kind: str, run_name: str,
                 tags: Mapping[str, str], params: Mapping[str, Any], metrics: Mapping[str, float]) -> str | None:
    """Log an auxiliary tool's finished output (``directory``) as one MLflow run tagged ``harness.kind``.

    The files on disk are the result: an unreachable store or a logging failure is a warning, never an
    error. Returns the run id, or None when nothing was logged.
    """
    resolved = resolve_uri(uri)
    problem = check_tracking(resolved)
    if problem:
        log.warning("%s not logged to MLflow: %s", kind, problem)
        return None
    try:
        import mlflow
        from mlflow.tracking import MlflowClient

        mlflow.set_tracking_uri(resolved)
        experiment_id = ensure_experiment(MlflowClient(tracking_uri=resolved), experiment)
        with mlflow.start_run(experiment_id=experiment_id, run_name=run_name,
                              tags={"harness.kind": kind, **{k: str(v) for k, v in tags.items()}}) as run:
            mlflow.log_params(dict(params))
            mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
            mlflow.log_artifacts(str(directory))
            return run.info.run_id
    except Exception as exc:  # a finished result on disk must survive a tracking failure
        log.warning("%s MLflow logging failed (%s: %s); results are in %s", kind, type(exc).__name__, exc, directory)
        return None


def experiment_url(uri: str, experiment_id: str, sweep_id: str | None = None) -> str:
    """The runs table of an experiment in the MLflow UI, in its classic view (one sweep with ``sweep_id``).

    For a store that is not a server (an SQLite file), the address ``mlflow ui
    --backend-store-uri <uri>`` serves by default.
    """
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    query = {"workflowType": "machine_learning"}
    if sweep_id:
        query["searchFilter"] = f"tags.`{SWEEP_TAG}` = '{sweep_id}'"
    return f"{base}/#/experiments/{experiment_id}/runs?{urllib.parse.urlencode(query, quote_via=urllib.parse.quote)}"


def find_finished_run(client: Any, experiment_id: str, run_key: str, sweep_id: str | None = None) -> str | None:
    """A finished run of this config; with ``sweep_id``, only one logged for that sweep."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'",
                              max_results=100)
    for run in runs:
        if run.info.status == "FINISHED" and (sweep_id is None or run.data.tags.get(SWEEP_TAG) == sweep_id):
            return run.info.run_id
    return None


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """One writer at a time on an SQLite store shared by a sweep's parallel jobs.

    MLflow creates an SQLite store's tables on first use, and two jobs doing it at once
    fail (an alembic migration race); a tracking server serialises this itself.
    """
    if not uri.startswith("sqlite:///"):
        yield
        return
    from filelock import FileLock

    path = Path(uri[len("sqlite:///"):]).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        yield


def log_results(result_dir: str | os.PathLike, *, uri: str, experiment: str,
                tags: Mapping[str, str] | None = None) -> str:
    """Log one results directory to MLflow (see :func:`_log_results`); returns the run id."""
    with store_lock(uri):
        return _log_results(result_dir, uri=uri, experiment=experiment, tags=tags)


def review_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``tracking`` options of a run's config.json that shape its MLflow run (defaults for older configs).

    ``review_tables`` (True): log the ``items`` and ``flips`` tables; ``table_prompt_chars`` (1500): how much
    of each prompt's end they show (0: no prompt text in MLflow); ``all_metrics`` (False): also log every
    number of summary.json's ``metrics`` under ``detail/``.
    """
    section = config.get("tracking") or {}
    try:
        prompt_chars = max(0, int(section.get("table_prompt_chars", 1500)))
    except (TypeError, ValueError):
        prompt_chars = 1500
    return {"review_tables": bool(section.get("review_tables", True)), "table_prompt_chars": prompt_chars,
            "all_metrics": bool(section.get("all_metrics", False))}


TEXT_COLUMNS = ("prompt", "response_ref", "response_quant", "target")  # items.parquet's text


def private_slices(config: Mapping[str, Any]) -> set[str]:
    """The slices of a run whose prompt and reply text must not reach MLflow: prompt logs, unless
    ``prompts.log_text``."""
    from harness.evaluation.prompt_log import TASK

    if (config.get("prompts") or {}).get("log_text"):
        return set()
    return {name for name, settings in (config.get("slices") or {}).items()
            if TASK in ((settings or {}).get("tasks") or [])}


def redacted_items(items: Any, private: set[str]) -> Any:
    """``items`` with the text of the ``private`` slices' rows replaced by its hash (``sha256:<16 hex>``; empty stays
    empty), so that a reviewer can still see which replies are identical."""
    from harness.evaluation.prompt_log import content_hash

    out = items.copy()
    rows = out["slice"].astype(str).isin(private)
    for column in TEXT_COLUMNS:
        if column in out:
            out[column] = out[column].astype(object)
            out.loc[rows, column] = [f"sha256:{content_hash(str(text))}" if str(text) else ""
                                     for text in out.loc[rows, column]]
    return out


@contextlib.contextmanager
def shown_results(result_dir: Path, private: set[str]) -> Iterator[Path]:
    """The results directory as MLflow may see it: itself, or (with ``private`` slices) a copy whose items.parquet
    holds hashes in place of their text (every other file holds no item text: tests/test_prompts_slice.py)."""
    if not private or not (result_dir / "items.parquet").exists():
        yield result_dir
        return
    import shutil
    import tempfile

    import pandas as pd

    with tempfile.TemporaryDirectory(prefix="harness-redacted-") as temporary:
        shown = Path(temporary) / result_dir.name
        shutil.copytree(result_dir, shown, ignore=shutil.ignore_patterns("items.parquet"))
        redacted_items(pd.read_parquet(result_dir / "items.parquet"), private).to_parquet(shown / "items.parquet",
                                                                                           index=False)
        log.info("prompt and reply text of %s not logged to MLflow (hashes instead; prompts.log_text=true logs it)",
                 ", ".join(sorted(private)))
        yield shown


def _review_artifacts(client: Any, run_id: str, result_dir: Path, head: Any, options: Mapping[str, Any],
                      title: str, stamp: int) -> None:
    """The forest plot as an image of the run, and the per-item tables; each a warning when it fails."""
    from harness.results import mlflow_views

    if head is not None:
        try:
            client.log_image(run_id, mlflow_views.forest_image(head, title), key="acc_delta/forest", step=0,
                             timestamp=stamp)
        except Exception as exc:
            log.warning("forest plot not logged to MLflow (%s: %s)", type(exc).__name__, exc)
    path = result_dir / "items.parquet"
    if not options["review_tables"] or not path.exists():
        return
    try:
        import pandas as pd

        items, flips = mlflow_views.review_tables(pd.read_parquet(path), prompt_chars=options["table_prompt_chars"])
        client.log_table(run_id, data=flips, artifact_file="flips.json")
        client.log_table(run_id, data=items, artifact_file="items.json")
    except Exception as exc:
        log.warning("per-item tables not logged to MLflow (%s: %s)", type(exc).__name__, exc)


def _log_results(result_dir: str | os.PathLike, *, uri: str, experiment: str,
                 tags: Mapping[str, str] | None = None) -> str:
    """Log one results directory to MLflow; returns the run id (existing or new).

    ``tags`` override the tags saved with the results: a later sweep that reuses a finished
    config passes its own ``harness.sweep_id`` and gets a run in its sweep (results logged
    from the same directory, not recomputed). Within one sweep, a config is logged once.
    The run carries the job's own start and end times (:func:`job_times`), not the moment
    it was logged, so its duration is the job's. Its name, verdict tags, description, headline
    metrics, forest plot and tables follow :mod:`harness.results.mlflow_views`; the experiment's
    saved Headline views are (re)written after it.
    """
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient
    from mlflow.tracking.context.registry import resolve_tags

    from harness.results import mlflow_views

    result_dir = Path(result_dir)
    summary = json.loads((result_dir / "summary.json").read_text())
    config = json.loads((result_dir / "config.json").read_text())
    client = MlflowClient(tracking_uri=uri)
    experiment_id = ensure_experiment(client, experiment)
    tags = {RUN_KEY_TAG: summary["run_key"], "model": summary["model"], "scheme": summary["scheme"],
            "slices": ",".join(summary["slices"]), "method": summary.get("method", ""),
            **{k: str(v) for k, v in summary.get("tags", {}).items()},
            **{k: str(v) for k, v in (tags or {}).items()}}
    sweep_id = tags.get(SWEEP_TAG)
    existing = find_finished_run(client, experiment_id, summary["run_key"], sweep_id)
    if existing:
        log.info("MLflow already has finished run %s for this config; not logging twice", existing)
        return existing
    options = review_options(config)
    head = mlflow_views.headline(result_dir, summary)
    links: dict[str, str] = {}
    if head is not None and mlflow_views.views_supported():
        key = mlflow_views.sweep_view_key(sweep_id) if sweep_id else mlflow_views.HEADLINE_VIEW_KEY
        links["side by side" + (" (this sweep)" if sweep_id else "")] = mlflow_views.view_path(experiment_id, key)
        if options["review_tables"]:
            links["per item"] = mlflow_views.view_path(experiment_id, key, mode="ARTIFACT")
    started, ended = job_times(summary)
    end_ms = None if ended is None else int(round(ended * 1000))
    start_ms = end_ms if started is None else int(round(started * 1000))  # unknown start: at least the date
    note = run_description(result_dir, summary, config, head=head, links=links)
    name = mlflow_views.run_name(head, summary, config)
    run = client.create_run(experiment_id, start_time=start_ms, run_name=name,
                            tags=resolve_tags({**tags, **mlflow_views.verdict_tags(head), NOTE_TAG: note}))
    run_id = run.info.run_id
    try:
        params = [Param(k, v) for k, v in flatten_config(config).items()]
        # an external candidate's scheme as read from its checkpoint (bits, groups, format, kept)
        described = {f"{k}.described": str(v)[:500] for k, v in summary.get("candidate", {}).items()}
        params += [Param(k, v) for k, v in described.items()]
        stamp = end_ms if end_ms is not None else int(time.time() * 1000)
        first = [Metric(k, v, stamp, 0) for k, v in mlflow_views.headline_metrics(head)] if head is not None else []
        # results without a headline (no item_stats.parquet) keep every number, under detail/
        metrics = mlflow_views.detail_metrics(summary, everything=options["all_metrics"] or head is None)
        metrics.update({f"detail/{k}": v for k, v in flat_metrics(summary).items()})  # memory, tokens/s per stage
        rows = []
        for slice_name, record in (summary.get("sequential") or {}).items():  # eval.sequential: the stop, the path
            metrics.update({f"detail/{slice_name}/sequential_{key}": float(record[key])
                            for key in ("items_used", "items_total", "clusters_used", "rounds_used")})
            rows += [Metric(f"detail/{slice_name}/sequence_{key}", float(point[key]), stamp, int(point["items"]))
                     for point in record["trajectory"] for key in ("delta", "lower", "upper")]  # step = items used
        rows += [Metric(k, v, stamp, 0) for k, v in metrics.items()]
        for begin in range(0, len(params), 100):
            client.log_batch(run_id, params=params[begin:begin + 100])
        if first:  # the run page lists metrics in the order they were logged: the headline first
            client.log_batch(run_id, metrics=first)
        for begin in range(0, len(rows), 1000):
            client.log_batch(run_id, metrics=rows[begin:begin + 1000])
        client.log_inputs(run_id, datasets=slice_datasets(result_dir, list(summary["slices"]),
                                                          run.info.artifact_uri))
        with shown_results(result_dir, private_slices(config)) as shown:  # a prompt log's text stays local
            client.log_artifacts(run_id, str(shown))
            _review_artifacts(client, run_id, shown, head, options, f"{name}: Δ accuracy per slice", stamp)
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED", end_time=end_ms)
    where = "" if uri.startswith(("http://", "https://")) else f" (after `mlflow ui --backend-store-uri {uri}`)"
    log.info("MLflow runs table%s: %s", where, experiment_url(uri, experiment_id, sweep_id))
    if head is not None:
        views = mlflow_views.write_views(client, experiment_id, [s.name for s in head.slices], sweep_id)
        key = mlflow_views.sweep_view_key(sweep_id) if sweep_id else mlflow_views.HEADLINE_VIEW_KEY
        if key in views:
            log.info("MLflow headline view%s: %s", where, mlflow_views.absolute(uri, views[key]))
    return run_id


def headline_link(uri: str | None, experiment: str, sweep: str | None = None) -> str | None:
    """The Headline view of ``experiment`` (of one sweep with ``sweep``), written from the runs there; its
    address, or None (no such experiment, no harness runs, an MLflow whose view format is unknown, a failure).

    For ``harness.compare``: print it after the comparison table.
    """
    from harness.results import mlflow_views as views

    try:
        from mlflow.tracking import MlflowClient

        resolved = resolve_uri(uri)
        client = MlflowClient(tracking_uri=resolved)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return None
        query = f"tags.`{SWEEP_TAG}` = '{sweep}'" if sweep and "'" not in sweep else ""
        runs = client.search_runs([found.experiment_id], filter_string=query, max_results=500)
        slices = [s for run in runs if views.VERDICT_TAG in run.data.tags
                  for s in run.data.tags.get("slices", "").split(",") if s]
        if not runs or not slices:
            return None
        links = views.write_views(client, found.experiment_id, list(dict.fromkeys(slices)), sweep)
        key = views.sweep_view_key(sweep) if sweep else views.HEADLINE_VIEW_KEY
        return views.absolute(resolved, links[key]) if key in links else None
    except Exception as exc:
        log.warning("no MLflow Headline link (%s: %s)", type(exc).__name__, exc)
        return None


def flat_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The numbers of ``resources`` and ``throughput`` as MLflow metric names (``resources/...``, ``throughput/...``)."""
    out: dict[str, float] = {}
    res = summary.get("resources") or {}
    if isinstance(res.get("host_rss_peak_gb"), (int, float)):
        out["resources/host_rss_peak_gb"] = float(res["host_rss_peak_gb"])
    for stage, value in (res.get("cuda_peak_gb") or {}).items():
        out[f"resources/cuda_peak_gb/{stage}"] = float(value)
    for stage, values in (summary.get("throughput") or {}).items():
        for key, value in values.items():
            out[f"throughput/{stage}/{key}"] = float(value)
    return out
