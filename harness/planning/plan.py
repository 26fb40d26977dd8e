"""``python -m harness.plan [-m] <overrides ...> [tokens_per_s=N]`` — size a sweep before running it.

Takes the overrides of a ``python -m harness -m ...`` command, expands the sweep exactly as
Hydra's basic sweeper does, and prints one row per job plus one per reference (each model's
unquantized reference is computed once per sweep, inside the first job that needs it): the
tokens each will run through the model and an estimated time. Nothing is evaluated.

Tokens are counted from lm-eval's own requests (the slices' items, prompts, chat template and
few-shot contexts, built as ``simple_evaluate`` builds them) with the model's tokenizer:
``scored`` is context + continuation of every log-likelihood request, ``prompt`` the prompts of
generation requests, ``generated`` their ``max_gen_toks`` (an upper bound: generation stops at
a stop sequence), ``divergence`` the gold texts scored for KL/PPL, ``calibration`` the
calibration set, once per part of the scheme that calibrates (a GPTQ/AWQ/SmoothQuant method,
static activation scales, static KV-cache scales; ``quant.calibration_passes``). Time = load + (scored + prompt + divergence
+ calibration) / prefill rate + generated / decode rate. The rates come from, in order:
``tokens_per_s=`` / ``decode_tokens_per_s=`` (a GPU's rates; the model is not loaded); the
finished runs under ``paths.results_dir`` of the same model, dtype and device on this hardware
(their summary.json's ``throughput``: tokens and wall time per stage, fitted by non-negative
least squares, time = prefill / prefill rate + generated / decode rate, so the rates include
each stage's bookkeeping); else a short forward and a short generation measured here. The
printed plan says which. The estimate is linear in tokens: attention makes very long contexts
slower than that.

No weights are needed where the job's device is not this machine's (``model.device=cuda`` or
``auto`` on a login node without a GPU): the rates are then a roofline for the GPU named by ``gpu=`` (default
H100; the ledger's table) from the model's architecture (its config.json — a local directory or the
hub cache — else ``conf/ledger/architectures.yaml``): prefill at the GPU's peak dense BF16 FLOP/s
over 2 FLOP per parameter and token, decode at its memory bandwidth over the bytes one step reads
(an untied embedding gathered) times the batch, capped by the prefill rate; no load time. Those are
the fastest the GPU can go, so the times are lower bounds, and the plan says so. Tokens need the
model's tokenizer; when it is neither local nor in the hub cache (and the hub is unreachable), the
packaged stand-in of ``model.tiny.tokenizer`` (SmolLM2's) counts them, and the plan says that too.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf

from harness import cli, quant
from harness.config import ModelConfig, RunConfig, load_model_config
from harness.divergence import scoring as divergence
from harness.errors import UsageError
from harness.evaluation import evaluate
from harness.evaluation.slices import Slice, resolve
from harness.infra.cache import Cache, stable_hash
from harness.job import stage_meter
from harness.job.divergence_texts import divergence_texts, max_divergence_tokens
from harness.job.identity import ReferenceSpec, reference_key, run_key, slice_identity
from harness.models import loading as models

log = logging.getLogger("harness.plan")


@dataclass
class SliceTokens:
    slice: str
    requests: int = 0
    scored: int = 0  # log-likelihood requests: context + continuation tokens
    prompt: int = 0  # generation requests: prompt tokens
    generated: int = 0  # generation requests: max_gen_toks each (upper bound)
    divergence: int = 0  # run forward again by the divergence stage: the reference's replies (+ gold texts, if plain)

    @property
    def forward(self) -> int:
        """Tokens processed in parallel (prefill-like): everything but generated tokens."""
        return self.scored + self.prompt + self.divergence


@dataclass
class Throughput:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    load_s: float
    source: str  # how the rates were obtained

    def seconds(self, forward_tokens: int, generated_tokens: int) -> float:
        return forward_tokens / self.prefill_tokens_per_s + generated_tokens / self.decode_tokens_per_s


@dataclass
class ReferencePlan:
    model: str
    slices: list[SliceTokens]
    status: str  # "to compute" | "cached" | "not checked"
    estimated_s: float


@dataclass
class JobPlan:
    number: int
    overrides: list[str]
    model: str
    scheme: str
    method: str
    slices: list[SliceTokens]
    calibration: int
    status: str  # "to run" | "finished (reused)" | "not checked"
    estimated_s: float


@dataclass
class SweepPlan:
    jobs: list[JobPlan]
    references: list[ReferencePlan]
    throughput: dict[str, Throughput] = field(default_factory=dict)  # per model label (name, dtype, device)
    notes: list[str] = field(default_factory=list)  # approximations the plan made (stand-in tokenizer)

    @property
    def total_s(self) -> float:
        """Estimated time with the jobs run one after another (the basic launcher)."""
        return sum(j.estimated_s for j in self.jobs) + sum(r.estimated_s for r in self.references)


def expand_sweep(overrides: Sequence[str]) -> list[list[str]]:
    """The jobs of ``python -m harness -m <overrides>``: Hydra's own sweep expansion."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    kept = [o for o in parsed if not o.is_hydra_override()]  # launcher settings do not change the work
    if not kept:
        return [[]]
    return [job for batch in BasicSweeper.split_arguments(kept, None) for job in batch]


