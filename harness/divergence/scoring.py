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
scheme that changes nothing gives bit-identical distributions (KL exactly 0). The per-token
statistics come from both sides' logits in one fused pass (:func:`token_statistics`).

The hidden states themselves come, where they can, from the forwards that answered the items
(:class:`harness.divergence.capture.HiddenCapture`: each prompt's prefill, the reference's decode
steps, the quantized model's teacher-forced pass of the reference's reply), so each model runs a
prompt once; a text without them is run here from its first token, as before.
The quantized pass yields one row per token: NLL of both, KL in both directions, top-1 of
both, probability of the actual token under both, the token's position and its ``kind``:

- ``plain``: a token of a gold text (prompt + gold answer, no chat template);
- ``prompt`` / ``reply``: a token of a *served* text (:class:`ServedText`): the prompt exactly as
  the evaluation sent it (chat template, system prompt, instruction) followed by the reference
  model's own greedy reply. The reply positions are what a deployment serves, so the run's
  headline KL is measured on them (``harness.results.summary``); the prompt positions are reported apart.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import pandas as pd
import torch
from torch import Tensor, nn

from harness.divergence import router
from harness.infra.devices import module_device
from harness.models.placement import materialized_copy

TOKEN_COLUMNS = ["slice", "text", "position", "nll_ref", "nll_quant", "kl", "kl_reverse",
                 "top1_ref", "top1_quant", "p_ref", "p_quant", "kind"]
PLAIN, PROMPT, REPLY = "plain", "prompt", "reply"  # the token kinds (module docstring)
Store = Literal["hidden", "logprobs", "topk"]
log = logging.getLogger("harness")
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

    def logits(self, hidden: Tensor, out: Tensor | None = None) -> Tensor:
        """float32 logits of ``hidden``, computed on the head's device in the head's dtype.

        ``out``: a float32 [rows >= len(hidden), vocabulary] buffer on the head's device that a plain float32
        linear head writes into (its first rows; the result is a view of them). On a CPU a fresh 100 MB
        logits tensor per chunk costs its page faults each time: reusing one makes the divergence stage about
        10 % faster (docs/benchmarks/default-job-speed.md), with the same kernel and the same values.
        Another head (a quantized module, another dtype) or a forward under autograd ignores it."""
        weight = next(self.lm_head.parameters())
        hidden = hidden.to(device=module_device(self.lm_head), dtype=weight.dtype)
        if out is not None and type(self.lm_head) is nn.Linear and weight.dtype == torch.float32 \
                and hidden.dim() == 2 and out.device == weight.device and out.shape[-1] == weight.shape[0] \
                and not (torch.is_grad_enabled() and weight.requires_grad):  # out= takes no autograd
            rows = out[:len(hidden)]
            bias = self.lm_head.bias
            logits = torch.mm(hidden, weight.t(), out=rows) if bias is None else \
                torch.addmm(bias, hidden, weight.t(), out=rows)  # what F.linear computes, into the buffer
            if self.softcap:
                logits.div_(self.softcap).tanh_().mul_(self.softcap)
            return logits
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def log_probs(self, hidden: Tensor) -> Tensor:
        return torch.log_softmax(self.logits(hidden), dim=-1)


@dataclass
class ReferenceText:
    input_ids: Tensor  # [T] token ids of the text (BOS included when the tokenizer adds it)
    # [T-1] log p_ref(actual next token) and the reference's top-1; None with store=hidden, where they come from
    # the logits the comparison computes from ``hidden`` anyway (:meth:`targets`, :func:`compare_to_reference`)
    target_logp: Tensor | None
    top1: Tensor | None
    logp: Tensor | None  # [T-1, V] full log-distribution (store=logprobs)
    topk_ids: Tensor | None  # [T-1, k] (store=topk)
    topk_logp: Tensor | None  # [T-1, k]
    hidden: Tensor | None = None  # [T-1, H] final hidden states (store=hidden)
    head: OutputHead | None = None  # the reference's frozen output head (store=hidden)
    prompt_tokens: int | None = None  # served text: input_ids[:prompt_tokens] is the prompt; None: plain text
    routing: dict[str, Tensor] | None = None  # MoE: each layer's top-k experts per token (divergence.router)
    # the states came from the forwards that answered the item (HiddenCapture), not from running the text again:
    # the quantized side takes its own from there too only then, so both sides compute alike (a null scheme: KL 0)
    captured: bool = False

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

    def logits(self, start: int, stop: int, device: torch.device, out: Tensor | None = None) -> Tensor:
        """The reference's logits for positions [start, stop), up to a shift per position (exact stores
        only: the log-distribution itself for ``logprobs``); what :func:`token_statistics` takes.
        ``out``: a buffer the head may write into (:meth:`OutputHead.logits`)."""
        if self.hidden is not None:
            assert self.head is not None, "hidden-state reference without its output head"
            return self.head.logits(self.hidden[start:stop], out=out).to(device)
        assert self.logp is not None
        return self.logp[start:stop].to(device)

    def targets(self) -> tuple[Tensor, Tensor]:
        """(log p_ref(actual next token), the reference's top-1) per position: stored, or computed from the
        hidden states and the frozen head (:func:`target_statistics`, as the comparison computes them)."""
        if self.target_logp is None or self.top1 is None:
            parts = [target_statistics(self.logits(a, b, torch.device("cpu")), self.input_ids[1:][a:b])
                     for a, b in _chunks(len(self.input_ids) - 1)]
            self.target_logp = torch.cat([p[0] for p in parts]) if parts else torch.zeros(0)
            self.top1 = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0, dtype=torch.long)
        return self.target_logp, self.top1

    def prompt_and_reply(self) -> tuple[list[int], list[int]] | None:
        """A served text's (prompt ids, reply ids) as scored; None for a plain text."""
        if self.prompt_tokens is None:
            return None
        ids = self.input_ids.tolist()
        return ids[:self.prompt_tokens], ids[self.prompt_tokens:]


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


