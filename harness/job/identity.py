"""What a job and its cached pieces *are*: the keys that decide what is reused and what is recomputed.

A finished job is found again by :func:`run_key` (model, scheme, slices and settings; not where
its outputs go or how many threads ran it), a slice's reference by :func:`reference_key` (model,
slice content, the settings that change the reference's numbers, library versions). Those
settings are read from the run config once, into a :class:`ReferenceSpec`. A job's evaluation settings
are derived here too, so that the pipeline, the sweep planner, the sensitivity tool and the benchmarks
build them one way (the divergence texts: :mod:`harness.job.divergence_texts`).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.config import QuantConfig, RunConfig, config_dict
from harness.evaluation import evaluate, thinking
from harness.evaluation.slices import Slice
from harness.infra.cache import file_sha256, stable_hash
from harness.job.divergence_texts import SERVED_FORMAT, served_format
from harness.models import loading as models

# Config sections that say where results go or how a job runs, not what it computes.
TRANSIENT_SECTIONS = ("tracking", "paths", "force", "runtime", "gate", "perf", "prompts")  # prompts: via its slice
# The built-in methods' settings had run-config sections of their own until every method's moved to quant.settings.
# A run key keeps that layout, so that runs from before are found again: each section at the defaults it then had,
# the scheme's own method's section its settings (defaults filled), quant.settings empty.
SETTINGS_SECTIONS = {
    "gptq": {"damp_percent": 0.01, "block_size": 128, "act_order": False, "static_groups": True},
    "awq": {"grid": 20, "duo_scaling": False, "clip": True, "clip_grid": 20, "max_shrink": 0.5, "search_samples": 4,
            "coarse_to_fine": True},
    "smoothquant": {"alpha": 0.5},
}


@dataclass(frozen=True)
class ReferenceSpec:
    """What a slice's reference is computed with, besides the model and the slice, read once from the
    run config (:meth:`of`): the reference stage, its cache keys, the disk estimate and the plan take this
    instead of the whole config. The first group is in the reference's cache key; the second says how it
    is computed, not what."""

    chat_template: bool  # model.chat_template
    max_length: int  # model.max_length
    device: str  # model.device
    seed: int  # eval.seed
    backend: str  # eval.backend
    generator: str  # eval.generator
    max_gen_toks: int | None  # eval.max_gen_toks
    divergence_max_tokens: int  # eval.divergence_max_tokens (a slice's metadata may set its own)
    divergence_plain: bool  # eval.divergence_plain
    reference_store: str  # eval.reference_store
    reference_topk: int  # eval.reference_topk
    batch_size: int  # eval.batch_size, else the model's
    checkpoint: str | None  # model.path: what a backend that serves checkpoints loads (None: no path)
    process: str  # runtime.reference_process: auto | true | false
    stall_s: float  # runtime.reference_stall_s
    decode_rows: int | None = None  # runtime.decode_rows
    thinking: Any = None  # harness.evaluation.thinking.ThinkingSpec: model.thinking and eval.thinking_budget

    @classmethod
    def of(cls, cfg: RunConfig) -> ReferenceSpec:
        return cls(chat_template=cfg.model.chat_template, max_length=cfg.model.max_length, device=cfg.model.device,
                   seed=cfg.eval.seed, backend=cfg.eval.backend, generator=cfg.eval.generator,
                   max_gen_toks=cfg.eval.max_gen_toks, divergence_max_tokens=cfg.eval.divergence_max_tokens,
                   divergence_plain=cfg.eval.divergence_plain, reference_store=cfg.eval.reference_store,
                   reference_topk=cfg.eval.reference_topk, batch_size=cfg.eval.batch_size or cfg.model.batch_size,
                   checkpoint=cfg.model.path or None, process=str(cfg.runtime.reference_process),
                   stall_s=cfg.runtime.reference_stall_s, decode_rows=cfg.runtime.decode_rows,
                   thinking=thinking.spec_of(cfg))

    def eval_settings(self, tokenizer_path: str | None) -> evaluate.EvalSettings:
        """The lm-eval settings both models are evaluated with."""
        return evaluate.EvalSettings(batch_size=self.batch_size, max_length=self.max_length, device=self.device,
                                     chat_template=self.chat_template, seed=self.seed, tokenizer_path=tokenizer_path,
                                     backend=self.backend, generator=self.generator, max_gen_toks=self.max_gen_toks,
                                     decode_rows=self.decode_rows, thinking=self.thinking)


def eval_settings(cfg: RunConfig, tokenizer_path: str | None) -> evaluate.EvalSettings:
    """The lm-eval settings of a job (batch size falls back to the model's)."""
    return ReferenceSpec.of(cfg).eval_settings(tokenizer_path)


def tokenizer_dir(loaded: models.LoadedModel) -> str | None:
    """The loaded tokenizer's local directory (slices that count tokens load it), or None."""
    path = getattr(loaded.tokenizer, "name_or_path", None)
    return path if path and Path(path).exists() else None


def input_file_digest(path: Any) -> str | None:
    """The content digest of a slice's input file or directory (``slices.<name>.metadata.path``), None when unset or
    absent (the generator then says what is wrong)."""
    if path in (None, ""):
        return None
    where = Path(str(path)).expanduser()
    if where.is_file():
        return file_sha256(where)[:16]
    if where.is_dir():
        return stable_hash({str(p.relative_to(where)): file_sha256(p)[:16]
                            for p in sorted(where.rglob("*")) if p.is_file()}, 16)
    return None


def slice_identity(slice_: Slice) -> dict[str, Any]:
    """Everything that determines a slice's items and prompts (files hashed by content)."""
    files = {}
    if slice_.directory is not None:
        for path in sorted(slice_.directory.glob("*")):
            if path.suffix in (".py", ".yaml", ".json", ".jsonl", ".txt"):
                files[path.name] = file_sha256(path)[:16]
    logged = input_file_digest(slice_.config.metadata.get("path"))
    if logged:  # a prompt log outside the slice's directory (prompts.path): its content, not only its name
        files["metadata.path"] = logged
    return {"name": slice_.name, "config": _unset_design_dropped(dataclasses.asdict(slice_.config)), "files": files}


DESIGN_FIELDS = ("stratum_field", "cluster_field")  # slices.<name>: unset, they leave every key as it was


def _unset_design_dropped(slice_config: dict) -> dict:
    """A slice config without its unset sampling-design fields, so keys of slices that set none stay the same."""
    return {key: value for key, value in slice_config.items() if not (key in DESIGN_FIELDS and value is None)}


def reference_key(loaded: models.LoadedModel, slice_: Slice, spec: ReferenceSpec) -> str:
    """Cache key of one slice's reference: the model, the slice's content and the settings that change it."""
    settings = {"chat_template": spec.chat_template, "max_length": spec.max_length, "seed": spec.seed,
                "divergence_max_tokens": spec.divergence_max_tokens, "store": spec.reference_store,
                "topk": spec.reference_topk, **({"backend": spec.backend} if spec.backend != "hf" else {}),
                "generator": spec.generator,
                **({"max_gen_toks": spec.max_gen_toks} if spec.max_gen_toks is not None else {}),
                "lm_eval": _version("lm_eval"), "transformers": _version("transformers"), "device": spec.device,
                "records": 2}  # 2: records carry each item's doc_id (sequential rounds select items by it)
    thinks = spec.thinking.identity() if spec.thinking is not None else None
    if thinks:  # a thinking reference is not a plain one (unset: the keys stay as they were)
        settings["thinking"] = thinks
    if served_format(slice_, spec):  # its divergence texts are its items' prompts + this reference's replies
        settings["divergence"] = SERVED_FORMAT
    if not spec.divergence_plain:  # no gold texts (the keys of references that hold them stay as they were)
        settings["plain_texts"] = False
    return stable_hash({"model": loaded.identity, "slice": slice_identity(slice_), "settings": settings}, 24)


@functools.cache  # parsing a package's METADATA costs ~4.5 ms, and every slice's reference key asks twice
def _version(package: str) -> str:
    from importlib.metadata import version
    return version(package.replace("_", "-"))


def keyed_quant(scheme: QuantConfig, data: dict) -> dict:
    """The scheme's plain ``data`` as a run key holds it: in the layout of :data:`SETTINGS_SECTIONS`."""
    from harness.quant import method_settings

    keyed = {**data, **{name: dict(defaults) for name, defaults in SETTINGS_SECTIONS.items()}}
    if scheme.method in SETTINGS_SECTIONS:
        keyed[scheme.method] = dataclasses.asdict(method_settings(scheme))
        keyed["settings"] = {}
    return keyed


# how a served side is reached and paced, not what answers: not part of a run key
_REFERENCE_TRANSIENT = ("endpoint_api_key_env", "endpoint_timeout_s", "endpoint_batch_size",
                        "endpoint_max_requests_per_s", "serve_startup_s")
_JUDGE_TRANSIENT = ("api_key_env", "concurrency", "max_requests_per_s", "timeout_s", "serve_startup_s")
THINKING_MODEL_FIELDS = ("thinking", "think_start", "think_end", "enable_thinking")


def run_key(cfg: RunConfig, model_identity: dict | None = None) -> str:
    """Identity of a job's result: model, scheme, slices and settings (not tracking/paths/runtime)."""
    data = config_dict(cfg)
    data["quant"] = keyed_quant(cfg.quant, data["quant"])
    for transient in TRANSIENT_SECTIONS:
        data.pop(transient, None)
    data["slices"] = {name: _unset_design_dropped(dict(config)) for name, config in (data.get("slices") or {}).items()}
    for name, config in data["slices"].items():  # a prompt log is keyed by its content too
        logged = input_file_digest((config.get("metadata") or {}).get("path"))
        if logged:
            config["input_digest"] = logged
    if cfg.eval.sequential:  # where a slice stops depends on the gate's level and margins
        data["sequential_stop"] = {"alpha": cfg.gate.alpha, "margin": cfg.gate.margin, "margins": dict(cfg.gate.margins),
                                   "slices": list(cfg.gate.slices), "correction": cfg.gate.correction}
    else:  # keys of runs from before the option existed stay the same
        data["eval"].pop("sequential", None)
        data["eval"].pop("sequential_round_items", None)
        data["eval"].pop("sequential_method", None)
    if cfg.eval.max_gen_toks is None:  # likewise
        data["eval"].pop("max_gen_toks", None)
    if thinking.spec_of(cfg).identity() is None:  # likewise: a model that does not think keeps its keys
        for key in THINKING_MODEL_FIELDS:
            data["model"].pop(key, None)
        data["eval"].pop("thinking_budget", None)
    if not (cfg.candidate.endpoint or cfg.candidate.serve):  # only a served candidate's token divergence reads it
        data["candidate"].pop("endpoint_divergence_topk", None)
    if not (cfg.candidate.endpoint or cfg.candidate.serve) or cfg.candidate.endpoint_concurrency == 1:
        data["candidate"].pop("endpoint_concurrency", None)  # likewise; at 1 the keys stay as they were
    data["candidate"].pop("endpoint_max_requests_per_s", None)  # a rate limit changes no reply
    if cfg.reference.endpoint or cfg.reference.serve:  # a served reference: what answered is part of the result
        data["reference"] = {k: v for k, v in data["reference"].items() if k not in _REFERENCE_TRANSIENT}
    else:  # an in-process reference: keys stay as they were
        data.pop("reference", None)
    if cfg.judge.endpoint or cfg.judge.serve:  # the judge's verdicts are part of the result
        data["judge"] = {k: v for k, v in data["judge"].items() if k not in _JUDGE_TRANSIENT}
    else:
        data.pop("judge", None)
    return stable_hash({"config": data, "model": model_identity}, 16)


def run_name(cfg: RunConfig) -> str:
    """The run's display name: tracking.run_name, else <model>/<scheme>/<slices>."""
    return cfg.tracking.run_name or f"{cfg.model.name}/{cfg.quant.name}/{'+'.join(cfg.slices)}"