def _tokenizer_for(model: ModelConfig, cache: Cache) -> Any:
    if model.source == "tiny_random":
        return models.load_tokenizer(load_model_config(model.tiny.tokenizer), cache)
    return models.load_tokenizer(model, cache)


def _chat_template(tokenizer: Any):
    """What HFLM.apply_chat_template does, for building the requests without a model."""
    def apply(chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=not add_generation_prompt)
    return apply


def count_slice_tokens(slice_: Slice, spec: ReferenceSpec, tokenizer: Any) -> SliceTokens:
    """Tokens one model runs through for ``slice_`` (lm-eval requests + divergence texts)."""

    tokenizer_path = getattr(tokenizer, "name_or_path", None)
    settings = spec.eval_settings(tokenizer_path if tokenizer_path and Path(tokenizer_path).exists() else None)
    manager = evaluate.task_manager(slice_, settings)  # with eval.max_gen_toks applied, as the job's
    counts = SliceTokens(slice_.name)
    max_length = spec.max_length

    def length(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    for task in manager.load(list(slice_.config.tasks))["tasks"].values():
        if slice_.config.num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=slice_.config.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=settings.seed)
        task.build_all_requests(limit=slice_.config.limit, apply_chat_template=settings.chat_template,
                                chat_template=_chat_template(tokenizer) if settings.chat_template else None)
        for instance in task.instances:
            counts.requests += 1
            if instance.request_type == "generate_until":
                context, gen_kwargs = instance.args[0], instance.args[1]
                max_gen = int((gen_kwargs or {}).get("max_gen_toks", evaluate.DEFAULT_MAX_GEN_TOKS))
                counts.prompt += min(length(context), max(max_length - max_gen, 1))
                counts.generated += max_gen
            elif instance.request_type == "loglikelihood":
                counts.scored += min(length(instance.args[0]) + length(instance.args[1]), max_length)
            else:  # loglikelihood_rolling: the whole text, in windows of max_length
                counts.scored += length(instance.args[0])
    # One prefill per prompt: the divergence stage reads the prompts' states from answering the items and runs
    # forward only the reference's replies on the candidate (at most max_gen_toks each), plus the gold texts
    # where eval.divergence_plain asks for them.
    counts.divergence += counts.generated
    if spec.divergence_plain:
        limit = max_divergence_tokens(slice_, spec)
        for text in divergence_texts(slice_, settings):
            counts.divergence += int(divergence.tokenize(tokenizer, text, limit).numel())
    return counts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_throughput(loaded: models.LoadedModel, batch_size: int, *, seq_len: int = 128,
                       new_tokens: int = 8) -> tuple[float, float]:
    """(prefill, decode) tokens/s of the loaded model at ``batch_size`` (4 at most), on its device."""
    model = loaded.model
    device = next(model.parameters()).device
    batch = min(batch_size, 4)
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=generator).to(device)
    model(ids[:1, :8], use_cache=False)  # warm-up (kernels, allocator)
    _sync(device)
    start = time.perf_counter()
    model(ids, use_cache=False)
    _sync(device)
    prefill = batch * seq_len / (time.perf_counter() - start)
    prompt = ids[:, :16]
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    _sync(device)
    elapsed = time.perf_counter() - start - prompt.numel() / prefill
    decode = batch * new_tokens / max(elapsed, 1e-6)
    return prefill, decode


