"""The pipeline of one job, top to bottom: config → model → reference → quantize →
evaluate → divergence → compare → results on disk → MLflow.

This module orchestrates and nothing else: what a job *is* (its keys, settings and
divergence texts) lives in :mod:`harness.job.identity`, the reference stage in
:mod:`harness.reference`, each stage's work in its own module. Every stage is a function of
plain data so a notebook can run them one at a time (see the README's Python API).
Expensive stages are preceded by every check that can be made in advance. The caller's
config is never modified, and each results file is written once.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from harness import quant
from harness.checkpoint import candidate
from harness.config import RunConfig, config_dict, to_config
from harness.decision import gate
from harness.decision.criteria import check_thinking_limits
from harness.divergence import scoring as divergence
from harness.engines import served
from harness.errors import UsageError
from harness.evaluation import evaluate, prompt_log, sequential_run, thinking
from harness.evaluation.evaluate import check_settings
from harness.evaluation import judge, judge_client
from harness.evaluation.slices import Slice, check_hub_for_registry, resolve
from harness.infra import devices, joblog, progress
from harness.infra.cache import (
    Cache,
    atomic_write_json,
    atomic_write_text,
    check_cache_dir,
)
from harness.infra.runtime import apply_threads
from harness.job import background_reference, disk, served_reference, stage_meter, sweep
from harness.job.identity import ReferenceSpec, reference_key, run_key, run_name, tokenizer_dir
from harness.job.reference import (
    SliceReference,
    capture_for,
    deferred_references,
    reference_unless_busy,
    share_heads,
    teacher_force_held,
    teacher_replies,
)
from harness.models import loading as models
from harness.models import placement
from harness.models.reference_label import describe_reference
from harness.quant.calibration import check_format
from harness.results import longgen, prompt_outcomes, report, summary, tracking
from harness.results.tracking import SWEEP_TAG
from harness.sizing import ledger

log = logging.getLogger("harness")


class ResultsDirError(PermissionError, UsageError):
    """The results directory cannot be written; the message names it and the setting to change."""


@dataclass
class Timings:
    stages: dict[str, float] = field(default_factory=dict)
    meter: stage_meter.StageMeter = field(default_factory=stage_meter.StageMeter)  # memory and tokens per stage

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        progress.current().stage(name)  # "▶ name" in the log, or the job's progress display
        self.meter.begin(name)
        try:
            with progress.token_source(self.tokens):
                yield
        finally:
            elapsed = time.perf_counter() - start
            self.stages[name] = self.stages.get(name, 0.0) + elapsed
            self.meter.end(name, elapsed)
            progress.current().stage(name, elapsed)

    def tokens(self) -> int:
        """Tokens the model has run in this process so far (every stage)."""
        return sum(use.prefill_tokens + use.generated_tokens for use in self.meter.stages.values())


@dataclass
class Preflight:
    """What the checks before loading the model found: the slices and the tracking store."""

    slices: list[Slice]
    uri: str
    tracking_problem: str | None


@dataclass
class Evaluated:
    """The quantized model's per-item records and lm-eval bookkeeping, all slices."""

    records: pd.DataFrame
    aggregates: dict[str, float]
    restored: dict[str, int]  # requests read back from an interrupted attempt's checkpoint
    requests: dict[str, int]
    sequential: dict[str, dict] = field(default_factory=dict)  # eval.sequential: per slice, where it stopped and why
    placement: pd.DataFrame | None = None  # eval.sequential: item_id, seq_round, seq_order of the answered items
    waited: dict[str, SliceReference] = field(default_factory=dict)  # references waited for before a round
    # per slice, the states of the forwards that answered its items (HiddenCapture; no prompt run twice)
    captured: dict[str, Any] = field(default_factory=dict)


def job_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The job's own config: scheme defaults of the model filled in, the sweep id tagged.

    A copy: the caller's config (a notebook may reuse it) is left exactly as given.
    """
    cfg = to_config(cfg)
    tags = sweep.tags_with_sweep_id(cfg.tracking.tags)  # harness.sweep_id groups a sweep's runs
    scheme = quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups)
    if candidate.requested(cfg.candidate, scheme.name):  # an external checkpoint is the candidate
        scheme = dataclasses.replace(scheme, name=f"external:{candidate.candidate_name(cfg.candidate)}")
    return dataclasses.replace(cfg, quant=scheme, tracking=dataclasses.replace(cfg.tracking, tags=tags))


@dataclass
class Job:
    """What every stage of one job shares: its config, the checks made before loading, the model, the
    cache, and where its results go."""

    cfg: RunConfig
    runtime: dict[str, Any]  # torch threads and where the number came from (summary.json's runtime)
    timings: Timings
    checked: Preflight
    cache: Cache
    loaded: models.LoadedModel  # the reference model, as loaded
    key: str
    results_dir: Path
    served: served.ServedCandidate | None = None  # candidate.endpoint / candidate.serve
    reference_server: served_reference.ServedReference | None = None  # reference.endpoint / reference.serve

    @property
    def checkpoint(self) -> Path:
        """lm-eval's per-request results: a killed job resumes from them."""
        return self.results_dir / "checkpoint"

    @property
    def finished(self) -> bool:
        return (self.results_dir / "summary.json").exists()

    @property
    def reference_spec(self) -> ReferenceSpec:
        """What the reference stage reads of the config."""
        return ReferenceSpec.of(self.cfg)


