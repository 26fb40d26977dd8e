"""The staged production comparison: the deployed reference and the candidate, both served, on the same items.

``reference.endpoint=<url>`` (or ``reference.serve="<command with {port}>"``) beside ``candidate.endpoint`` /
``candidate.serve`` sends every item of the run's slices (a team's prompt log included: ``slices=prompts``) to
the deployment that serves today and to the one that would replace it, as shadow traffic, and pairs their
answers exactly as an in-process comparison does: flips, the clustered intervals, the gold-free outcomes of a
prompt log, the report, MLflow and the gate are unchanged. The question it answers: what changes for our users
if we swap this deployment.

How each side is asked. Both servers are answered through the same engine code (:mod:`harness.engines.served`)
with the prompts of one lm-eval wrapper of ``model=`` (its tokenizer and chat template; the model's weights are
loaded but never run for an item), so the requests are the same by construction: each item's prompt text, token
cap, stop strings and greedy decoding. :func:`check_same_requests` checks it per item all the same (prompt and
token cap in both sides' records) and ends the run in one line if the two ever differ. Each server's echoed prompt
tokens are checked against ``model=``'s tokenizer, so two deployments of different models or tokenizers are
refused at the first item. Rate limits: ``*.endpoint_max_requests_per_s`` paces the requests started, and an
HTTP 429 is waited out (its Retry-After). The reference's answers are kept per request in the run's checkpoint,
so a failure resumes as for any served candidate; they are not cached across runs (a live deployment can change
behind the same URL).

Token divergence. The reference server's teacher-forced top-k log-probs along each divergence text (the prompt as
evaluated + the reference's own reply) become the reference's stored top-k (:class:`ReferenceText` with
``topk_ids``), and the candidate server's top-k on the same token ids is compared with them on the partition
{tokens both sides named} ∪ {the rest} (:func:`harness.divergence.topk_bound.partition_kl_topk_reference`).
Merging tokens into one cell can only lose divergence, so the KL is a LOWER BOUND of the exact KL(reference ‖
candidate) (looser than with an in-process reference, whose full distribution gives a cell to every token the
candidate named); NLL of the reference's reply and top-1 agreement are exact. Every token row, the summary's
``candidate.divergence`` line and the report say so.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from harness.config import CandidateConfig, ReferenceConfig, RunConfig
from harness.divergence import topk_bound
from harness.divergence.scoring import ReferenceText, prompt_length, tokenize
from harness.engines import served_config
from harness.engines.openai_http import redact_url
from harness.engines.served import ServedCandidate
from harness.errors import UsageError
from harness.evaluation import evaluate, prompt_log
from harness.evaluation.slices import Slice
from harness.job.divergence_texts import divergence_texts, max_divergence_tokens, served_format, served_texts
from harness.job.identity import ReferenceSpec, tokenizer_dir

log = logging.getLogger("harness")

BOTH_SERVED_LINE = ("staged comparison, both sides served: KL from the two servers' top-{k} log-probs is KL on the "
                    "partition of tokens both named plus the rest, a LOWER BOUND of the exact KL(reference ‖ "
                    "candidate); NLL, perplexity and top-1 agreement are exact")


def is_served(cfg: RunConfig) -> bool:
    """Whether the run's reference is a served deployment (``reference.endpoint`` / ``reference.serve``)."""
    return bool(cfg.reference.endpoint or cfg.reference.serve)


def describe(cfg: RunConfig) -> str:
    """What the reference is, in one phrase for headers: the served deployment, not ``model=``'s weights."""
    where = redact_url(cfg.reference.endpoint) if cfg.reference.endpoint else "the server reference.serve starts"
    model = f"{cfg.reference.endpoint_model} " if cfg.reference.endpoint_model else ""
    return f"the served reference ({model}at {where}; prompts built with {cfg.model.name}'s tokenizer and template)"


