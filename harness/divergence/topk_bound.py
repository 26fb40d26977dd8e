"""Token divergence of a served candidate from what its server returns: the top-k of each position.

A server gives, for a text sent as its prompt (``echo=true, max_tokens=0, logprobs=k`` on the
completions API), the log-prob of each actual token and the top-k log-probs of each position; it
never gives the whole next-token distribution. Against the reference's full distribution p this
yields, per scored token:

* ``nll_quant`` / ``p_quant``: exact (the server's log-prob of the actual token);
* ``top1_quant``: the server's most likely token (the top of its top-k), against the reference's argmax;
* ``kl`` and ``kl_reverse``: KL on the *top-k partition*: each token the server named is a cell of
  its own and every other token falls in one "rest" cell holding 1 − the named tokens' mass on each
  side. Merging tokens into one cell can only lose divergence (data-processing inequality; the
  log-sum inequality term by term), so this is a **lower bound** of the exact KL(reference ‖ served),
  equal to it when the server names the whole vocabulary. Every row says so (``kl_bound``).

The rest cell of the server side is 1 − Σ of its reported probabilities, which the server rounded:
where that difference falls below the resolution of the sum (``cells`` float32 steps, 2⁻²³ each) it is
raised to it for the forward direction, which can only lower that term, so the bound holds.
benchmarks/bench_topk_kl_bound.py measures how far below the exact KL the bound lies.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from harness.divergence.scoring import TOKEN_COLUMNS, ReferenceText

KL_BOUND = "topk_partition"  # the kl_bound label of a lower bound on the top-k partition
BOUND_COLUMNS = ["kl_bound", "kl_cells"]  # what a served candidate's token rows add to TOKEN_COLUMNS
CHUNK = 256  # positions whose [chunk, vocab] float64 reference distribution is held at once
FLOAT32_STEP = 2.0 ** -23  # spacing of float32 just above 1: the resolution of a reported probability sum


class NoPromptLogprobs(Exception):
    """The server gives no log-probs of prompt tokens: a served run then has accuracy and flips only."""


@dataclass(frozen=True)
class ServedLogprobs:
    """A server's teacher-forced log-probs of one text, for positions 1..T-1 (the token each predicts).

    ``top_ids[i]`` are the token ids the server named at position i+1 (its top-k, plus the actual
    token when the server adds it), -1 where fewer were named or a name could not be read as one
    token of the reference's vocabulary; ``top_logprobs`` their log-probs.
    """

    target_logprobs: np.ndarray  # [T-1] float64, log q(actual token)
    top_ids: np.ndarray  # [T-1, K] int64, -1 = no cell
    top_logprobs: np.ndarray  # [T-1, K] float64 (ignored where top_ids is -1)
    k: int  # the top-k asked for

    def __post_init__(self) -> None:
        if self.top_ids.shape != self.top_logprobs.shape or self.top_ids.shape[0] != len(self.target_logprobs):
            raise ValueError(f"served log-probs of mismatched shapes: targets {self.target_logprobs.shape}, ids "
                             f"{self.top_ids.shape}, log-probs {self.top_logprobs.shape}")


def partition_terms(logp_cells: Tensor, logq_cells: Tensor, cells: Tensor, p_rest: Tensor,
                    has_rest: Tensor, p_rounded: bool = False) -> tuple[Tensor, Tensor]:
    """KL(p‖q) and KL(q‖p) per row on the partition {each cell} ∪ {rest}, float64.

    ``logp_cells`` / ``logq_cells`` [n, K]: both sides' log-probs of the cells (used where ``cells``);
    ``p_rest`` [n]: p's mass outside the cells; ``has_rest`` [n]: whether any token lies outside them
    (no rest cell when the cells cover the vocabulary). q's rest is 1 − Σ q over the cells, raised to
    the resolution of that sum for the forward direction; ``p_rounded``: ``p_rest`` was likewise
    computed as 1 − Σ of rounded values, and is raised to it for the reverse direction (each raise only
    lowers its term, so both stay lower bounds).
    """
    logp_cells, logq_cells = logp_cells.double(), logq_cells.double()
    p_cells = torch.where(cells, logp_cells.exp(), 0.0)
    q_cells = torch.where(cells, logq_cells.exp(), 0.0)
    forward = torch.where(cells & (p_cells > 0), p_cells * (logp_cells - logq_cells), 0.0).sum(-1)
    reverse = torch.where(cells & (q_cells > 0), q_cells * (logq_cells - logp_cells), 0.0).sum(-1)
    q_rest = (1.0 - q_cells.sum(-1)).clamp(min=0.0)
    p_rest = torch.where(has_rest, p_rest.double().clamp(min=0.0), 0.0)
    q_rest = torch.where(has_rest, q_rest, 0.0)
    floor = cells.sum(-1).double() * FLOAT32_STEP
    q_rest_forward = torch.maximum(q_rest, floor)  # only lowers the forward term: still a lower bound
    forward = forward + torch.special.xlogy(p_rest, p_rest) - torch.special.xlogy(p_rest, q_rest_forward)
    p_rest_reverse = torch.maximum(p_rest, floor) if p_rounded else p_rest
    reverse = reverse + torch.special.xlogy(q_rest, q_rest) - torch.special.xlogy(q_rest, p_rest_reverse)
    return forward.clamp(min=0.0), reverse.clamp(min=0.0)


def partition_kl(logp: Tensor, ids: Tensor, logq: Tensor) -> tuple[Tensor, Tensor]:
    """KL(p‖q) and KL(q‖p) per row on the partition of ``ids`` against a full reference distribution.

    ``logp`` [n, V]: the reference's log-distribution (or logits: renormalised here in float64);
    ``ids`` [n, K]: the server's named tokens (-1, or an id outside the vocabulary: no cell; ids in a
    row are distinct); ``logq`` [n, K]: their served log-probs.
    """
    logp = torch.log_softmax(logp.double(), dim=-1)
    vocab = logp.shape[-1]
    ids = ids.long().to(logp.device)
    cells = (ids >= 0) & (ids < vocab)
    safe = torch.where(cells, ids, 0)
    logp_cells = logp.gather(-1, safe)
    named = torch.zeros_like(logp, dtype=torch.long).scatter_add_(-1, safe, cells.long()) > 0
    p_rest = torch.where(named, 0.0, logp.exp()).sum(-1)  # summed, not 1 − Σ: no cancellation
    has_rest = named.sum(-1) < vocab
    return partition_terms(logp_cells, logq.to(logp.device), cells, p_rest, has_rest)


def partition_kl_topk_reference(ref_ids: Tensor, ref_logp: Tensor, ids: Tensor,
                                logq: Tensor) -> tuple[Tensor, Tensor]:
    """The same bound for a reference stored as its own top-k (``eval.reference_store=topk``): the
    cells are the tokens both sides named, everything else is the rest."""
    ids = ids.long()
    match = ids[:, :, None] == ref_ids.long()[:, None, :]  # [n, K, Kr]
    cells = (ids >= 0) & match.any(-1)
    logp_cells = torch.where(match, ref_logp.double()[:, None, :], 0.0).sum(-1)
    p_rest = 1.0 - torch.where(cells, logp_cells.exp(), 0.0).sum(-1)
    return partition_terms(logp_cells, logq, cells, p_rest, torch.ones(len(ids), dtype=torch.bool), p_rounded=True)


def _top1(served: ServedLogprobs) -> np.ndarray:
    """The server's most likely token per position (-1 where it named none)."""
    masked = np.where(served.top_ids >= 0, served.top_logprobs, -np.inf)
    best = np.argmax(masked, axis=-1)
    top = np.take_along_axis(served.top_ids, best[:, None], axis=-1)[:, 0]
    return np.where(np.isfinite(masked.max(axis=-1)), top, -1)