@dataclass
class _Model:
    """What the plan knows about one model of the sweep."""

    throughput: Throughput
    tokenizer: Any
    loaded: models.LoadedModel | None  # None when the rates were given or estimated (nothing loaded)
    note: str | None = None  # e.g. the tokenizer that stood in for the model's own


def plan_sweep(overrides: Sequence[str], *, tokens_per_s: float | None = None,
               decode_tokens_per_s: float | None = None, gpu: str = "H100") -> SweepPlan:
    """Plan the sweep ``python -m harness -m <overrides>`` would run (see the module docstring)."""
    from harness.sizing import ledger

    jobs = expand_sweep(overrides)
    configs = [_job_config(job) for job in jobs]  # every config error before any model is loaded
    (target_gpu,) = ledger.resolve_gpus([gpu])
    if target_gpu.name not in ledger.GPU_BF16_FLOPS:
        raise UsageError(f"gpu={gpu!r}: the plan's roofline needs a GPU of the table "
                             f"({', '.join(ledger.GPU_BF16_FLOPS)})")
    plan = SweepPlan(jobs=[], references=[])
    known: dict[str, _Model] = {}
    counts: dict[str, SliceTokens] = {}
    for number, (job, cfg) in enumerate(zip(jobs, configs)):
        label = f"{cfg.model.name} ({cfg.model.dtype}, {cfg.model.device})"
        if label not in known:
            known[label] = _prepare_model(cfg, tokens_per_s, decode_tokens_per_s, target_gpu)
            plan.throughput[label] = known[label].throughput
            if known[label].note:
                plan.notes.append(known[label].note)
        model = known[label]
        counted = []
        spec = ReferenceSpec.of(cfg)
        for slice_ in resolve(cfg.slices):
            key = stable_hash({"model": label, "slice": slice_identity(slice_), "eval": _structured_container(cfg.eval)})
            if key not in counts:  # first job of this model and slice: it also computes the reference
                counts[key] = count_slice_tokens(slice_, spec, model.tokenizer)
                # the reference decodes its replies: it runs none of them forward again
                reference = dataclasses.replace(counts[key], divergence=counts[key].divergence - counts[key].generated)
                plan.references.append(_reference_plan(cfg.model.name, slice_, spec, reference, model,
                                                       Cache(cfg.paths.cache_dir)))
            counted.append(counts[key])
        plan.jobs.append(_job_plan(number, job, cfg, counted, model))
    sequential = [str(j.number) for j, cfg in zip(plan.jobs, configs) if cfg.eval.sequential]
    if sequential:
        plan.notes.append(SEQUENTIAL_NOTE.format(jobs=", ".join(sequential)))
    return plan


# The measured shares of a slice's items a sequential candidate answers (benchmarks/bench_sequential.py,
# spending with the gate's min_clusters_pass, rounds of 1/8 of the slice; medians over the simulated designs;
# README "Sequential evaluation").
SEQUENTIAL_NOTE = ("eval.sequential=true (job {jobs}): the candidate's time is an upper bound, the reference's "
                   "is not (it answers every item). Measured median share of a slice's items a candidate needs: "
                   "a clearly broken scheme (5x the margin) 44 % when every item is its own cluster, 60 % with "
                   "50 clusters, 90 % with 20, ~100 % with 10 or fewer; an unchanged one 84 % (items their own "
                   "clusters, or 50 clusters), ~100 % with 20 clusters or fewer (no pass before gate.min_clusters_pass)")


def _job_config(overrides: list[str]) -> RunConfig:
    cfg: RunConfig = cli.compose_run(overrides)  # a bad override is a one-line usage error
    cfg.quant = quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups)
    quant.validate_scheme(cfg.quant)
    return cfg


