"""The pipeline of one job, top to bottom: config → model → reference → quantize →
evaluate → divergence → compare → results on disk → MLflow.

Each stage is a function of plain data so a notebook can run them one at a time
(see the README's Python API). Expensive stages are preceded by every check that can be
made in advance, and the reference (the unquantized model's per-item records and
next-token distributions) is cached by content hash, so every scheme of a sweep reuses it.
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

from harness import divergence, evaluate, models, quant, report, summary, sweep, tracking
from harness.cache import Cache, atomic_write_json, atomic_write_text, file_sha256, stable_hash
from harness.config import RunConfig
from harness.slices import Slice, check_hub_for_registry, resolve

log = logging.getLogger("harness")


@dataclass
class Timings:
    stages: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        log.info("▶ %s", name)
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - start


@dataclass
class SliceReference:
    records: pd.DataFrame
    aggregates: dict[str, float]
    texts: list[divergence.ReferenceText]
    cached: bool
    restored_requests: int = 0  # requests read back from an interrupted attempt's checkpoint


def to_config(cfg: DictConfig | RunConfig) -> RunConfig:
    if isinstance(cfg, RunConfig):
        return cfg
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def config_dict(cfg: RunConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def eval_settings(cfg: RunConfig, tokenizer_path: str | None) -> evaluate.EvalSettings:
    return evaluate.EvalSettings(batch_size=cfg.eval.batch_size or cfg.model.batch_size, max_length=cfg.model.max_length,
                                 device=cfg.model.device, chat_template=cfg.model.chat_template, seed=cfg.eval.seed,
                                 tokenizer_path=tokenizer_path)


def slice_identity(slice_: Slice) -> dict[str, Any]:
    """Everything that determines a slice's items and prompts (files hashed by content)."""
    files = {}
    if slice_.directory is not None:
        for path in sorted(slice_.directory.glob("*")):
            if path.suffix in (".py", ".yaml", ".json", ".jsonl", ".txt"):
                files[path.name] = file_sha256(path)[:16]
    return {"name": slice_.name, "config": dataclasses.asdict(slice_.config), "files": files}


def reference_key(loaded: models.LoadedModel, slice_: Slice, cfg: RunConfig) -> str:
    settings = {"chat_template": cfg.model.chat_template, "max_length": cfg.model.max_length, "seed": cfg.eval.seed,
                "divergence_max_tokens": cfg.eval.divergence_max_tokens, "store": cfg.eval.reference_store,
                "topk": cfg.eval.reference_topk,
                "lm_eval": _version("lm_eval"), "transformers": _version("transformers"), "device": cfg.model.device}
    return stable_hash({"model": loaded.identity, "slice": slice_identity(slice_), "settings": settings}, 24)


def _version(package: str) -> str:
    from importlib.metadata import version
    return version(package.replace("_", "-"))


def run_key(cfg: RunConfig, model_identity: dict | None = None) -> str:
    """Identity of a job's result: model, scheme, slices and settings (not tracking/paths)."""
    data = config_dict(cfg)
    for transient in ("tracking", "paths", "force"):
        data.pop(transient, None)
    return stable_hash({"config": data, "model": model_identity}, 16)


def run_name(cfg: RunConfig) -> str:
    return cfg.tracking.run_name or f"{cfg.model.name}/{cfg.quant.name}/{'+'.join(cfg.slices)}"


def tokenizer_dir(loaded: models.LoadedModel, cfg: RunConfig) -> str | None:
    path = getattr(loaded.tokenizer, "name_or_path", None)
    return path if path and Path(path).exists() else None


def compute_reference(loaded: models.LoadedModel, slice_: Slice, cfg: RunConfig, cache: Cache) -> SliceReference:
    """The unquantized model's records and next-token reference for one slice, cached."""
    key = reference_key(loaded, slice_, cfg)
    with cache.lock("reference", key):
        entry = cache.entry("reference", key)
        if cache.complete("reference", key):
            log.info("reference for slice %s: reused from cache (%s)", slice_.name, entry)
            texts = load_reference_texts(entry / "divergence.pt", cache, loaded.key)
            return SliceReference(pd.read_parquet(entry / "records.parquet"),
                                  pd.read_json(entry / "aggregates.json", typ="series").to_dict(), texts, True)
        log.info("reference for slice %s: computing (cache miss %s)", slice_.name, key)
        settings = eval_settings(cfg, tokenizer_dir(loaded, cfg))
        lm = evaluate.make_lm(loaded.model, loaded.tokenizer, settings)
        checkpoint = entry.with_name(f"{key}.checkpoint")  # per-request results of an interrupted attempt
        restored = evaluate.checkpoint_rows(checkpoint)
        records, aggregates = evaluate.evaluate_slice(lm, slice_, settings, checkpoint=checkpoint)
        texts = divergence_texts(slice_, cfg, settings)
        scored = divergence.score_reference(loaded.model, loaded.tokenizer, texts,
                                            max_tokens=max_divergence_tokens(slice_, cfg),
                                            topk=cfg.eval.reference_topk, store=cfg.eval.reference_store)
        with cache.writing("reference", key) as tmp:
            records.to_parquet(tmp / "records.parquet")
            pd.Series(aggregates, dtype=float).to_json(tmp / "aggregates.json")
            save_reference_texts(tmp / "divergence.pt", scored, cache, loaded.key)
        evaluate.drop_checkpoint(checkpoint)
        return SliceReference(records, aggregates, scored, False, restored)