@dataclass(frozen=True)
class Candidate:
    """The model being judged: a scheme the harness applied, or an external checkpoint."""

    loaded: models.LoadedModel
    quant_report: quant.QuantReport
    params: dict[str, Any]  # an external checkpoint's scheme as parameters ({} for the harness's own)


def run(cfg: DictConfig | RunConfig) -> dict[str, Any]:
    """Run one job; returns the summary (also written to results/<run>/summary.json).

    The stages, top to bottom; where the job has a choice, the config picks the stage:

    * reference: in this process, or in a background process (:func:`background_reference.start`);
      a reference another job is computing is read after evaluating;
    * candidate: the scheme applied by the harness, or an external checkpoint (``candidate.path``);
    * evaluate: whole slices, or sequential rounds that stop once settled (``eval.sequential``);
    * gate: gate.json and gate.xml beside the results (``gate.enabled``).
    """
    started_at = time.time()
    job = open_job(job_config(cfg))
    if job.finished and not job.cfg.force:
        log.info("finished results for this config exist in %s; reusing them (force=true recomputes)",
                 job.results_dir)
        _log_to_mlflow(job.results_dir, job.cfg, job.checked)
        return pd.read_json(job.results_dir / "summary.json", typ="series").to_dict()
    disk.check_disk_space(disk.job_writes(job.reference_spec, job.cfg.quant, job.loaded, job.checked.slices,
                                          job.cache, job.results_dir))
    if job.cfg.force:
        shutil.rmtree(job.checkpoint, ignore_errors=True)

    with job.timings.stage("reference"), progress.side("reference"):
        if served_reference.is_served(job.cfg):  # the staged comparison: the deployed reference answers
            background, ready = None, served_references(job)
        else:
            background = background_reference.start(job.reference_spec, job.cfg.model, job.loaded,
                                                    job.checked.slices, job.cache, job.runtime["threads"])
            ready = {s.name: r for s in job.checked.slices
                     if (r := reference_unless_busy(job.loaded, s, job.reference_spec, job.cache)) is not None}
    candidate_stage = served_candidate if job.cfg.candidate.endpoint or job.cfg.candidate.serve else \
        external_candidate if job.cfg.candidate.path else quantized_candidate
    with job.timings.stage("quantize"):
        judged = candidate_stage(job)
    evaluate_stage = evaluate_in_rounds if job.cfg.eval.sequential else evaluate_slices
    try:
        with job.timings.stage("evaluate"):
            evaluated = evaluate_stage(judged.loaded, job, ready)
        references, deferred = gather_references(job, {**ready, **evaluated.waited}, background)
        if job.reference_server is not None:  # both servers asked the same of every item, or no pairing
            served_reference.check_same_requests(pd.concat([r.records for r in references.values()]),
                                                 evaluated.records)
        with job.timings.stage("divergence"):
            # a served candidate: the server's top-k log-probs of the same texts (KL as a lower bound)
            tokens = job.served.divergence({s.name: references[s.name].texts for s in job.checked.slices}) \
                if job.served else \
                pd.concat([compare_slice(judged.loaded.model, references[s.name].texts, s.name,
                                         evaluated.captured.pop(s.name, None),
                                         background_reference.forward_threads(background))
                           for s in job.checked.slices], ignore_index=True)
        if job.reference_server is not None:  # what answered for the reference, and which bound its KL is
            judged.params.update(job.reference_server.params)
            if "candidate.divergence_topk" in judged.params:
                judged.params["candidate.divergence"] = served_reference.BOTH_SERVED_LINE.format(
                    k=min(job.cfg.reference.endpoint_divergence_topk, job.cfg.candidate.endpoint_divergence_topk))
    finally:
        if job.served is not None:  # a server the harness started stops here (after divergence), also on a failure
            job.served.stop()
    result = write_results(job, judged, references, evaluated, tokens, started_at, deferred)
    if job.cfg.gate.enabled:  # gate.json + gate.xml beside the results (a sweep gates every run)
        decision = gate.gate_results(job.results_dir, job.cfg.gate)
        result["gate"] = {"outcome": decision.outcome, "exit_code": decision.exit_code}
    shutil.rmtree(job.checkpoint, ignore_errors=True)  # the results it protected are on disk now
    report.print_comparison(result.pop("_comparison"), result)
    with job.timings.stage("logging"):
        _log_to_mlflow(job.results_dir, job.cfg, job.checked)
    result["timings"].update(job.timings.stages)  # the returned summary also times the logging
    job.timings.meter.unwatch()
    log.info("results: %s (torch threads: %d, from %s)", job.results_dir, job.runtime["threads"],
             job.runtime["threads_from"])
    return result