@torch.no_grad()
def served_rows(ref: ReferenceText, served: ServedLogprobs, slice_name: str, text_index: int) -> pd.DataFrame:
    """One row per scored token of ``ref`` (the columns of ``TOKEN_COLUMNS`` + ``BOUND_COLUMNS``).

    ``nll_ref``, ``top1_ref`` and ``p_ref`` are the reference's as stored; the KL columns are the
    top-k partition lower bound (module docstring).
    """
    n = len(ref.input_ids) - 1
    if len(served.target_logprobs) != n:
        raise ValueError(f"the server scored {len(served.target_logprobs)} positions of a {n + 1}-token text")
    ids = torch.from_numpy(served.top_ids)
    logq = torch.from_numpy(served.top_logprobs).double().nan_to_num(nan=0.0)
    forward, reverse = [], []
    for a in range(0, n, CHUNK):
        b = min(a + CHUNK, n)
        if ref.topk_ids is not None:
            kl, kl_reverse = partition_kl_topk_reference(ref.topk_ids[a:b], ref.topk_logp[a:b], ids[a:b], logq[a:b])
        else:
            kl, kl_reverse = partition_kl(ref.logits(a, b, torch.device("cpu")), ids[a:b], logq[a:b])
        forward.append(kl)
        reverse.append(kl_reverse)
    target = np.minimum(served.target_logprobs.astype(np.float64), 0.0)  # a rounded log-prob may come out > 0
    target_ref, top1_ref = ref.targets()
    frame = pd.DataFrame({
        "slice": slice_name,
        "text": text_index,
        "position": np.arange(1, n + 1),
        "nll_ref": (-target_ref).double().numpy(),
        "nll_quant": -target,
        "kl": torch.cat(forward).numpy() if n else np.zeros(0),
        "kl_reverse": torch.cat(reverse).numpy() if n else np.zeros(0),
        "top1_ref": top1_ref.numpy(),
        "top1_quant": _top1(served),
        "p_ref": target_ref.double().exp().numpy(),
        "p_quant": np.exp(target),
        "kind": ref.kinds(),
        "kl_bound": KL_BOUND,
        "kl_cells": (served.top_ids >= 0).sum(-1),
    })
    return frame[[*TOKEN_COLUMNS, *BOUND_COLUMNS]]


def empty_rows() -> pd.DataFrame:
    """The token frame of a served run without divergence (no log-probs): no rows, the same columns."""
    return pd.DataFrame(columns=[*TOKEN_COLUMNS, *BOUND_COLUMNS])


def bound_line(k: int, skipped: int = 0) -> str:
    """What a served run's KL is, in one line (summary, log, terminal table)."""
    line = (f"served candidate: KL from the server's top-{k} log-probs is KL on the top-{k} partition, a LOWER BOUND "
            "of the exact KL(reference ‖ served); NLL, perplexity and top-1 agreement are exact")
    return line + (f"; {skipped} divergence texts longer than the server's max_model_len not scored" if skipped else "")


def no_logprobs_line(reason: str) -> str:
    """The one line of a served run whose server returns no log-probs."""
    return f"served candidate: accuracy and flips only, no token divergence ({reason})"