def as_candidate_config(ref: ReferenceConfig) -> CandidateConfig:
    """The served reference's settings in the form the served-engine code reads (the fields are the same)."""
    return CandidateConfig(endpoint=ref.endpoint, serve=ref.serve, endpoint_model=ref.endpoint_model,
                           endpoint_api_key_env=ref.endpoint_api_key_env, endpoint_timeout_s=ref.endpoint_timeout_s,
                           endpoint_batch_size=ref.endpoint_batch_size,
                           endpoint_concurrency=ref.endpoint_concurrency,
                           endpoint_max_requests_per_s=ref.endpoint_max_requests_per_s,
                           endpoint_divergence_topk=ref.endpoint_divergence_topk, serve_startup_s=ref.serve_startup_s)


def check_config(cfg: RunConfig) -> None:
    """Refuse, before any work, a served reference the job could not pair or that would log a secret."""
    if not is_served(cfg):
        return
    if not (cfg.candidate.endpoint or cfg.candidate.serve):
        raise UsageError("reference.endpoint/reference.serve is a served reference, and the staged comparison pairs "
                         "it with a served candidate: give candidate.endpoint=<URL> or candidate.serve=<command> "
                         "(with quant=external), or drop reference.* to compute the reference from model= here")
    if cfg.eval.backend != "hf":
        raise UsageError(f"eval.backend={cfg.eval.backend} runs the models in this process; with both sides served "
                         "nothing runs here: drop eval.backend (the prompts are built by model='s tokenizer)")
    try:
        served_config.check_config(as_candidate_config(cfg.reference), "external")
    except UsageError as error:  # the same checks as a served candidate's, named for this side
        raise UsageError(str(error).replace("candidate.", "reference.")) from None
    for key in ("endpoint", "serve"):
        ours, theirs = getattr(cfg.reference, key), getattr(cfg.candidate, key)
        if ours and theirs and ours == theirs and cfg.reference.endpoint_model == cfg.candidate.endpoint_model:
            log.warning("reference.%s and candidate.%s are the same (%s): the run compares a deployment with itself "
                        "(a noise floor, not a comparison)", key, key, redact_url(ours) if key == "endpoint" else ours)


class ServedReference:
    """The reference side of a staged comparison: its server, its answers and its top-k along the texts."""

    def __init__(self, cfg: RunConfig, results_dir: Path):
        self.cfg = cfg
        self.served = ServedCandidate(as_candidate_config(cfg.reference), Path(results_dir) / "reference",
                                      role="reference")
        self.params: dict[str, Any] = {
            "reference.served": True,
            "reference.endpoint": redact_url(cfg.reference.endpoint) if cfg.reference.endpoint else "serve"}

    def start(self) -> ServedReference:
        self.served.start()
        model = self.served.engine.model
        if model is not None:
            self.params["reference.served_model"] = model.name
        self.params["reference.engine"] = self.served.engine_name
        return self

    def stop(self) -> None:
        usage = self.served.engine.usage() if self.served._lm is not None else {}
        self.params.update({f"reference.endpoint_{key}": value for key, value in usage.items()})
        self.served.stop()

    def references(self, loaded: Any, slices: list[Slice], spec: ReferenceSpec, checkpoint: Path) -> dict:
        """Every slice's reference from the server: its records (answers, resuming from ``checkpoint``) and its
        top-k log-probs along the slice's divergence texts."""
        from harness.job.reference import SliceReference

        settings = spec.eval_settings(tokenizer_dir(loaded))
        lm = self.served.lm(evaluate.make_lm(loaded.model, loaded.tokenizer, settings))
        found = {}
        for slice_ in slices:
            slice_checkpoint = checkpoint / slice_.name
            restored = evaluate.checkpoint_rows(slice_checkpoint)
            log.info("reference for slice %s: asking the served reference", slice_.name)
            with prompt_log.logged_replies(lm, loaded.tokenizer, prompt_log.reuses_replies(slice_)):
                records, aggregates = evaluate.evaluate_slice(lm, slice_, settings, checkpoint=slice_checkpoint)
            plain = spec.divergence_plain and not slice_.config.divergence_from_reference
            texts: list = divergence_texts(slice_, settings) if plain else []
            if served_format(slice_, spec):
                texts += served_texts(slice_, records, loaded.tokenizer)
            scored = self.score(texts, loaded.tokenizer, max_divergence_tokens(slice_, spec))
            found[slice_.name] = SliceReference(records, aggregates, scored, False, restored)
        return found

    def score(self, texts: list, tokenizer: Any, max_tokens: int) -> list[ReferenceText]:
        """The reference server's teacher-forced top-k along each text, as a stored top-k reference; texts longer
        than the server's context are left out (and counted in the log)."""
        k = int(self.cfg.reference.endpoint_divergence_topk)
        if not texts or k == 0:
            return []
        limit = self.served.engine.model.max_len if self.served.engine.model is not None else None
        ids = [tokenize(tokenizer, text, max_tokens) for text in texts]
        kept = [i for i, t in enumerate(ids) if limit is None or len(t) <= limit]
        if len(kept) < len(ids):
            log.warning("served reference: %d divergence texts longer than its max_model_len not scored",
                        len(ids) - len(kept))
        try:
            answers = self.served.engine.prompt_logprobs([ids[i].tolist() for i in kept], k, tokenizer)
        except topk_bound.NoPromptLogprobs as exc:
            log.warning("served reference: no token divergence (%s)", exc)
            self.params["reference.divergence"] = f"none: {exc}"
            return []
        return [as_reference_text(ids[i], answer, prompt_length(texts[i], max_tokens))
                for i, answer in zip(kept, answers)]


