"""Token-level divergence of a quantized model from its reference on gold texts.

The reference pass stores, per scored token, what the comparison needs: the log-prob of
the actual next token, the reference's top-1, and either the full log-distribution
(``topk=0``, exact) or its top-k entries plus the lumped tail (compact; KL computed on
the top-k + tail partition is a lower bound of the exact KL by the log-sum inequality).
The quantized pass then yields one row per token: NLL of both, KL in both directions,
top-1 of both, probability of the actual token under both, and the token's position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import Tensor

TOKEN_COLUMNS = ["slice", "text", "position", "nll_ref", "nll_quant", "kl", "kl_reverse",
                 "top1_ref", "top1_quant", "p_ref", "p_quant"]


@dataclass
class ReferenceText:
    input_ids: Tensor  # [T] token ids of the text (BOS included when the tokenizer adds it)
    target_logp: Tensor  # [T-1] log p_ref(actual next token)
    top1: Tensor  # [T-1]
    logp: Tensor | None  # [T-1, V] full log-distribution (exact mode)
    topk_ids: Tensor | None  # [T-1, k] (compact mode)
    topk_logp: Tensor | None  # [T-1, k]


def tokenize(tokenizer: Any, text: str, max_tokens: int) -> Tensor:
    ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_tokens)["input_ids"][0]
    return ids


@torch.no_grad()
def _log_probs(model: torch.nn.Module, input_ids: Tensor) -> Tensor:
    device = next(model.parameters()).device
    logits = model(input_ids.unsqueeze(0).to(device), use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def score_reference(model: torch.nn.Module, tokenizer: Any, texts: list[str], *, max_tokens: int,
                    topk: int = 0) -> list[ReferenceText]:
    """Run the reference model over ``texts`` and keep what divergence needs (on CPU)."""
    out = []
    for text in texts:
        ids = tokenize(tokenizer, text, max_tokens)
        logp = _log_probs(model, ids)
        targets = ids[1:].to(logp.device)
        target_logp = logp.gather(-1, targets[:, None])[:, 0]
        top1 = logp.argmax(-1)
        if topk and topk < logp.shape[-1]:
            values, indices = logp.topk(topk, dim=-1)
            out.append(ReferenceText(ids, target_logp.cpu(), top1.cpu(), None, indices.int().cpu(), values.cpu()))
        else:
            out.append(ReferenceText(ids, target_logp.cpu(), top1.cpu(), logp.cpu(), None, None))
    return out


def _kl_pair(ref: ReferenceText, logq: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token KL(ref||quant) and KL(quant||ref), exact or on the top-k + tail partition."""
    if ref.logp is not None:
        logp = ref.logp.to(logq.device)
        p, q = logp.exp(), logq.exp()
        return (p * (logp - logq)).sum(-1), (q * (logq - logp)).sum(-1)
    ids = ref.topk_ids.long().to(logq.device)
    logp_k = ref.topk_logp.to(logq.device)
    logq_k = logq.gather(-1, ids)
    p_k, q_k = logp_k.exp(), logq_k.exp()
    p_tail = (1 - p_k.sum(-1)).clamp(min=1e-30)
    q_tail = (1 - q_k.sum(-1)).clamp(min=1e-30)
    forward = (p_k * (logp_k - logq_k)).sum(-1) + p_tail * (p_tail.log() - q_tail.log())
    reverse = (q_k * (logq_k - logp_k)).sum(-1) + q_tail * (q_tail.log() - p_tail.log())
    return forward, reverse


@torch.no_grad()
def compare_to_reference(model: torch.nn.Module, reference: list[ReferenceText], slice_name: str) -> pd.DataFrame:
    """One row per scored token: the columns of ``TOKEN_COLUMNS``."""
    frames = []
    for index, ref in enumerate(reference):
        logq = _log_probs(model, ref.input_ids)
        targets = ref.input_ids[1:].to(logq.device)
        target_logq = logq.gather(-1, targets[:, None])[:, 0]
        kl, kl_reverse = _kl_pair(ref, logq)
        frames.append(pd.DataFrame({
            "slice": slice_name,
            "text": index,
            "position": torch.arange(1, len(ref.input_ids)).numpy(),
            "nll_ref": (-ref.target_logp).double().numpy(),
            "nll_quant": (-target_logq).double().cpu().numpy(),
            "kl": kl.clamp(min=0).double().cpu().numpy(),
            "kl_reverse": kl_reverse.clamp(min=0).double().cpu().numpy(),
            "top1_ref": ref.top1.numpy(),
            "top1_quant": logq.argmax(-1).cpu().numpy(),
            "p_ref": ref.target_logp.double().exp().numpy(),
            "p_quant": target_logq.double().exp().cpu().numpy(),
        }))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=TOKEN_COLUMNS)