def save_reference_texts(path: Path, texts: list[divergence.ReferenceText], cache: Cache, model_key: str) -> None:
    """Save per-token references; the frozen output head is stored once per model, not per slice."""
    head = next((t.head for t in texts if t.head is not None), None)
    if head is not None:
        with cache.lock("heads", model_key):
            if not cache.complete("heads", model_key):
                with cache.writing("heads", model_key) as tmp:
                    torch.save(head, tmp / "head.pt")
    torch.save([dataclasses.replace(t, head=None) for t in texts], path)


def load_reference_texts(path: Path, cache: Cache, model_key: str) -> list[divergence.ReferenceText]:
    texts = torch.load(path, weights_only=False)
    if any(t.hidden is not None for t in texts):
        head = torch.load(cache.entry("heads", model_key) / "head.pt", weights_only=False)
        texts = [dataclasses.replace(t, head=head if t.hidden is not None else None) for t in texts]
    return texts


def max_divergence_tokens(slice_: Slice, cfg: RunConfig) -> int:
    limit = slice_.config.metadata.get("divergence_max_tokens", cfg.eval.divergence_max_tokens)
    return min(int(limit), cfg.model.max_length)


def divergence_texts(slice_: Slice, cfg: RunConfig, settings: evaluate.EvalSettings) -> list[str]:
    if slice_.directory is None:
        return []
    return slice_.divergence_texts(**slice_.metadata(cfg.eval.seed, settings.tokenizer_path, settings.max_length))


def prepare_results_dir(cfg: RunConfig, key: str) -> Path:
    root = Path(cfg.paths.results_dir)
    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", run_name(cfg).replace("/", "__"))
    directory = root / f"{safe}__{key[:8]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise PermissionError(f"cannot write results to {directory} ({exc.strerror}); set paths.results_dir to a "
                              "writable directory") from None
    return directory