def as_reference_text(input_ids: torch.Tensor, served: topk_bound.ServedLogprobs,
                      prompt_tokens: int | None) -> ReferenceText:
    """A server's teacher-forced log-probs of one text as a reference stored by its top-k: the log-prob and top-1
    of each position exact, its distribution known on the named tokens only."""
    top_ids = torch.from_numpy(served.top_ids.astype(np.int64))
    top_logp = torch.from_numpy(np.nan_to_num(served.top_logprobs.astype(np.float64), nan=-np.inf))
    masked = torch.where(top_ids >= 0, top_logp, torch.tensor(-np.inf, dtype=torch.float64))
    best = masked.argmax(-1, keepdim=True)
    top1 = torch.where(torch.isfinite(masked.max(-1).values), top_ids.gather(-1, best)[:, 0], -1)
    target = torch.from_numpy(np.minimum(served.target_logprobs.astype(np.float64), 0.0))
    return ReferenceText(input_ids=input_ids.long(), target_logp=target, top1=top1, logp=None,
                         topk_ids=top_ids, topk_logp=torch.where(top_ids >= 0, top_logp, 0.0),
                         prompt_tokens=prompt_tokens)


def check_same_requests(reference: pd.DataFrame, candidate: pd.DataFrame) -> int:
    """The number of items both sides answered, after checking each was asked the same: the same prompt text and
    the same token cap. Ends the run in one line naming the first item that differs (the answers stay in the
    checkpoint: fix the cause and the same command resumes)."""
    columns = [c for c in ("prompt", "max_gen_toks") if c in reference and c in candidate]
    both = reference[["item_id", *columns]].merge(candidate[["item_id", *columns]], on="item_id",
                                                  suffixes=("_ref", "_cand"))
    for column in columns:
        a, b = both[f"{column}_ref"], both[f"{column}_cand"]
        differs = ~((a == b) | (a.isna() & b.isna()))
        if differs.any():
            item = both.loc[differs.idxmax(), "item_id"]
            raise UsageError(f"staged comparison: item {item} was asked differently of the two servers ({column} "
                             f"differs in {int(differs.sum())} of {len(both)} items), so their answers do not pair; "
                             "both sides must run with the same model= tokenizer, chat template and eval.* settings")
    return len(both)
