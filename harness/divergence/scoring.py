"""Token-level divergence of a quantized model from its reference on gold texts.

The reference pass stores, per scored token, what the comparison needs: the log-prob of
the actual next token, the reference's top-1, and the reference distribution in one of
three forms (``store``):

- ``hidden`` (default): the final (post-norm) hidden state plus one frozen copy of the
  reference's output head. The distribution is recomputed exactly when needed, at
  ``hidden_size`` floats per token instead of ``vocab_size`` (576 vs 49,152 on SmolLM2),
  which is what makes 8k-token long-context references affordable.
- ``logprobs``: the full log-distribution (exact, ``vocab_size`` floats per token).
- ``topk``: top-k log-probs plus the lumped tail; KL on that partition is a lower bound
  of the exact KL (log-sum inequality). benchmarks/bench_reference_topk.py measured it at
  5.9% low for k=256 on SmolLM2, so it is only an option for when nothing else fits.

Both models' logits are computed the same way, chunk by chunk from hidden states, so a
scheme that changes nothing gives bit-identical distributions (KL exactly 0).
The quantized pass yields one row per token: NLL of both, KL in both directions, top-1 of
both, probability of the actual token under both, the token's position and its ``kind``:

- ``plain``: a token of a gold text (prompt + gold answer, no chat template);
- ``prompt`` / ``reply``: a token of a *served* text (:class:`ServedText`): the prompt exactly as
  the evaluation sent it (chat template, system prompt, instruction) followed by the reference
  model's own greedy reply. The reply positions are what a deployment serves, so the run's
  headline KL is measured on them (``harness.results.summary``); the prompt positions are reported apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Literal

import pandas as pd
import torch
from torch import Tensor, nn

from harness.infra.devices import module_device
from harness.models.placement import materialized_copy

TOKEN_COLUMNS = ["slice", "text", "position", "nll_ref", "nll_quant", "kl", "kl_reverse",
                 "top1_ref", "top1_quant", "p_ref", "p_quant", "kind"]
PLAIN, PROMPT, REPLY = "plain", "prompt", "reply"  # the token kinds (module docstring)
Store = Literal["hidden", "logprobs", "topk"]
CHUNK = 512  # tokens whose [chunk, vocab] logits are materialised at once


class OutputHead(nn.Module):
    """The map from final hidden state to logits: the model's output embedding (+ soft-cap)."""

    def __init__(self, lm_head: nn.Module, softcap: float | None):
        super().__init__()
        self.lm_head = lm_head
        self.softcap = softcap

    @classmethod
    def of(cls, model: nn.Module, *, frozen_copy: bool = False) -> "OutputHead":
        head = model.get_output_embeddings()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        softcap = getattr(config, "final_logit_softcapping", None)
        return cls(materialized_copy(head).cpu() if frozen_copy else head, softcap)

    def logits(self, hidden: Tensor) -> Tensor:
        """float32 logits of ``hidden``, computed on the head's device in the head's dtype."""
        weight = next(self.lm_head.parameters())
        logits = self.lm_head(hidden.to(device=module_device(self.lm_head), dtype=weight.dtype)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def log_probs(self, hidden: Tensor) -> Tensor:
        return torch.log_softmax(self.logits(hidden), dim=-1)


@dataclass
class ReferenceText:
    input_ids: Tensor  # [T] token ids of the text (BOS included when the tokenizer adds it)
    target_logp: Tensor  # [T-1] log p_ref(actual next token)
    top1: Tensor  # [T-1]
    logp: Tensor | None  # [T-1, V] full log-distribution (store=logprobs)
    topk_ids: Tensor | None  # [T-1, k] (store=topk)
    topk_logp: Tensor | None  # [T-1, k]
    hidden: Tensor | None = None  # [T-1, H] final hidden states (store=hidden)
    head: OutputHead | None = None  # the reference's frozen output head (store=hidden)
    prompt_tokens: int | None = None  # served text: input_ids[:prompt_tokens] is the prompt; None: plain text

    def kinds(self) -> list[str]:
        """The kind of each scored position 1..T-1 (the token it predicts): plain, prompt or reply."""
        n = len(self.input_ids) - 1
        if self.prompt_tokens is None:
            return [PLAIN] * n
        return [REPLY if position >= self.prompt_tokens else PROMPT for position in range(1, n + 1)]

    def log_probs(self, start: int, stop: int, device: torch.device) -> Tensor:
        """Reference log-distribution for positions [start, stop) (exact stores only)."""
        if self.hidden is not None:
            assert self.head is not None, "hidden-state reference without its output head"
            return self.head.log_probs(self.hidden[start:stop]).to(device)
        assert self.logp is not None
        return self.logp[start:stop].to(device)


@dataclass(frozen=True)
class ServedText:
    """A prompt as the evaluation sent it, followed by the reference model's own reply (token ids)."""

    prompt_ids: tuple[int, ...]
    reply_ids: tuple[int, ...]


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a prompt as lm-eval's HF backend encodes it for a causal model.

    lm-eval adds no special tokens to a string that already starts with the BOS token (a chat
    template writes its own) and leaves the tokenizer's default otherwise (``HFLM.tok_encode``
    and ``tok_batch_encode`` with ``add_bos_token`` unset, as ``harness.evaluation.evaluate`` builds it).
    """
    bos = getattr(tokenizer, "bos_token", None)
    special = {"add_special_tokens": False} if bos and text.startswith(bos) else {}
    return list(tokenizer(text, **special)["input_ids"])


def served_text(tokenizer: Any, prompt: str, reply: str) -> ServedText:
    """The served text of one item: its prompt encoded as lm-eval did, its reply as generated tokens
    (the reply text re-encoded without special tokens, the way it followed the prompt)."""
    return ServedText(tuple(encode_prompt(tokenizer, prompt)),
                      tuple(tokenizer(reply, add_special_tokens=False)["input_ids"]))


def tokenize(tokenizer: Any, text: str | ServedText, max_tokens: int) -> Tensor:
    """Token ids of a plain text (cut to ``max_tokens``) or of a served text (prompt + reply).

    A served text longer than ``max_tokens`` loses the start of its prompt, not its reply (lm-eval
    also cuts over-long prompts from the left); :func:`prompt_length` says where its reply starts.
    """
    if isinstance(text, ServedText):
        return torch.tensor([*text.prompt_ids, *text.reply_ids][-max_tokens:], dtype=torch.long)
    return tokenizer(text, return_tensors="pt", truncation=True, max_length=max_tokens)["input_ids"][0]


def prompt_length(text: str | ServedText, max_tokens: int) -> int | None:
    """How many of :func:`tokenize`'s ids are prompt (None for a plain text)."""
    if not isinstance(text, ServedText):
        return None
    dropped = max(0, len(text.prompt_ids) + len(text.reply_ids) - max_tokens)
    return max(0, len(text.prompt_ids) - dropped)