def served_references(job: Job) -> dict[str, SliceReference]:
    """Every slice's reference from the served reference (harness.job.served_reference), its server stopped before
    the candidate's starts (one server at a time on the machine), also on a failure."""
    job.reference_server = served_reference.ServedReference(job.cfg, job.results_dir).start()
    try:
        return job.reference_server.references(job.loaded, job.checked.slices, job.reference_spec,
                                               job.checkpoint / "_reference")
    finally:
        job.reference_server.stop()


def compare_slice(model: torch.nn.Module, texts: list[divergence.ReferenceText], slice_name: str, captured: Any,
                  forward_threads: int | None) -> pd.DataFrame:
    """One slice's per-token comparison; replies whose prompts' KV caches were held (a slice answered before its
    reference was read) are teacher-forced from them first.

    On all threads: only a reply the model's own decode did not give is teacher-forced, and such states never
    equal the reference's decode states bit for bit anyway (a null scheme decodes the reference's replies: its
    states are its own decode's, computed with the reference's thread count)."""
    teacher_force_held(model, captured, texts)
    return divergence.compare_to_reference(model, texts, slice_name, captured=captured,
                                           forward_threads=forward_threads)


def open_job(cfg: RunConfig) -> Job:
    """Threads, every check that costs nothing, the model, and the results directory."""
    runtime = apply_threads(cfg.runtime)  # once, before any torch work
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # per-request INFO lines drown the stage log
    timings = Timings()
    checked = preflight(cfg)
    progress.current().plan([s.name for s in checked.slices])
    cache = Cache(cfg.paths.cache_dir)
    with timings.stage("load"):
        loaded = models.load(cfg.model, cfg.paths.cache_dir)
    timings.meter.watch(loaded.model)
    quant.validate_for_model(loaded.model, cfg.quant)
    placement.check_quantizable(loaded.model, quant.changes_weights(cfg.quant))  # device=auto with disk offload
    thinking.check_template(loaded.tokenizer, thinking.spec_of(cfg))  # enable_thinking its template never reads
    key = run_key(cfg, loaded.identity)
    results_dir = prepare_results_dir(cfg, key)
    joblog.attach(results_dir)  # the command line's job.log (libraries' messages) lives with the results
    return Job(cfg, runtime, timings, checked, cache, loaded, key, results_dir)


def quantized_candidate(job: Job) -> Candidate:
    """The scheme applied to the loaded model, in place (the reference's numbers are already stored)."""
    report = quant.apply(job.loaded.model, job.cfg.quant, _quant_context(job.loaded, job.cfg, job.cache))
    return Candidate(job.loaded, report, {})


def served_candidate(job: Job) -> Candidate:
    """A serving engine answers for the candidate (harness.engines.served); started here when the harness serves it,
    and the checkpoint its server names described."""
    job.served = served.ServedCandidate(job.cfg.candidate, job.results_dir).start()
    job.served.params.update(candidate.served_params(job.served.checkpoint_dir, job.served.params["candidate.name"],
                                                     job.loaded.model))
    return Candidate(job.loaded, job.served.quant_report(job.loaded.model), job.served.params)


def candidate_lm(loaded: models.LoadedModel, job: Job, settings: evaluate.EvalSettings) -> Any:
    """lm-eval's model of the candidate; a served candidate's is its endpoint, prompted by the reference's wrapper."""
    lm = evaluate.make_lm(loaded.model, loaded.tokenizer, settings, checkpoint=job.cfg.candidate.path)
    return lm if job.served is None else job.served.lm(lm)


def external_candidate(job: Job) -> Candidate:
    """An external checkpoint, loaded in the reference's place."""
    loaded, report, params = load_candidate(job.loaded, job.cfg)
    job.timings.meter.watch(loaded.model)
    return Candidate(loaded, report, params)


