"""Which texts a slice's token divergence is scored on, and how long each is.

By default the texts a chat model actually serves: each item's prompt as the evaluation sent it, then
the reference's own reply (:func:`served_texts`, spread over sub-slices and tasks by :func:`spread_rows`).
With ``eval.divergence_plain=true`` also the slice's gold texts (:func:`divergence_texts`).
"""
from __future__ import annotations

from itertools import zip_longest
from typing import TYPE_CHECKING, Any

from harness.evaluation import evaluate
from harness.evaluation.slices import Slice

if TYPE_CHECKING:
    from harness.job.identity import ReferenceSpec


def max_divergence_tokens(slice_: Slice, spec: ReferenceSpec) -> int:
    """Tokens of each divergence text scored: the slice's own limit, else eval's, within the context."""
    limit = slice_.config.metadata.get("divergence_max_tokens", spec.divergence_max_tokens)
    return min(int(limit), spec.max_length)


def served_format(slice_: Slice, spec: ReferenceSpec) -> bool:
    """Whether a slice's divergence is scored on served texts (see :func:`served_texts`).

    For every slice by default: the headline KL is measured on what the model serves. With
    ``eval.divergence_plain=true`` the gold texts are scored too, and base models (no chat template)
    are then scored on them alone, as before that option existed, except slices that set
    ``divergence_from_reference`` (long generation: error growth along the reference's reply).
    """
    return bool(spec.chat_template or slice_.config.divergence_from_reference or not spec.divergence_plain)


SERVED_FORMAT = "served-v1"  # in the reference key of slices scored on served texts


def served_texts(slice_: Slice, records: Any, tokenizer: Any) -> list[Any]:
    """Each item's prompt exactly as the evaluation sent it, followed by the reference's own reply.

    The prompt is the string lm-eval rendered (chat template, system prompt, instruction; the
    records' ``prompt``), the reply the reference's greedy generation or chosen continuation
    (``reply``). ``slice_.config.served_texts`` items at most (None: every item; a slice with
    ``divergence_from_reference`` keeps its ``divergence_texts``), taken in turn from each
    sub-slice and task so that every sub-slice is represented.
    """
    from harness.divergence.scoring import served_text

    if records.empty or "prompt" not in records:
        return []
    rows = records[records["prompt"].astype(str) != ""]
    limit = slice_.config.served_texts
    if limit is None and slice_.config.divergence_from_reference:
        limit = slice_.config.divergence_texts
    chosen = spread_rows(rows, limit)
    return [served_text(tokenizer, str(row.prompt), str(row.reply)) for row in chosen.itertuples()]


def spread_rows(rows: Any, limit: int | None) -> Any:
    """``limit`` rows taken round-robin over sub-slices (first-seen order), each sub-slice
    alternating over its tasks, the first task rotating by sub-slice; all rows when ``limit`` is None."""
    if limit is None or limit >= len(rows):
        return rows
    queues = []
    for index, (_, group) in enumerate(rows.groupby("sub_slice", sort=False)):
        by_task = [list(g.index) for _, g in group.groupby("task", sort=False)]
        by_task = by_task[index % len(by_task):] + by_task[:index % len(by_task)]
        queue = [i for batch in zip_longest(*by_task) for i in batch if i is not None]
        queues.append(queue)
    order = [i for batch in zip_longest(*queues) for i in batch if i is not None]
    return rows.loc[order[:limit]]


def divergence_texts(slice_: Slice, settings: evaluate.EvalSettings) -> list[str]:
    """The gold texts scored for KL / PPL on ``slice_`` (none for registry slices)."""
    if slice_.directory is None:
        return []
    return slice_.divergence_texts(**slice_.metadata(settings.seed, settings.tokenizer_path, settings.max_length))