def run(cfg: DictConfig | RunConfig) -> dict[str, Any]:
    """Run one job; returns the summary (also written to results/<run>/summary.json)."""
    cfg = to_config(cfg)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # per-request INFO lines drown the stage log
    cfg.quant = quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups)
    cfg.tracking.tags = sweep.tags_with_sweep_id(cfg.tracking.tags)  # harness.sweep_id groups a sweep's runs
    timings = Timings()
    # -- checks that cost nothing, before anything expensive ------------------------------
    slices = resolve(cfg.slices)
    check_hub_for_registry(slices)
    quant.validate_scheme(cfg.quant)
    models.check_available(cfg.model)
    uri = tracking.resolve_uri(cfg.tracking.uri)
    tracking_problem = tracking.check_tracking(uri) if cfg.tracking.enabled else None
    if tracking_problem:
        log.warning("TRACKING UNAVAILABLE: %s", tracking_problem)
    cache = Cache(cfg.paths.cache_dir)

    with timings.stage("load"):
        loaded = models.load(cfg.model, cfg.paths.cache_dir)
    quant.validate_for_model(loaded.model, cfg.quant)
    from harness.placement import check_quantizable  # device=auto with disk offload: weights are not in place
    check_quantizable(loaded.model, cfg.quant.weights is not None or cfg.quant.method != "rtn")
    key = run_key(cfg, loaded.identity)
    results_dir = prepare_results_dir(cfg, key)
    if (results_dir / "summary.json").exists() and not cfg.force:
        log.info("finished results for this config exist in %s; reusing them (force=true recomputes)", results_dir)
        existing = pd.read_json(results_dir / "summary.json", typ="series").to_dict()
        _log_to_mlflow(results_dir, cfg, uri, tracking_problem)
        return existing
    checkpoint = results_dir / "checkpoint"  # lm-eval's per-request results: a killed job resumes from them
    if cfg.force:
        shutil.rmtree(checkpoint, ignore_errors=True)

    references: dict[str, SliceReference] = {}
    with timings.stage("reference"):
        for slice_ in slices:
            references[slice_.name] = compute_reference(loaded, slice_, cfg, cache)

    with timings.stage("quantize"):
        context = _quant_context(loaded, cfg, cache)
        quant_report = quant.apply(loaded.model, cfg.quant, context)

    settings = eval_settings(cfg, tokenizer_dir(loaded, cfg))
    quant_records, tokens, aggregates, restored, requests = [], [], {}, {}, {}
    with timings.stage("evaluate"):
        lm = evaluate.make_lm(loaded.model, loaded.tokenizer, settings)
        for slice_ in slices:
            restored[slice_.name] = evaluate.checkpoint_rows(checkpoint / slice_.name)
            records, agg = evaluate.evaluate_slice(lm, slice_, settings, checkpoint=checkpoint / slice_.name)
            requests[slice_.name] = evaluate.checkpoint_rows(checkpoint / slice_.name)
            quant_records.append(records)
            aggregates.update(agg)
    with timings.stage("divergence"):
        for slice_ in slices:
            tokens.append(divergence.compare_to_reference(loaded.model, references[slice_.name].texts, slice_.name))

    comparison = summary.build(pd.concat([r.records for r in references.values()], ignore_index=True),
                               pd.concat(quant_records, ignore_index=True), pd.concat(tokens, ignore_index=True),
                               cfg.compare, list(cfg.eval.position_buckets),
                               lambda text: loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
    from harness.report_quant import decode_floor_metrics
    quant_summary = {**quant_report.summary(), **decode_floor_metrics(decode_floor(quant_report, cfg))}
    result = {
        "run_key": key, "run_name": run_name(cfg), "model": cfg.model.name, "scheme": cfg.quant.name,
        "method": cfg.quant.method, "slices": list(cfg.slices), "metrics": comparison.metrics(),
        "timings": {**timings.stages, **{f"model_{k}": v for k, v in loaded.timings.items()}},
        "quant": quant_summary, "reference_cached": {n: r.cached for n, r in references.items()},
        "lm_eval_aggregates": {"reference": {k: v for r in references.values() for k, v in r.aggregates.items()},
                               "quantized": aggregates},
        "machine": _machine(), "tags": dict(cfg.tracking.tags), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "checkpoint": {"restored_requests": restored, "requests": requests,
                       "reference_restored_requests": {n: r.restored_requests for n, r in references.items()}},
    }
    with timings.stage("write"):
        write_results(results_dir, cfg, comparison, tokens, quant_report, result)
        shutil.rmtree(checkpoint, ignore_errors=True)  # the results it protected are on disk now
    report.print_comparison(comparison, result)
    with timings.stage("logging"):
        _log_to_mlflow(results_dir, cfg, uri, tracking_problem)
    result["timings"].update(timings.stages)
    atomic_write_json(results_dir / "summary.json", result)
    log.info("results: %s", results_dir)
    return result


def _quant_context(loaded: models.LoadedModel, cfg: RunConfig, cache: Cache) -> Any:
    from harness.quant.calibration import CalibrationContext
    from harness.devices import AUTO, compute_device, module_device
    # device=auto: calibration starts where the embeddings live; each block computes where it lives.
    device = (module_device(loaded.model.get_input_embeddings()) if cfg.model.device == AUTO
              else compute_device(cfg.model.device))
    return CalibrationContext(model_key=loaded.key, tokenizer=loaded.tokenizer, config=cfg.quant.calibration,
                              device=device, cache=cache, scheme=cfg.quant)


def write_results(directory: Path, cfg: RunConfig, comparison: summary.Comparison, tokens: list[pd.DataFrame],
                  quant_report: quant.QuantReport, result: dict) -> None:
    """Everything a later reader needs; summary.json is written last and marks completion."""
    config = config_dict(cfg)
    atomic_write_json(directory / "config.json", config)
    atomic_write_text(directory / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(config)))
    _write_parquet(comparison.items, directory / "items.parquet")
    _write_parquet(comparison.item_stats, directory / "item_stats.parquet")
    _write_parquet(pd.concat(tokens, ignore_index=True), directory / "tokens.parquet")
    _write_parquet(comparison.token_stats, directory / "token_stats.parquet")
    _write_parquet(comparison.generation, directory / "generation.parquet")
    _write_parquet(pd.DataFrame(quant_report.to_records()), directory / "quant_layers.parquet")
    decode_floor(quant_report, cfg).to_csv(directory / "decode_floor.csv", index=False)
    atomic_write_text(directory / "report.md", report.markdown(comparison, result))
    atomic_write_json(directory / "summary.json", result)


def decode_floor(quant_report: quant.QuantReport, cfg: RunConfig) -> pd.DataFrame:
    """Batch-1 decode floor (weight bytes / bandwidth) of this model and of 8B/70B at its bits/weight."""
    from harness.report_quant import DEFAULT_GPUS, GPU_BANDWIDTH, decode_floor_table
    return decode_floor_table(quant_report, {g: GPU_BANDWIDTH[g] for g in DEFAULT_GPUS}, model_name=cfg.model.name)


def _write_parquet(frame: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(".parquet.tmp")
    frame.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def _log_to_mlflow(results_dir: Path, cfg: RunConfig, uri: str, problem: str | None) -> None:
    if not cfg.tracking.enabled:
        return
    if problem:
        log.warning("not logged to MLflow (%s). Later: python -m harness.sync %s", problem, results_dir)
        return
    try:
        run_id = tracking.log_results(results_dir, uri=uri, experiment=cfg.tracking.experiment,
                                      tags=cfg.tracking.tags)
        log.info("MLflow run %s in %s (experiment %s)", run_id, uri, cfg.tracking.experiment)
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