def _device(model: nn.Module) -> torch.device:
    """Where the model takes its input ids: the embeddings' device (a split model's first device)."""
    return module_device(model.get_input_embeddings())


@torch.no_grad()
def final_hidden(model: nn.Module, input_ids: Tensor) -> Tensor:
    """[T-1, H] post-norm hidden states predicting tokens 1..T-1 (no logits materialised)."""
    out = model.get_decoder()(input_ids.unsqueeze(0).to(_device(model)), use_cache=False)
    return out.last_hidden_state[0, :-1]


def _chunks(n: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, CHUNK):
        yield start, min(start + CHUNK, n)


@torch.no_grad()
def _log_probs(model: nn.Module, input_ids: Tensor) -> Tensor:
    """[T-1, V] log-probs through the model's own head (used by the non-hidden stores)."""
    hidden = final_hidden(model, input_ids)
    head = OutputHead.of(model)
    return torch.cat([head.log_probs(hidden[a:b]) for a, b in _chunks(len(hidden))])


def relative_tolerance(dtype: torch.dtype) -> float:
    """Relative agreement expected of two computations of the same values in ``dtype``.

    Four units of the dtype's epsilon (bf16: 0.031, fp16: 0.0039), never below 1e-5: a GEMM
    whose accumulation order differs (another kernel, another device), or a soft-cap evaluated
    in the low dtype, moves an output by one to three rounding steps of the dtype (a step is at
    most eps·|x|); a wrong head (missing soft-cap, a logit scale, another weight) moves most
    outputs by far more.
    """
    return max(4 * torch.finfo(dtype).eps, 1e-5)