def gather_references(job: Job, found: dict[str, SliceReference],
                      background: background_reference.Background | None
                      ) -> tuple[dict[str, SliceReference], list[str]]:
    """Every slice's reference, in slice order: those found so far, then those another process was
    computing (waited for here); one frozen output head shared by all. Also the names of the slices
    waited for here (summary.json's ``reference_deferred``)."""
    missing = [s for s in job.checked.slices if s.name not in found]
    late: dict[str, SliceReference] = {}
    if missing:
        # the child's thread count: a reference computed here after the child died matches the divergence stage
        with job.timings.stage("reference_wait"), progress.side("reference"), \
                background_reference.scoring_threads(background, job.runtime["threads"]):
            late = deferred_references(job.loaded, missing, job.reference_spec, job.cache, job.cfg.model)
    job.runtime.update(background_reference.collect(background, job.timings.meter))
    computed_aside = background.slices if background is not None else ()
    references = {}
    for slice_ in job.checked.slices:
        reference = found.get(slice_.name) or late[slice_.name]
        if slice_.name in computed_aside:  # read from the cache, but computed for this job
            reference = dataclasses.replace(reference, cached=False)
        elif reference.cached:
            progress.current().note("reference", slice_.name, "cached")
        references[slice_.name] = reference
    return share_heads(references), [s.name for s in missing]