def _offline_tokenizer(model: ModelConfig, cache: Cache) -> tuple[Any, str | None]:
    """The model's tokenizer, or the packaged stand-in when it is not here and the hub cannot be reached."""
    try:
        return _tokenizer_for(model, cache), None
    except (OSError, ValueError) as exc:  # not on the hub cache / unreachable hub; a directory without its files
        if model.source != "hf":
            raise
        stand_in = load_model_config(model.tiny.tokenizer if model.tiny else "smollm2_135m")
        log.warning("tokenizer of %s not available here (%s); counting tokens with %s's", model.path,
                    str(exc).splitlines()[0], stand_in.name)
        return models.load_tokenizer(stand_in, cache), (
            f"{model.name}: tokens counted with {stand_in.name}'s tokenizer ({model.path}'s is neither local "
            "nor in the hub cache); its vocabulary differs, so the counts are approximate — put the tokenizer files "
            "in the hub cache or model.path for exact ones")


def _cuda_elsewhere(model: ModelConfig) -> bool:
    """The job runs on GPUs (cuda, or auto: accelerate over the visible GPUs) and this machine has none:
    plan for them without loading anything."""
    return (model.device.startswith("cuda") or model.device == "auto") and not torch.cuda.is_available()


def roofline(model: ModelConfig, batch: int, gpu: Any) -> Throughput:
    """Rates of ``model`` at ``batch`` sequences on ``gpu`` from its shapes and the GPU's datasheet (see the
    module doc)."""
    from harness.sizing import ledger

    arch = ledger.architecture(model)
    params = arch.total_params()
    bits = torch.finfo(models.torch_dtype(model.dtype)).bits
    flops = ledger.GPU_BF16_FLOPS[gpu.name]
    read = ledger.decode_read_bytes(params * bits / 8, arch.untied_embedding(), bits)
    prefill = flops / (2 * params)
    decode = min(batch * gpu.bandwidth_tbs * 1e12 / read, prefill)
    return Throughput(prefill, decode, 0.0,
                      f"roofline for one {gpu.name} ({model.device} in the config; no CUDA here, nothing loaded): "
                      f"{flops / 1e12:,.0f} TFLOP/s over 2 x {params / 1e9:.3g}B FLOP/token, {gpu.bandwidth_tbs:g} TB/s "
                      f"over {read / 1e9:.3g} GB read per step x batch {batch}; no load time — lower bounds")


def _prepare_model(cfg: RunConfig, tokens_per_s: float | None, decode_tokens_per_s: float | None,
                   gpu: Any = None) -> _Model:
    batch = cfg.eval.batch_size or cfg.model.batch_size
    if tokens_per_s or _cuda_elsewhere(cfg.model):
        tokenizer, note = _offline_tokenizer(cfg.model, Cache(cfg.paths.cache_dir))
        if tokens_per_s:
            rate = Throughput(tokens_per_s, decode_tokens_per_s or tokens_per_s, 0.0, "given (tokens_per_s=)")
        else:
            from harness.sizing import ledger

            gpu = gpu or ledger.resolve_gpus(["H100"])[0]
            rate = roofline(cfg.model, batch, gpu)
            weight_gb = ledger.architecture(cfg.model).total_params() * \
                torch.finfo(models.torch_dtype(cfg.model.dtype)).bits / 8 / 1e9
            if weight_gb + ledger.DEFAULT_RESERVE_GB > gpu.memory_gb:
                fit = (f"{cfg.model.name}: {weight_gb:.1f} GB of {cfg.model.dtype} weights do not fit one {gpu.name} "
                       f"({gpu.memory_gb:.1f} GB): the job needs model.device=auto over several, whose layers run "
                       "one GPU after another, so one GPU's roofline still bounds it")
                note = f"{note}; {fit}" if note else fit
            if decode_tokens_per_s:
                rate = Throughput(rate.prefill_tokens_per_s, decode_tokens_per_s, rate.load_s,
                                  rate.source + "; decode rate given (decode_tokens_per_s=)")
        return _Model(rate, tokenizer, None, note)
    from harness.infra.runtime import apply_threads

    apply_threads(cfg.runtime)  # the rates are measured with the threads the job would use
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    rate = throughput_from_results(Path(cfg.paths.results_dir), cfg.model, current_hardware())
    if rate is None:
        prefill, decode = measure_throughput(loaded, batch)
        rate = Throughput(prefill, decode, loaded.timings.get("load_s", 0.0),
                          f"measured here on {cfg.model.device} ({cfg.model.dtype})")
    if decode_tokens_per_s:
        rate = Throughput(rate.prefill_tokens_per_s, decode_tokens_per_s, rate.load_s,
                          rate.source + "; decode rate given (decode_tokens_per_s=)")
    return _Model(rate, loaded.tokenizer, loaded)


