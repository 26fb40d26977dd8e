"""The reference stage: the unquantized model's per-item records and next-token distributions.

Computed once per (model, slice, settings) and cached by :func:`harness.job.identity.reference_key`,
so every scheme of a sweep compares against the same reference. An interrupted computation
resumes from lm-eval's per-request checkpoint next to the cache entry.

In a sweep, a job that finds another live job computing a reference it needs does not wait
with an idle GPU: :func:`reference_unless_busy` returns None for that slice, the job quantizes
and evaluates meanwhile, and :func:`deferred_references` then waits for the entry. The
reference must never be computed with the quantized model (quantization is in place), so if
the other job ended without finishing it, the unquantized model is loaded again and the
reference computed here: the sweep still completes, at the cost of one extra load and, while
the reference runs, both models in memory.

(Not a top-level module ``harness.reference``: a submodule of that name would shadow the public API's
``harness.reference`` function once imported.)
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from harness.config import ModelConfig, RunConfig
from harness.divergence import router
from harness.divergence import scoring as divergence
from harness.divergence.capture import HiddenCapture
from harness.evaluation import evaluate, generation, prompt_log
from harness.evaluation.slices import Slice
from harness.infra import locks
from harness.infra.cache import Cache
from harness.infra.locks import LockTimeout
from harness.job.divergence_texts import divergence_texts, max_divergence_tokens, served_format, served_texts
from harness.job.identity import ReferenceSpec, reference_key, tokenizer_dir
from harness.models import loading as models
from harness.models.hooks import forward_pre_hooks

log = logging.getLogger("harness")


@dataclass
class SliceReference:
    records: pd.DataFrame
    aggregates: dict[str, float]
    texts: list[divergence.ReferenceText]
    cached: bool
    restored_requests: int = 0  # requests read back from an interrupted attempt's checkpoint


def reference(loaded: models.LoadedModel, slice_: Slice, cfg: RunConfig, cache: Cache) -> SliceReference:
    """:func:`compute_reference` with the settings of a run config (the public API's ``harness.reference``)."""
    return compute_reference(loaded, slice_, ReferenceSpec.of(cfg), cache)


def compute_reference(loaded: models.LoadedModel, slice_: Slice, spec: ReferenceSpec, cache: Cache) -> SliceReference:
    """The unquantized model's records and next-token reference for one slice, cached."""
    key = reference_key(loaded, slice_, spec)
    with reference_lock(cache, key, spec.stall_s):
        entry = cache.entry("reference", key)
        cached = read_cached(loaded, slice_, spec, cache)
        if cached is not None:
            return cached
        log.info("reference for slice %s: computing (cache miss %s)", slice_.name, key)
        with forward_pre_hooks([(loaded.model.get_input_embeddings(), lambda *_: locks.progress())]):
            return _compute(loaded, slice_, spec, cache, key, entry)


def reference_lock(cache: Cache, key: str, stall_s: float, timeout: float | None = None) -> locks.OwnedLock:
    """A reference entry's lock; it stops beating when its holder makes no progress for ``stall_s``
    (``runtime.reference_stall_s``: a hung job), so a job waiting for it takes over."""
    return cache.lock("reference", key, timeout=timeout, stall_s=stall_s)


def _compute(loaded: models.LoadedModel, slice_: Slice, spec: ReferenceSpec, cache: Cache, key: str,
             entry: Path) -> SliceReference:
    """The reference computed and stored (the caller holds its lock)."""
    settings = spec.eval_settings(tokenizer_dir(loaded))
    lm = evaluate.make_lm(loaded.model, loaded.tokenizer, settings, checkpoint=spec.checkpoint)
    checkpoint = entry.with_name(f"{key}.checkpoint")  # per-request results of an interrupted attempt
    restored = evaluate.checkpoint_rows(checkpoint)
    captured = capture_for(lm, slice_, spec)  # the served texts' states, from the forwards that answer the items
    try:  # a prompt log's production replies stand for the reference's own where it logged them
        with prompt_log.logged_replies(lm, loaded.tokenizer, prompt_log.reuses_replies(slice_)) as replayed:
            records, aggregates = evaluate.evaluate_slice(lm, slice_, settings, checkpoint=checkpoint)
    finally:
        capture_for(lm, None, spec)
    if replayed["logged"]:
        log.info("reference for slice %s: %d logged replies reused, %d generated", slice_.name, replayed["logged"],
                 replayed["generated"])
    plain = spec.divergence_plain and not slice_.config.divergence_from_reference
    texts: list = divergence_texts(slice_, settings) if plain else []
    if served_format(slice_, spec):  # the items as served: prompt as evaluated + this reference's reply
        texts += served_texts(slice_, records, loaded.tokenizer)
    scored = divergence.score_reference(loaded.model, loaded.tokenizer, texts,
                                        max_tokens=max_divergence_tokens(slice_, spec),
                                        topk=spec.reference_topk, store=spec.reference_store,
                                        captured=captured)
    with cache.writing("reference", key) as tmp:
        records.to_parquet(tmp / "records.parquet")
        pd.Series(aggregates, dtype=float).to_json(tmp / "aggregates.json")
        save_reference_texts(tmp / "divergence.pt", scored, cache, loaded.key)
    evaluate.drop_checkpoint(checkpoint)
    return SliceReference(records, aggregates, scored, False, restored)


def capture_for(lm: object, slice_: Slice | None, spec: ReferenceSpec,
                teacher: dict[tuple[int, ...], tuple[int, ...]] | None = None, hold_bytes: int = 0
                ) -> HiddenCapture | None:
    """Have ``lm`` keep the states of the forwards that answer ``slice_``'s items; None: it cannot.

    For a slice scored on served texts, on the harness's own HF wrapper (other backends keep nothing and the
    divergence stage runs the texts again). ``teacher`` (prompt ids -> the reference's reply ids): replies to
    teacher-force after each prompt's prefill (the quantized side). ``hold_bytes``: without ``teacher`` (the
    reference not read yet), hold the prompts' KV caches up to that many bytes to teacher-force its replies
    later (:func:`teacher_force_held`). ``slice_=None`` stops keeping.
    """
    if not hasattr(lm, "hidden_capture"):
        return None
    if router.num_experts(lm.model):  # type: ignore[attr-defined]
        hold_bytes = 0  # a mixture of experts' texts are run again anyway (its router's selections)
    capture = HiddenCapture(hold_bytes) if slice_ is not None and served_format(slice_, spec) else None
    lm.hidden_capture = capture  # type: ignore[attr-defined]
    lm.teacher = None if capture is None or not teacher else teacher.get  # type: ignore[attr-defined]
    return capture


def teacher_force_held(model: torch.nn.Module, capture: HiddenCapture | None,
                       texts: list[divergence.ReferenceText]) -> None:
    """The reference's replies teacher-forced from the prompt KV caches ``capture`` held for them
    (:func:`capture_for`'s ``hold_bytes``), where the model's own replies do not already give their states."""
    if capture is None or not capture.held:
        return
    replies = {tuple(prompt): tuple(reply) for text in texts if text.captured
               and (pair := text.prompt_and_reply()) is not None for prompt, reply in [pair]}

    def teacher(prompt: tuple[int, ...]) -> tuple[int, ...] | None:
        reply = replies.get(prompt)
        return reply if reply is not None and capture.states(prompt, reply) is None else None

    generation.teacher_force_held(model, capture, teacher)
    if capture.not_held:
        log.info("%d batch(es) of prompt KV caches did not fit runtime.held_kv_gb: their texts are run again",
                 capture.not_held)


def teacher_replies(slice_: Slice, records: pd.DataFrame, tokenizer: object,
                    spec: ReferenceSpec) -> dict[tuple[int, ...], tuple[int, ...]]:
    """The reference's reply to each prompt whose served text the divergence stage scores whole.

    What the quantized side teacher-forces from a prompt's KV cache right after its prefill, so its
    distributions on the reference's reply cost the reply's tokens only. A served text longer than
    ``max_divergence_tokens`` (scored without the start of its prompt) is left out: it is run again.
    """
    if not served_format(slice_, spec):
        return {}
    limit = max_divergence_tokens(slice_, spec)
    return {text.prompt_ids: text.reply_ids for text in served_texts(slice_, records, tokenizer)
            if len(text.prompt_ids) + len(text.reply_ids) <= limit}


def read_cached(loaded: models.LoadedModel, slice_: Slice, spec: ReferenceSpec,
                cache: Cache) -> SliceReference | None:
    """The cached reference of a slice; None when it is missing or damaged (then moved aside, with a warning).

    Call under the entry's lock. ``loaded`` only names the entry (a quantized model may be passed).
    """
    key = reference_key(loaded, slice_, spec)
    if not cache.usable("reference", key):
        return None
    entry = cache.entry("reference", key)
    texts = load_reference_texts(entry / "divergence.pt", cache, loaded.key)
    if texts is None:  # its model's frozen head was damaged: the entry is recomputed with it
        return None
    log.info("reference for slice %s: reused from cache (%s)", slice_.name, entry)
    return SliceReference(pd.read_parquet(entry / "records.parquet"),
                          pd.read_json(entry / "aggregates.json", typ="series").to_dict(), texts, True)


def reference_unless_busy(loaded: models.LoadedModel, slice_: Slice, spec: ReferenceSpec,
                          cache: Cache) -> SliceReference | None:
    """:func:`compute_reference`, or None when another live job holds this reference's lock.

    A free lock (or a stale one, broken with a warning) is taken and the reference computed or
    read here, exactly as :func:`compute_reference` does; only a lock with a live owner defers.
    """
    key = reference_key(loaded, slice_, spec)
    lock = reference_lock(cache, key, spec.stall_s, timeout=0)  # one look: a live owner's lock raises at once
    try:
        lock.acquire()
    except LockTimeout:
        if cache.complete("reference", key):  # finished between the look and now
            return compute_reference(loaded, slice_, spec, cache)
        log.info("reference for slice %s: another job is computing it; quantizing and evaluating meanwhile",
                 slice_.name)
        return None
    try:
        return compute_reference(loaded, slice_, spec, cache)  # the lock is re-entrant within the process
    finally:
        lock.release()


def deferred_references(quantized: models.LoadedModel, slices: list[Slice], spec: ReferenceSpec,
                        cache: Cache, model: ModelConfig) -> dict[str, SliceReference]:
    """The references another job was computing, once ready; computed here if that job gave up.

    ``quantized`` is only used to find and read the cache entries (its identity is the
    unquantized model's). An entry still missing once its lock is free (the other job died or
    failed) is computed, under the lock, with the unquantized model (``model``, from ``cache``'s
    models) loaded again.
    """
    unquantized: models.LoadedModel | None = None
    out = {}
    for slice_ in slices:
        key = reference_key(quantized, slice_, spec)
        # waits for the other job (breaks its lock if it died or stalled)
        with reference_lock(cache, key, spec.stall_s):
            cached = read_cached(quantized, slice_, spec, cache)
            if cached is not None:
                out[slice_.name] = cached
                continue
            log.warning("reference for slice %s: the job computing it ended without finishing it (or its entry "
                        "was damaged); loading the unquantized model again to compute it here", slice_.name)
            if unquantized is None:
                unquantized = models.load(model, cache.root)
            out[slice_.name] = compute_reference(unquantized, slice_, spec, cache)
    return out


def save_reference_texts(path: Path, texts: list[divergence.ReferenceText], cache: Cache, model_key: str) -> None:
    """Save per-token references; the frozen output head is stored once per model, not per slice."""
    head = next((t.head for t in texts if t.head is not None), None)
    if head is not None:
        with cache.lock("heads", model_key):
            if not cache.usable("heads", model_key):
                with cache.writing("heads", model_key) as tmp:
                    torch.save(head, tmp / "head.pt")
    torch.save([dataclasses.replace(t, head=None) for t in texts], path)


def load_reference_texts(path: Path, cache: Cache, model_key: str) -> list[divergence.ReferenceText] | None:
    """Per-token references saved by :func:`save_reference_texts`, with the model's head put back.

    None when the head's entry is missing or damaged (moved aside): the reference is then recomputed.
    """
    texts = torch.load(path, weights_only=False)
    if any(t.hidden is not None for t in texts):
        with cache.lock("heads", model_key):
            if not cache.usable("heads", model_key):
                return None
            head = torch.load(cache.entry("heads", model_key) / "head.pt", weights_only=False)
        texts = [dataclasses.replace(t, head=head if t.hidden is not None else None) for t in texts]
    return texts


def share_heads(references: dict[str, SliceReference]) -> dict[str, SliceReference]:
    """One frozen output head for every slice of a run (they all hold copies of the same model's head).

    The comparison moves the frozen head to the device of the quantized model's head; shared, it is
    moved (and held there) once per run instead of once per slice (~5 GB each at 8B, bf16).
    """
    head = next((t.head for r in references.values() for t in r.texts if t.head is not None), None)
    if head is None:
        return references
    return {name: dataclasses.replace(ref, texts=[dataclasses.replace(t, head=head) if t.head is not None else t
                                                  for t in ref.texts])
            for name, ref in references.items()}