def write_results(job: Job, judged: Candidate, references: dict[str, SliceReference], evaluated: Evaluated,
                  tokens: pd.DataFrame, started_at: float, deferred: list[str]) -> dict[str, Any]:
    """Records first (a failure in the statistics never loses the evaluation), then the comparison,
    the reports and summary.json, which marks the results complete."""
    cfg, results_dir, timings = job.cfg, job.results_dir, job.timings
    reference_records = pd.concat([r.records for r in references.values()], ignore_index=True)
    not_evaluated = None
    if cfg.eval.sequential:  # the statistics compare the items both answered; the rest are listed, not scored
        answered = set(evaluated.records["item_id"])
        not_evaluated = sequential_run.not_evaluated_frame(reference_records, answered)
        reference_records = reference_records[reference_records["item_id"].isin(answered)].reset_index(drop=True)
    items = summary.pair_items(reference_records, evaluated.records)
    if "prompt" in reference_records:  # the prompt as the model saw it, in items.parquet and MLflow's item tables
        items = items.merge(reference_records[["item_id", "prompt"]], on="item_id", how="left")
    if evaluated.placement is not None:
        items = items.merge(evaluated.placement, on="item_id", how="left")
    with timings.stage("write"):
        write_records(results_dir, cfg, items, tokens, judged.quant_report)
        if not_evaluated is not None:
            _write_parquet(not_evaluated, results_dir / "not_evaluated.parquet")
    tokenizer = judged.loaded.tokenizer
    comparison = summary.build(reference_records, evaluated.records, tokens, cfg.compare,
                               list(cfg.eval.position_buckets),
                               lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    capacity_ledger = capacity(judged.loaded, judged.quant_report, cfg)
    think_metrics, think_frame = thinking.run_metrics(
        reference_records, evaluated.records, thinking.spec_of(cfg),
        lambda text: tokenizer(text, add_special_tokens=False)["input_ids"], ci_level=cfg.compare.ci_level,
        n_resamples=cfg.compare.n_resamples, seed=cfg.compare.seed)
    if not think_frame.empty:
        _write_parquet(think_frame, results_dir / "thinking.parquet")
    result = summary_record(cfg, job.key, comparison, judged.quant_report, references, evaluated, timings,
                            judged.loaded)
    result["metrics"].update(think_metrics)
    result["metrics"].update(thinking.kl_split_metrics(  # KL along the replies' traces and answers, apart
        tokens, {name: r.texts for name, r in references.items()}, thinking.spec_of(cfg), tokenizer.decode))
    prompt_metrics, prompt_frame = prompt_log_outcomes(job, items, tokenizer)
    if not prompt_frame.empty:  # numbers and language codes only: no prompt or reply text
        _write_parquet(prompt_frame, results_dir / "prompt_outcomes.parquet")
    result["metrics"].update(prompt_metrics)
    pairwise = judge_stage(job, items)
    if pairwise is not None:  # judge.endpoint / judge.serve: the two replies judged blind, both orders
        result["metrics"].update(pairwise.metrics)
        result["judge"] = pairwise.params
    if judged.quant_report.bits_known:  # a served candidate with no local checkpoint: no bits, no ledger
        result["quant"].update(capacity_ledger.metrics())
    result["reference_deferred"] = deferred  # read after evaluating: another job computed them
    result["runtime"] = job.runtime
    result["candidate"] = judged.params
    if cfg.eval.sequential:
        result["sequential"] = evaluated.sequential
    long_generation = longgen.for_run(items, tokenizer)
    if long_generation is not None:
        result["long_generation"] = long_generation.summary
    with timings.stage("write"):
        write_analysis(results_dir, cfg, comparison, judged.quant_report, result, capacity_ledger, long_generation)
    result["timings"].update(timings.stages)
    result["resources"], result["throughput"] = timings.meter.resources(), timings.meter.throughput()
    result["started_at"], result["ended_at"] = started_at, time.time()  # the MLflow run spans the job
    atomic_write_json(results_dir / "summary.json", result)  # last: marks the results complete
    return {**result, "_comparison": comparison}


def preflight(cfg: RunConfig) -> Preflight:
    """Every check that costs nothing, before anything expensive (bad input fails here)."""
    check_cache_dir(cfg.paths.cache_dir)  # writable, with the locking the cache needs
    slices = resolve(cfg.slices)
    check_hub_for_registry(slices)
    gate.check_outcome_limits(cfg.gate)  # gate.outcomes: known outcomes, limits in [0, 1)
    check_thinking_limits(cfg.gate, thinking.spec_of(cfg).on)  # gate.thinking: known keys, a thinking model
    served_reference.check_config(cfg)  # reference.endpoint / reference.serve: a served candidate beside it
    for slice_ in slices:  # a prompt log is read and checked row by row now, not once the model is loaded
        if prompt_log.TASK in slice_.config.tasks:
            slice_.items(**slice_.metadata(cfg.eval.seed))
    quant.validate_scheme(cfg.quant)
    check_format(cfg.quant.calibration, cfg.model.chat_template, cfg.model.name)
    check_settings(cfg)
    thinking.check_config(cfg)
    judge_client.check_config(cfg.judge, list(cfg.slices), cfg.gate.judge_loss_max)  # judge.*: before any work
    sequential_run.check_config(cfg, slices)
    models.check_available(cfg.model)
    uri = tracking.resolve_uri(cfg.tracking.uri)
    shared = sweep.shared_store_warning(uri, sweep.hydra_launcher()) if cfg.tracking.enabled else None
    if shared:
        log.warning("SHARED TRACKING STORE: %s", shared)
    if cfg.eval.max_gen_toks is not None:
        log.warning("GENERATION CAPPED: eval.max_gen_toks=%d cuts every reply at %d tokens (a smoke run: its "
                    "accuracies are not the tasks' own; null restores them)", cfg.eval.max_gen_toks, cfg.eval.max_gen_toks)
    problem = tracking.check_tracking(uri) if cfg.tracking.enabled else None
    if problem:
        log.warning("TRACKING UNAVAILABLE: %s", problem)
    return Preflight(slices, uri, problem)


def prepare_results_dir(cfg: RunConfig, key: str) -> Path:
    """results/<run name>__<key>/, created and checked writable before any evaluation."""
    root = Path(cfg.paths.results_dir)
    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", run_name(cfg).replace("/", "__"))
    directory = root / f"{safe}__{key[:8]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".write-test"
        probe.write_text("ok")
        probe.unlink()
        # Who this run belongs to, from the start: the gate's sweep= / model= filters read it before loading.
        atomic_write_json(directory / "run.json", {"model": cfg.model.name, "scheme": cfg.quant.name,
                                                   "sweep_id": cfg.tracking.tags.get(SWEEP_TAG)})
    except OSError as exc:
        raise ResultsDirError(f"cannot write results to {directory} ({exc.strerror}); set paths.results_dir to a "
                              "writable directory") from None
    return directory


def evaluate_slices(loaded: models.LoadedModel, job: Job, references: dict[str, SliceReference]) -> Evaluated:
    """The candidate through lm-eval, every item of every slice, resuming from the job's checkpoint.

    The answering forwards' states are kept for the divergence stage, with the reference's replies
    teacher-forced after each prompt (:func:`capture_for`), which needs the slice's reference first: a
    slice whose reference is ready (here, or finished by another process meanwhile: read, returned in
    :attr:`Evaluated.waited`) goes next; when none is, the slice another process will reach last goes
    without it (its prompts' KV caches are held, ``runtime.held_kv_gb``, and the reference's replies
    teacher-forced from them in the divergence stage), so this process never idles.
    """
    spec = job.reference_spec
    settings = spec.eval_settings(tokenizer_dir(loaded))
    lm = candidate_lm(loaded, job, settings)
    frames, aggregates, restored, requests, waited, captured = {}, {}, {}, {}, {}, {}
    remaining = list(job.checked.slices)
    while remaining:
        slice_, reference = _next_slice(job, remaining, references, lm)
        remaining.remove(slice_)
        if reference is not None and slice_.name not in references:
            waited[slice_.name] = reference
        if reference is None:
            log.info("slice %s: evaluated before its reference is ready (another job is computing it); "
                     "its replies are teacher-forced in the divergence stage", slice_.name)
        checkpoint = job.checkpoint / slice_.name
        restored[slice_.name] = evaluate.checkpoint_rows(checkpoint)
        teacher = None if reference is None else teacher_replies(slice_, reference.records, loaded.tokenizer, spec)
        # its replies come later: prompt KV caches held, within what earlier slices' hold leaves of the budget
        hold = 0 if reference is not None else max(0, int(job.cfg.runtime.held_kv_gb * 2**30) - sum(
            c.held_size for c in captured.values() if c is not None))
        captured[slice_.name] = capture_for(lm, slice_, spec, teacher, hold)
        frames[slice_.name], agg = evaluate.evaluate_slice(lm, slice_, settings, checkpoint=checkpoint)
        requests[slice_.name] = evaluate.checkpoint_rows(checkpoint)
        aggregates.update(agg)
    capture_for(lm, None, spec)
    return Evaluated(pd.concat([frames[s.name] for s in job.checked.slices], ignore_index=True), aggregates,
                     restored, requests, waited=waited, captured=captured)


def _next_slice(job: Job, remaining: list[Slice], references: dict[str, SliceReference],
                lm: Any) -> tuple[Slice, SliceReference | None]:
    """The slice to evaluate next and its reference if ready (see :func:`evaluate_slices`)."""
    if not hasattr(lm, "hidden_capture"):  # nothing is kept on this backend: the configured order
        return remaining[0], references.get(remaining[0].name)
    for slice_ in remaining:
        if slice_.name in references:
            return slice_, references[slice_.name]
        if job.cache.complete("reference", reference_key(job.loaded, slice_, job.reference_spec)):
            return slice_, deferred_references(job.loaded, [slice_], job.reference_spec, job.cache,
                                               job.cfg.model)[slice_.name]
    return remaining[-1], None


def evaluate_in_rounds(loaded: models.LoadedModel, job: Job, references: dict[str, SliceReference]) -> Evaluated:
    """The candidate in sequential rounds, each slice until settled (:mod:`harness.evaluation.sequential_run`).

    A round needs the slice's reference: slices whose reference is in ``references`` go first, and
    one another process is computing is waited for right before its slice; those waited for are
    returned in :attr:`Evaluated.waited` (``references`` is not changed).
    """
    cfg, spec = job.cfg, job.reference_spec
    settings = spec.eval_settings(tokenizer_dir(loaded))
    lm = candidate_lm(loaded, job, settings)
    rule = sequential_run.stop_rule(cfg, [s.name for s in job.checked.slices])
    records, aggregates, restored, requests, stops, placements = [], {}, {}, {}, {}, []
    waited: dict[str, SliceReference] = {}
    captured: dict[str, Any] = {}
    for slice_ in sorted(job.checked.slices, key=lambda s: s.name not in references):
        checkpoint = job.checkpoint / slice_.name
        restored[slice_.name] = evaluate.checkpoint_rows(checkpoint)
        reference = references.get(slice_.name)
        if reference is None:
            reference = waited[slice_.name] = deferred_references(job.loaded, [slice_], spec, job.cache,
                                                                  cfg.model)[slice_.name]
        captured[slice_.name] = capture_for(lm, slice_, spec, teacher_replies(slice_, reference.records,
                                                                              loaded.tokenizer, spec))
        frame, agg, stops[slice_.name], placed = sequential_run.evaluate_sequential(
            lm, slice_, settings, checkpoint, reference.records, rule, cfg.eval.seed, cfg.eval.sequential_round_items)
        placements.append(placed)
        progress.current().note("quantized", slice_.name, sequential_run.items_line(stops[slice_.name]))
        requests[slice_.name] = evaluate.checkpoint_rows(checkpoint)
        records.append(frame)
        aggregates.update(agg)
    capture_for(lm, None, spec)
    return Evaluated(pd.concat(records, ignore_index=True), aggregates, restored, requests,
                     {s.name: stops[s.name] for s in job.checked.slices if s.name in stops},
                     pd.concat(placements, ignore_index=True), waited, captured)


def summary_record(cfg: RunConfig, key: str, comparison: summary.Comparison, quant_report: quant.QuantReport,
                   references: dict[str, SliceReference], evaluated: Evaluated, timings: Timings,
                   loaded: models.LoadedModel) -> dict[str, Any]:
    """The content of summary.json: identity, metrics, timings, quantization and bookkeeping."""
    quant_summary = {**quant_report.summary(), **ledger.decode_floor_metrics(decode_floor(quant_report, cfg))}
    if not quant_report.bits_known:  # what the harness did not see is left out, not printed as 16 bits
        quant_summary = {k: v for k, v in quant_summary.items() if k in ("layers_quantized", "quantize_s")}
    return {
        "run_key": key, "run_name": run_name(cfg), "model": cfg.model.name, "scheme": cfg.quant.name,
        "reference": (served_reference.describe(cfg) if served_reference.is_served(cfg)
                      else describe_reference(cfg.model)),
        "method": cfg.quant.method, "slices": list(cfg.slices),
        "metrics": comparison.metrics(),
        "timings": {**timings.stages, **{f"model_{k}": v for k, v in loaded.timings.items()}},
        "quant": quant_summary, "reference_cached": {n: r.cached for n, r in references.items()},
        "lm_eval_aggregates": {"reference": {k: v for r in references.values() for k, v in r.aggregates.items()},
                               "quantized": evaluated.aggregates},
        "machine": _machine(), "tags": dict(cfg.tracking.tags), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "checkpoint": {"restored_requests": evaluated.restored, "requests": evaluated.requests,
                       "reference_restored_requests": {n: r.restored_requests for n, r in references.items()}},
        **({"max_gen_toks": cfg.eval.max_gen_toks} if cfg.eval.max_gen_toks is not None else {}),
        **simulated_activations(cfg),
    }


def simulated_activations(cfg: RunConfig) -> dict[str, Any]:
    """``{"simulated_activations": "<format>, <granularity>[, dynamic]"}`` when this run's own simulation
    quantizes activations (a W8A8 or W4A4 scheme evaluated in PyTorch, not an export or a server): an engine's
    kernels quantize them otherwise, and its replies can differ (:func:`harness.results.report.simulation_lines`)."""
    acts = cfg.quant.activations
    if acts is None or cfg.candidate.path or cfg.candidate.endpoint or cfg.candidate.serve:
        return {}
    return {"simulated_activations": f"{acts.format}, per {acts.granularity}, "
                                     f"{'dynamic' if acts.dynamic else 'static (calibrated)'} scales"}


def load_candidate(reference: models.LoadedModel,
                   cfg: RunConfig) -> tuple[models.LoadedModel, quant.QuantReport, dict[str, Any]]:
    """The external candidate in the reference's place, its scheme as a quant report and as parameters.

    The reference's tokenizer stays (the candidate's was checked identical) and so does its
    identity: the results are keyed by the config, which names the candidate.
    """
    loaded, scheme = candidate.load(cfg.candidate, cfg.model, cfg.paths.cache_dir, reference_model=reference.model,
                                    reference_tokenizer=reference.tokenizer)
    total = sum(p.numel() for p in reference.model.parameters())
    quant_report = candidate.weight_report(reference.model, loaded.model, scheme, total)
    quant_report.notes.extend(f"{k}={v}" for k, v in scheme.as_params().items())
    return models.LoadedModel(model=loaded.model, tokenizer=reference.tokenizer, identity=reference.identity,
                              timings={**reference.timings, **{f"candidate_{k}": v for k, v in loaded.timings.items()}}
                              ), quant_report, scheme.as_params()


def _quant_context(loaded: models.LoadedModel, cfg: RunConfig, cache: Cache) -> Any:
    from harness.quant.calibration import CalibrationContext

    spec = thinking.spec_of(cfg)  # a thinking model is calibrated thinking, as it is evaluated
    return CalibrationContext(model_key=loaded.key, tokenizer=loaded.tokenizer, config=cfg.quant.calibration,
                              device=devices.calibration_device(loaded.model, cfg.model.device), cache=cache,
                              scheme=cfg.quant, chat_template=cfg.model.chat_template,
                              think_tags=spec.markers()[:2] if spec.on else None,
                              template_args=spec.chat_template_args())


def write_records(directory: Path, cfg: RunConfig, items: pd.DataFrame, tokens: pd.DataFrame,
                  quant_report: quant.QuantReport) -> None:
    """What was measured, before anything is computed from it: config, paired items, token rows, layers."""
    config = config_dict(cfg)
    atomic_write_json(directory / "config.json", config)
    atomic_write_text(directory / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(config)))
    _write_parquet(items, directory / "items.parquet")
    _write_parquet(tokens, directory / "tokens.parquet")
    _write_parquet(pd.DataFrame(quant_report.to_records()), directory / "quant_layers.parquet")