def _agreement(name: str, got: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    """Raise when ``got`` and ``expected`` differ by more than ``dtype``'s rounding allows.

    Per element: |Δ| <= tol · (|expected| + mean |expected|), tol = :func:`relative_tolerance`;
    the mean term covers values near zero, whose rounding error comes from the summands.
    """
    got, expected = got.float(), expected.to(device=got.device).float()
    tol = relative_tolerance(dtype)
    bound = tol * (expected.abs() + expected.abs().mean())
    excess = (got - expected).abs() - bound
    if not bool((excess <= 0).all()) or not bool(torch.isfinite(got).all()):
        gap = (got - expected).abs().max().item()
        share = (excess > 0).float().mean().item()
        raise RuntimeError(f"{name} differs from the model's own forward (max |Δ| {gap:.3g}, {share:.2%} of values "
                           f"beyond {tol:.3g}·(|x| + mean|x|) for {dtype}); the model's output layer is one this "
                           "harness cannot recompute from hidden states: use eval.reference_store=logprobs")


@torch.no_grad()
def _check_head(model: nn.Module, head: OutputHead, input_ids: Tensor) -> None:
    """The frozen head on stored hidden states must reproduce the model's logits.

    Checked where and how the comparison will compute: the frozen head visits the device of
    the model's own head and keeps its dtype, and both halves of the recomputation are
    compared with what the model's forward produced from the same input (no CPU-vs-GPU or
    fp32-vs-bf16 gap is mistaken for a wrong head): (1) the decoder path of
    :func:`final_hidden` against the input the model fed its output layer; (2) the frozen
    head on that very input, same shape, against the model's logits (this catches soft-caps,
    logit scales and heads other than ``get_output_embeddings``). Tolerances follow the dtype
    (:func:`relative_tolerance`).
    """
    ids = input_ids[:64]
    live = model.get_output_embeddings()
    captured: dict[str, Tensor] = {}
    handle = live.register_forward_pre_hook(lambda _module, args: captured.__setitem__("x", args[0]))
    try:
        logits = model(ids.unsqueeze(0).to(_device(model)), use_cache=False).logits[0, :-1]
    finally:
        handle.remove()
    if "x" not in captured:
        raise RuntimeError("the model's forward never called its output embeddings (get_output_embeddings()); "
                           "use eval.reference_store=logprobs for this model")
    fed = captured["x"]
    dtype = fed.dtype
    _agreement("the final hidden state (model.get_decoder() output)", final_hidden(model, ids), fed[0, :-1], dtype)
    home = next(head.lm_head.parameters()).device
    head.to(module_device(live))
    try:
        recomputed = head.logits(fed)[0, :-1]
    finally:
        head.to(home)
    _agreement("the output head recomputed from hidden states", recomputed, logits, dtype)


@torch.no_grad()
def score_reference(model: nn.Module, tokenizer: Any, texts: list[str | ServedText], *, max_tokens: int,
                    topk: int = 0, store: Store | None = None) -> list[ReferenceText]:
    """Run the reference model over ``texts`` (plain or served) and keep what divergence needs (on CPU).

    ``store`` defaults to ``topk`` when ``topk > 0`` and to ``logprobs`` otherwise, so the
    older keyword keeps its meaning; the pipeline passes ``store`` explicitly.
    """
    store = store or ("topk" if topk else "logprobs")
    head = OutputHead.of(model, frozen_copy=True) if store == "hidden" else None
    out = []
    for index, text in enumerate(texts):
        ids = tokenize(tokenizer, text, max_tokens)
        if head is not None and index == 0:
            _check_head(model, head, ids)
        hidden = final_hidden(model, ids)
        targets = ids[1:]
        live_head = OutputHead.of(model)
        target_logp, top1, full, top_ids, top_logp = [], [], [], [], []
        for a, b in _chunks(len(hidden)):
            logp = live_head.log_probs(hidden[a:b])  # stays on the head's device: only what is stored moves
            chunk_targets = targets[a:b, None].to(logp.device)
            target_logp.append(logp.gather(-1, chunk_targets)[:, 0].cpu())
            top1.append(logp.argmax(-1).cpu())
            if store == "logprobs":
                full.append(logp.cpu())
            elif store == "topk":
                values, indices = logp.topk(min(topk, logp.shape[-1]), dim=-1)
                top_ids.append(indices.int().cpu())
                top_logp.append(values.cpu())
        out.append(ReferenceText(
            ids, torch.cat(target_logp), torch.cat(top1),
            torch.cat(full) if full else None,
            torch.cat(top_ids) if top_ids else None, torch.cat(top_logp) if top_logp else None,
            hidden.float().cpu() if store == "hidden" else None, head, prompt_length(text, max_tokens)))
    return out


def _kl_pair(ref: ReferenceText, logq: Tensor, start: int = 0) -> tuple[Tensor, Tensor]:
    """Per-token KL(ref||quant) and KL(quant||ref) for positions [start, start+len(logq))."""
    stop = start + len(logq)
    if ref.topk_ids is None:
        logp = ref.log_probs(start, stop, logq.device)
        p, q = logp.exp(), logq.exp()
        return (p * (logp - logq)).sum(-1), (q * (logq - logp)).sum(-1)
    ids = ref.topk_ids[start:stop].long().to(logq.device)
    logp_k = ref.topk_logp[start:stop].to(logq.device).double()
    logq_k = logq.gather(-1, ids).double()
    p_k, q_k = logp_k.exp(), logq_k.exp()
    p_tail = (1 - p_k.sum(-1)).clamp(min=1e-30)  # float64: the tail of a large k cancels badly in fp32
    q_tail = (1 - q_k.sum(-1)).clamp(min=1e-30)
    forward = (p_k * (logp_k - logq_k)).sum(-1) + p_tail * (p_tail.log() - q_tail.log())
    reverse = (q_k * (logq_k - logp_k)).sum(-1) + q_tail * (q_tail.log() - p_tail.log())
    return forward.float(), reverse.float()


@torch.no_grad()
def compare_to_reference(model: nn.Module, reference: list[ReferenceText], slice_name: str) -> pd.DataFrame:
    """One row per scored token: the columns of ``TOKEN_COLUMNS``."""
    frames = []
    head = OutputHead.of(model)
    device = module_device(head.lm_head)  # a split model's head may live on another device than its input
    for index, ref in enumerate(reference):
        if ref.head is not None:
            ref.head.to(device)  # the frozen reference head computes where the quantized one does
        hidden = final_hidden(model, ref.input_ids)
        targets = ref.input_ids[1:].to(hidden.device)
        parts: dict[str, list[Tensor]] = {"target": [], "kl": [], "kl_reverse": [], "top1": []}
        for a, b in _chunks(len(hidden)):
            logq = head.log_probs(hidden[a:b])
            parts["target"].append(logq.gather(-1, targets[a:b, None].to(logq.device))[:, 0].cpu())
            kl, kl_reverse = _kl_pair(ref, logq, a)
            parts["kl"].append(kl.cpu())
            parts["kl_reverse"].append(kl_reverse.cpu())
            parts["top1"].append(logq.argmax(-1).cpu())
        target_logq = torch.cat(parts["target"]).double()
        frames.append(pd.DataFrame({
            "slice": slice_name,
            "text": index,
            "position": torch.arange(1, len(ref.input_ids)).numpy(),
            "nll_ref": (-ref.target_logp).double().numpy(),
            "nll_quant": (-target_logq).numpy(),
            "kl": torch.cat(parts["kl"]).clamp(min=0).double().numpy(),
            "kl_reverse": torch.cat(parts["kl_reverse"]).clamp(min=0).double().numpy(),
            "top1_ref": ref.top1.numpy(),
            "top1_quant": torch.cat(parts["top1"]).numpy(),
            "p_ref": ref.target_logp.double().exp().numpy(),
            "p_quant": target_logq.exp().numpy(),
            "kind": ref.kinds(),
        }))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=TOKEN_COLUMNS)