def captured_hidden(captured: Any, model: nn.Module, ids: Tensor, prompt_tokens: int | None) -> tuple[Tensor, bool]:
    """([T-1, H] final hidden states of ``ids``, whether captured): from ``captured`` (a
    :class:`~harness.divergence.capture.HiddenCapture`) when it holds all of a served text's, else from a
    forward of the model (the text run again)."""
    if captured is not None and prompt_tokens is not None:
        tokens = ids.tolist()
        states = captured.states(tokens[:prompt_tokens], tokens[prompt_tokens:])
        if states is not None:
            assert len(states) == len(ids) - 1, "captured states do not cover the text"
            return states, True
    return final_hidden(model, ids), False


def _capture_usable(captured: Any, model: nn.Module) -> Any:
    """``captured``, or None for a mixture of experts: its router's selections are read from a forward."""
    return None if captured is None or router.num_experts(model) else captured


@torch.no_grad()
def score_reference(model: nn.Module, tokenizer: Any, texts: list[str | ServedText], *, max_tokens: int,
                    topk: int = 0, store: Store | None = None, captured: Any = None) -> list[ReferenceText]:
    """Run the reference model over ``texts`` (plain or served) and keep what divergence needs (on CPU).

    ``store`` defaults to ``topk`` when ``topk > 0`` and to ``logprobs`` otherwise, so the
    older keyword keeps its meaning; the pipeline passes ``store`` explicitly. ``captured``: the
    reference's states from answering the items (:func:`captured_hidden`); a served text they cover
    is not run again.
    """
    store = store or ("topk" if topk else "logprobs")
    head = OutputHead.of(model, frozen_copy=True) if store == "hidden" else None
    captured = _capture_usable(captured, model)
    out = []
    for index, text in enumerate(texts):
        ids = tokenize(tokenizer, text, max_tokens)
        if head is not None and index == 0:
            _check_head(model, head, ids)
        with router.capturing(model) as routing:  # a mixture of experts' selections (nothing for a dense model)
            hidden, from_capture = captured_hidden(captured, model, ids, prompt_length(text, max_tokens))
        targets = ids[1:]
        live_head = OutputHead.of(model)
        target_logp, top1, full, top_ids, top_logp = [], [], [], [], []
        # store=hidden keeps the states only: the comparison computes the reference's logits from them anyway, and
        # takes log p(target) and the top-1 from there (ReferenceText.targets), so no head runs here
        for a, b in _chunks(len(hidden)) if store != "hidden" else ():
            logits = live_head.logits(hidden[a:b])  # stays on the head's device: only what is stored moves
            maximum, best = logits.max(-1)  # log p(target) as token_statistics computes log q(target), bit for bit
            shifted = logits.sub_(maximum[:, None])
            log_sum = shifted.exp().sum(-1).log()
            chunk_targets = targets[a:b, None].to(logits.device)
            target_logp.append((shifted.gather(-1, chunk_targets)[:, 0] - log_sum).cpu())
            top1.append(best.cpu())
            if store == "logprobs":
                full.append(shifted.sub_(log_sum[:, None]).cpu())
            elif store == "topk":
                values, indices = shifted.topk(min(topk, shifted.shape[-1]), dim=-1)
                top_ids.append(indices.int().cpu())
                top_logp.append((values - log_sum[:, None]).cpu())
        out.append(ReferenceText(
            ids, torch.cat(target_logp) if target_logp else None, torch.cat(top1) if top1 else None,
            torch.cat(full) if full else None,
            torch.cat(top_ids) if top_ids else None, torch.cat(top_logp) if top_logp else None,
            hidden.float().cpu() if store == "hidden" else None, head, prompt_length(text, max_tokens),
            routing or None, from_capture))
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