def prompt_log_outcomes(job: Job, items: pd.DataFrame, tokenizer: Any) -> tuple[dict[str, float], pd.DataFrame]:
    """The gold-free outcomes of every prompt-log slice of the run (harness.results.prompt_outcomes)."""
    frames = []
    for slice_ in job.checked.slices:
        if prompt_log.TASK not in slice_.config.tasks:
            continue
        rows = {f"{prompt_log.TASK}/{row['id']}": row for row in slice_.items(**slice_.metadata(job.cfg.eval.seed))}
        part = items[items["slice"] == slice_.name]
        if not part.empty:
            frames.append(prompt_outcomes.outcome_frame(
                part, rows, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                cap_override=job.cfg.eval.max_gen_toks))
    if not frames:
        return {}, pd.DataFrame()
    frame = pd.concat(frames, ignore_index=True)
    compare = job.cfg.compare
    return prompt_outcomes.outcome_metrics(frame, ci_level=compare.ci_level, n_resamples=compare.n_resamples,
                                           seed=compare.seed), frame


def judge_stage(job: Job, items: pd.DataFrame) -> judge.JudgeResult | None:
    """The pairwise judge on judge.slices (harness.evaluation.judge); None when no judge is set."""
    if not judge_client.enabled(job.cfg.judge):
        return None
    conversations: dict[str, str] = {}
    for slice_ in job.checked.slices:  # a prompt log's conversations, as the user saw them
        if slice_.name in job.cfg.judge.slices and prompt_log.TASK in slice_.config.tasks:
            conversations.update(judge.conversations_from_rows(slice_.items(**slice_.metadata(job.cfg.eval.seed))))
    with job.timings.stage("judge"):
        result = judge.run_judge(job.cfg.judge, items, conversations, log_dir=job.results_dir,
                                 ci_level=job.cfg.compare.ci_level)
    judge.write(result, job.results_dir)
    return result