FITTED_STAGES = ("reference", "quantize", "evaluate", "divergence")  # stages whose time is model forwards


def current_hardware() -> str:
    """This machine's hardware label, as :func:`harness.job.stage_meter.hardware` names a past run's."""
    import os

    machine = {"cpus": str(os.cpu_count())}
    if torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name(0)
    return stage_meter.hardware(machine)


def throughput_from_results(results_dir: Path, model: ModelConfig, hardware: str) -> Throughput | None:
    """Rates fitted to finished runs of ``model`` (name, dtype, device) on ``hardware``; None if none.

    Each stage of each run is one equation ``seconds = prefill / P + generated / D``; the
    inverse rates 1/P, 1/D are their non-negative least-squares solution. Where that gives
    one rate as infinite (fixed per-stage costs dominate a small model), P comes from the
    stages without generation and D from what the others' time leaves. None when the runs
    cannot give both rates (no generated tokens, or no time left for them).
    """
    from scipy.optimize import nnls

    rows, loads, runs = [], [], 0
    for path in sorted(results_dir.glob("*/summary.json")) if results_dir.is_dir() else []:
        try:
            summary = json.loads(path.read_text())
            ran = json.loads((path.parent / "config.json").read_text())["model"]
        except (OSError, ValueError, KeyError):
            continue
        if (summary.get("model") != model.name or ran.get("dtype") != model.dtype
                or ran.get("device") != model.device or not summary.get("throughput")
                or stage_meter.hardware(summary.get("machine") or {}) != hardware):
            continue
        stages = [summary["throughput"][s] for s in FITTED_STAGES if s in summary["throughput"]]
        rows += [(s["prefill_tokens"], s["generated_tokens"], s["seconds"]) for s in stages]
        loads.append(float(summary.get("timings", {}).get("load", 0.0)))
        runs += 1
    if not rows or not any(r[1] for r in rows):
        return None
    design = np.array([[r[0], r[1]] for r in rows], dtype=float)
    seconds = np.array([r[2] for r in rows], dtype=float)
    (per_prefill, per_decode), _ = nnls(design, seconds)
    if per_prefill <= 0 or per_decode <= 0:  # the fit gave one kind of token all the time: separate them directly
        prefill_only = design[:, 1] == 0
        if not prefill_only.any() or design[prefill_only, 0].sum() == 0:
            return None
        per_prefill = seconds[prefill_only].sum() / design[prefill_only, 0].sum()
        residual = seconds[~prefill_only].sum() - per_prefill * design[~prefill_only, 0].sum()
        if residual <= 0:
            return None
        per_decode = residual / design[~prefill_only, 1].sum()
    return Throughput(1.0 / per_prefill, 1.0 / per_decode, float(np.median(loads)),
                      f"fitted to {len(rows)} stages of {runs} earlier run(s) in {results_dir} on {hardware} "
                      f"({model.device}, {model.dtype})")


def _reference_plan(name: str, slice_: Slice, spec: ReferenceSpec, counts: SliceTokens, model: _Model,
                    cache: Cache) -> ReferencePlan:
    status = "not checked"
    if model.loaded is not None:
        cached = cache.complete("reference", reference_key(model.loaded, slice_, spec))
        status = "cached" if cached else "to compute"
    seconds = 0.0 if status == "cached" else model.throughput.seconds(counts.forward, counts.generated)
    return ReferencePlan(name, [counts], status, seconds)


def _job_plan(number: int, overrides: list[str], cfg: RunConfig, counted: list[SliceTokens], model: _Model) -> JobPlan:
    # One pass over the calibration set per part that calibrates: the method, static activation or KV scales.
    calibration = len(quant.calibration_passes(cfg.quant)) * cfg.quant.calibration.num_samples * \
        cfg.quant.calibration.seq_len
    status = "not checked"
    if model.loaded is not None:
        finished = run_key(cfg, model.loaded.identity) in finished_run_keys(Path(cfg.paths.results_dir))
        status = "finished (reused)" if finished else "to run"
    seconds = 0.0
    if status != "finished (reused)":
        seconds = model.throughput.load_s + model.throughput.seconds(
            sum(c.forward for c in counted) + calibration, sum(c.generated for c in counted))
    return JobPlan(number, list(overrides), cfg.model.name, cfg.quant.name, cfg.quant.method, counted,
                   calibration, status, seconds)