# floats of a [rows, vocabulary] block of statistics computed together on a CPU: 3 MB per temporary
# (16 rows of SmolLM2's 49,152-token vocabulary, 6 of Llama 3's 128,256)
CPU_STATISTICS_FLOATS = 16 * 49_152


def target_statistics(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(log p(target), top-1) per row of ``logits``, computed exactly as :func:`token_statistics` computes
    the quantized side's (bit for bit: identical logits give identical values)."""
    maximum, top1 = logits.max(-1)
    shifted = logits - maximum[:, None]
    target = shifted.gather(-1, targets[:, None].to(shifted.device))[:, 0] - shifted.exp_().sum(-1).log()
    return target.cpu(), top1.cpu()


def token_statistics(logits_q: Tensor, logits_p: Tensor, targets: Tensor | None = None,
                     reference_targets: bool = False) -> dict[str, Tensor]:
    """Per-token KL(p||q), KL(q||p), log q(target) and q's top-1 from both sides' logits, one pass per side.

    ``logits_p`` may be the reference's logits or any per-row shift of them (its log-probs). With m
    a row's maximum, S = sum exp(z - m) and d = (z_p - m_p) - (z_q - m_q):
    KL(p||q) = E_p[d] - log(S_p / S_q) and KL(q||p) = log(S_p / S_q) - E_q[d]. Each side's
    exponentials are taken once and the expectations are dot products, about 10 passes over
    [tokens, vocabulary] where the two-log-softmax form made about 20; d is small where the models
    agree, so no two large log-normalisers cancel (closer to a float64 computation than that form,
    benchmarks/bench_divergence.py). Top-1 is the maximum's index; identical logits give exactly 0.
    ``logits_q`` and ``logits_p`` are float32 and are not modified.

    ``reference_targets``: also ``logp_target`` and ``top1_ref``, the same two for ``logits_p`` (which must
    then be the reference's logits or log-probs: the shift cancels), from the same passes.

    On a CPU the rows go through in blocks of ``CPU_STATISTICS_FLOATS`` values: a block's [rows, vocabulary]
    temporaries then stay in cache and their memory is reused (2.2x faster at SmolLM2's vocabulary, one thread;
    benchmarks/bench_divergence.py); each row's arithmetic is unchanged, so the values are bit for bit those of
    one block.
    """
    rows = logits_q.shape[0]
    block = max(1, CPU_STATISTICS_FLOATS // max(1, logits_q.shape[-1]))
    if logits_q.device.type != "cpu" or rows <= block:
        return _token_statistics(logits_q, logits_p, targets, reference_targets)
    parts = [_token_statistics(logits_q[start:start + block], logits_p[start:start + block],
                               None if targets is None else targets[start:start + block], reference_targets)
             for start in range(0, rows, block)]
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def _token_statistics(logits_q: Tensor, logits_p: Tensor, targets: Tensor | None,
                      reference_targets: bool) -> dict[str, Tensor]:
    """:func:`token_statistics` of one block of rows."""
    m_q, top1 = logits_q.max(-1)
    if reference_targets:
        m_p, top1_p = logits_p.max(-1)
    else:
        m_p = logits_p.amax(-1)
    shifted_q = logits_q - m_q[:, None]
    shifted_p = logits_p - m_p[:, None]
    d = shifted_p - shifted_q
    out = {"top1_quant": top1}
    target_shifted = None if targets is None else shifted_q.gather(-1, targets[:, None].to(logits_q.device))[:, 0]
    if reference_targets:
        assert targets is not None, "reference_targets needs the targets"
        target_shifted_p = shifted_p.gather(-1, targets[:, None].to(logits_p.device))[:, 0]
        out["top1_ref"] = top1_p
    e_q, e_p = shifted_q.exp_(), shifted_p.exp_()
    s_q, s_p = e_q.sum(-1), e_p.sum(-1)
    log_s_q, log_s_p = s_q.log(), s_p.log()
    c = log_s_p - log_s_q
    if reference_targets:
        out["logp_target"] = target_shifted_p - log_s_p
    out["kl"] = torch.linalg.vecdot(e_p, d) / s_p - c
    out["kl_reverse"] = c - torch.linalg.vecdot(e_q, d) / s_q
    if target_shifted is not None:
        out["logq_target"] = target_shifted - log_s_q
    return out


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` torch threads (None: as it is), then restore the count."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _logit_buffers(head: OutputHead, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """Two [CHUNK, vocabulary] float32 buffers for both sides' logits of a chunk on a CPU (reused across the
    chunks and texts of a slice, :meth:`OutputHead.logits`); (None, None) elsewhere: CUDA's caching allocator
    already reuses memory, and a buffer there would hold device memory through the stage."""
    if device.type != "cpu":
        return None, None
    vocabulary = next(head.lm_head.parameters()).shape[0]
    return torch.empty(CHUNK, vocabulary), torch.empty(CHUNK, vocabulary)


@torch.no_grad()
def compare_to_reference(model: nn.Module, reference: list[ReferenceText], slice_name: str,
                         captured: Any = None, forward_threads: int | None = None) -> pd.DataFrame:
    """One row per scored token: the columns of ``TOKEN_COLUMNS``.

    ``captured``: the quantized model's states from answering the items (:func:`captured_hidden`);
    a served text they cover is not run again, where the reference's states were captured too
    (:attr:`ReferenceText.captured`: both sides then compute alike).

    ``forward_threads``: the torch threads of the model's forwards here (texts run again), the count the
    reference's states were computed with, since a CPU matmul's sums depend on it (a null scheme then gives
    exactly the reference's states). Both output heads and the statistics run with the caller's threads:
    both sides' logits are computed here, with one count, so a null scheme's KL is exactly 0 at any count.
    """
    frames = []
    captured = _capture_usable(captured, model)
    head = OutputHead.of(model)
    device = module_device(head.lm_head)  # a split model's head may live on another device than its input
    buffers = _logit_buffers(head, device)
    again = {"reference": [0, 0], "here": [0, 0]}  # texts run again (count, tokens): the reference's states
    # were not captured (so neither side's are used), or this model's were not
    for index, ref in enumerate(reference):
        if ref.head is not None:
            ref.head.to(device)  # the frozen reference head computes where the quantized one does
        with router.capturing(model) as routing, torch_threads(forward_threads):
            hidden, from_capture = captured_hidden(captured if getattr(ref, "captured", False) else None, model, ref.input_ids,
                                        ref.prompt_tokens)
        if not from_capture:
            why = again["here" if getattr(ref, "captured", False) else "reference"]
            why[0], why[1] = why[0] + 1, why[1] + len(ref.input_ids)
        router.record_slice(model, slice_name, getattr(ref, "routing", None), routing)  # MoE router agreement
        targets = ref.input_ids[1:]
        parts: dict[str, list[Tensor]] = {"target": [], "kl": [], "kl_reverse": [], "top1": [], "target_ref": [],
                                          "top1_ref": []}
        missing = ref.target_logp is None  # store=hidden: the reference's come from the logits computed here
        for a, b in _chunks(len(hidden)):
            logits_q = head.logits(hidden[a:b], out=buffers[0])
            if ref.topk_ids is None:
                stats = token_statistics(logits_q, ref.logits(a, b, logits_q.device, out=buffers[1]), targets[a:b],
                                         reference_targets=missing)
                kl, kl_reverse = stats["kl"], stats["kl_reverse"]
                target, top1 = stats["logq_target"], stats["top1_quant"]
                if missing:
                    parts["target_ref"].append(stats["logp_target"].cpu())
                    parts["top1_ref"].append(stats["top1_ref"].cpu())
            else:  # the lumped top-k KL; NLL and top-1 computed as token_statistics does (bit for bit)
                logq = torch.log_softmax(logits_q, dim=-1)
                kl, kl_reverse = _kl_pair(ref, logq, a)
                target, top1 = target_statistics(logits_q, targets[a:b])
            parts["target"].append(target.cpu())
            parts["kl"].append(kl.cpu())
            parts["kl_reverse"].append(kl_reverse.cpu())
            parts["top1"].append(top1.cpu())
        target_logq = torch.cat(parts["target"]).double()
        if missing and parts["target_ref"]:
            ref.target_logp, ref.top1 = torch.cat(parts["target_ref"]), torch.cat(parts["top1_ref"])
        target_logp, top1_ref = ref.targets()
        frames.append(pd.DataFrame({
            "slice": slice_name,
            "text": index,
            "position": torch.arange(1, len(ref.input_ids)).numpy(),
            "nll_ref": (-target_logp).double().numpy(),
            "nll_quant": (-target_logq).numpy(),
            "kl": torch.cat(parts["kl"]).clamp(min=0).double().numpy(),
            "kl_reverse": torch.cat(parts["kl_reverse"]).clamp(min=0).double().numpy(),
            "top1_ref": top1_ref.numpy(),
            "top1_quant": torch.cat(parts["top1"]).numpy(),
            "p_ref": target_logp.double().exp().numpy(),
            "p_quant": target_logq.exp().numpy(),
            "kind": ref.kinds(),
        }))
    if any(count for count, _ in again.values()):
        log.info("divergence of slice %s: %d of %d texts run again (%d tokens; %d without the reference's captured "
                 "states, %d without this model's)", slice_name, again["reference"][0] + again["here"][0],
                 len(reference), again["reference"][1] + again["here"][1], again["reference"][0], again["here"][0])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=TOKEN_COLUMNS)