def write_analysis(directory: Path, cfg: RunConfig, comparison: summary.Comparison, quant_report: quant.QuantReport,
                   result: dict, capacity_ledger: ledger.Ledger,
                   long_generation: longgen.LongGenReport | None = None) -> None:
    """The statistics and reports; summary.json, which marks completion, is written last by the caller."""
    _write_parquet(comparison.item_stats, directory / "item_stats.parquet")
    _write_parquet(comparison.token_stats, directory / "token_stats.parquet")
    _write_parquet(comparison.generation, directory / "generation.parquet")
    decode_floor(quant_report, cfg).to_csv(directory / "decode_floor.csv", index=False)
    kl_plot = report.plot_kl_by_position(comparison, directory / "kl_by_position.png",
                                         title=f"{cfg.model.name} · {cfg.quant.name}: KL(ref‖quant) by position")
    report.plot_sequence(result.get("sequential") or {}, directory / "sequence.png",
                         title=f"{cfg.model.name} · {cfg.quant.name}: sequential evaluation")
    markdown = report.markdown(comparison, result, kl_plot=kl_plot.name if kl_plot else None)
    capacity_ledger.write_csv(directory / "ledger.csv")
    markdown += "\n" + capacity_ledger.markdown()
    if long_generation is not None:
        _write_parquet(long_generation.items, directory / "long_generation.parquet")
        _write_parquet(long_generation.curve, directory / "long_generation_survival.parquet")
        longgen.plot_survival({cfg.quant.name: long_generation.curve}, directory / "long_generation_survival.png")
        markdown += "\n" + long_generation.markdown() + "\n![survival](long_generation_survival.png)\n"
    for name in result.get("slices", []):
        section = prompt_outcomes.markdown(result["metrics"], name)
        if section:
            markdown += "\n" + section
        section = judge.report_section(directory, result["metrics"], name, (result.get("judge") or {}).get("judge.model"))
        if section:
            markdown += "\n" + section
        section = thinking.markdown(result["metrics"], name)  # thinking runs only
        if section:
            markdown += "\n" + section
    atomic_write_text(directory / "report.md", markdown)