def finished_run_keys(results_dir: Path) -> set[str]:
    """Run keys of the finished results under ``results_dir`` (those a job would reuse)."""
    keys = set()
    for path in results_dir.glob("*/summary.json") if results_dir.is_dir() else []:
        try:
            keys.add(json.loads(path.read_text())["run_key"])
        except (ValueError, KeyError):
            continue
    return keys


def _structured_container(obj: Any) -> Any:
    return OmegaConf.to_container(OmegaConf.structured(obj), resolve=True)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def format_plan(plan: SweepPlan) -> str:
    """The plan as the table the command prints."""
    import pandas as pd

    def row(job: str, model: str, scheme: str, slices: list[SliceTokens], status: str, calibration: int,
            seconds: float) -> dict[str, Any]:
        totals = {name: sum(getattr(s, name) for s in slices)
                  for name in ("requests", "scored", "prompt", "generated", "divergence")}
        return {"job": job, "model": model, "scheme": scheme, "slices": ",".join(s.slice for s in slices),
                "status": status, **totals, "calibration": calibration, "estimate": _duration(seconds)}

    rows = [row("ref", r.model, "(reference)", r.slices, r.status, 0, r.estimated_s) for r in plan.references]
    rows += [row(str(j.number), j.model, j.scheme, j.slices, j.status, j.calibration, j.estimated_s) for j in plan.jobs]
    lines = [f"Sweep plan: {len(plan.jobs)} job(s), {len(plan.references)} reference(s) (each computed once)"]
    lines += [f"  note: {note}" for note in plan.notes]
    for model_label, rate in plan.throughput.items():
        lines.append(f"  {model_label}: {rate.prefill_tokens_per_s:,.0f} tokens/s forward, "
                     f"{rate.decode_tokens_per_s:,.0f} tokens/s generating; load {rate.load_s:.1f} s — {rate.source}")
    lines.append(pd.DataFrame(rows).to_string(index=False))
    longest = max([j.estimated_s for j in plan.jobs] or [0.0]) + sum(r.estimated_s for r in plan.references)
    lines.append(f"Estimated: {_duration(plan.total_s)} one job after another; at least {_duration(longest)} with all "
                 "jobs in parallel (the references run inside the first job; the others quantize and evaluate "
                 "meanwhile). Generated tokens are upper bounds.")
    return "\n".join(lines)


@dataclass
class PlanOptions:
    tokens_per_s: Optional[float] = field(default=None, metadata={
        "help": "forward tokens/s of the target machine (skips loading and measuring the model)"})
    decode_tokens_per_s: Optional[float] = field(default=None, metadata={
        "help": "generated tokens/s (None: tokens_per_s when given, else measured)"})
    gpu: str = field(default="H100", metadata={
        "help": "GPU a model.device=cuda job is planned for when this machine has none (roofline; H100, H200, ...)"})


TOOL = cli.Tool(prog="python -m harness.plan", options=PlanOptions, run_config=True, flags=("-m", "--multirun"),
                summary="Dry run of `python -m harness -m <overrides>`: one row per job and per reference, the "
                        "tokens each runs through the model and an estimated time. Nothing is evaluated. -m is "
                        "accepted for symmetry with python -m harness; sweeps are always expanded.")


def _plan(parsed: cli.Parsed[PlanOptions]) -> None:
    options = parsed.options
    for name in ("tokens_per_s", "decode_tokens_per_s"):
        value = getattr(options, name)
        if value is not None and value <= 0:
            raise UsageError(f"{name}={value}: give a positive rate, or leave it unset to measure it here")
    plan = plan_sweep(parsed.overrides, tokens_per_s=options.tokens_per_s,
                      decode_tokens_per_s=options.decode_tokens_per_s, gpu=options.gpu)
    print(format_plan(plan))


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(TOOL, _plan, argv)


if __name__ == "__main__":
    sys.exit(main())