def decode_floor(quant_report: quant.QuantReport, cfg: RunConfig) -> pd.DataFrame:
    """Batch-1 decode floor (weight bytes / bandwidth) of this model and of 8B/70B at its bits/weight."""
    return ledger.decode_floor_table(quant_report, {g: ledger.GPU_BANDWIDTH[g] for g in ledger.DEFAULT_GPUS},
                                     model_name=cfg.model.name)


def capacity(loaded: models.LoadedModel, quant_report: quant.QuantReport, cfg: RunConfig) -> ledger.Ledger:
    """What the scheme buys on each GPU of the ledger: KV tokens, batch, decode floor."""
    return ledger.ledger_for_run(loaded.model, quant_report, cfg)


def _write_parquet(frame: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(".parquet.tmp")
    frame.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def _log_to_mlflow(results_dir: Path, cfg: RunConfig, checked: Preflight) -> None:
    if not cfg.tracking.enabled:
        return
    if checked.tracking_problem:
        log.warning("not logged to MLflow (%s). Later: python -m harness.sync %s", checked.tracking_problem,
                    results_dir)
        return
    try:
        run_id = tracking.log_results(results_dir, uri=checked.uri, experiment=cfg.tracking.experiment,
                                      tags=cfg.tracking.tags)
        log.info("MLflow run %s in %s (experiment %s)", run_id, checked.uri, cfg.tracking.experiment)
    except Exception as exc:  # tracking must never lose a finished result
        log.warning("MLflow logging failed (%s: %s); results are safe in %s. Later: python -m harness.sync %s",
                    type(exc).__name__, exc, results_dir, results_dir)


def _machine() -> dict[str, str]:
    import platform
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": str(os.cpu_count())}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
