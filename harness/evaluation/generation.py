"""Greedy batch decoding that stops computing a row once it has finished.

HF ``generate`` decodes a batch until its *last* row stops: a row that hit a stop string on
token 10 keeps being computed (and thrown away) until the longest reply of its batch ends.
On a CPU, where a decode step costs about in proportion to the rows it carries, that waste is
most of a slice's time when replies vary in length (code: ~30 tokens for most replies, 256 for
one restated docstring). :func:`greedy_generate` drops finished rows from the batch (and from
the KV cache) as it goes, and returns what ``generate`` returns for the same greedy decode:
``[batch, prompt + steps]`` token ids, finished rows padded with ``pad_token_id``.

The text a caller reads is the same as with ``generate``: a row is finished only once a stop
string appears in its decoded reply (or it emitted an end-of-sequence token, or reached
``max_new_tokens``), and callers cut replies at their first stop string, so the tokens
``generate`` would have appended after that point are cut away in both cases. Positions follow
``generate``'s rule (cumulative attention mask - 1, 0 on padding), so a prompt's logits are
those ``generate`` computes for it; only the batch composition of later steps differs, which
changes float rounding, not the algorithm. ``HarnessHFLM`` (``harness.evaluation.evaluate``) uses it for
lm-eval's greedy ``generate_until`` requests (``eval.generator=harness``, the default);
``eval.generator=hf`` keeps HF ``generate``.

:func:`halve_on_oom` runs a batch again as two halves when it meets a CUDA out-of-memory error
(recursively, down to one row): lm-eval's ``batch_size=auto`` sizes batches once, and a long
item later can still not fit. Rows are independent, so the halves give the rows' results.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import Tensor, nn

log = logging.getLogger("harness")
T = TypeVar("T")


def halve_on_oom(run: Callable[[int, int], T], rows: int, combine: Callable[[list[T]], T], *, what: str) -> T:
    """``run(0, rows)``; on ``torch.cuda.OutOfMemoryError``, ``combine`` of the two halves' runs, recursively.

    ``run(start, stop)`` computes rows ``[start, stop)`` of a batch. Each halving is logged (one
    line: the batch size, what it holds, the new sizes); a single row that does not fit re-raises.
    The failed attempt's tensors are released before the retry (the retry runs outside the
    ``except`` block, whose traceback holds them) and CUDA's cached blocks are returned.
    """
    def attempt(start: int, stop: int) -> T:
        try:
            return run(start, stop)
        except torch.cuda.OutOfMemoryError:
            if stop - start <= 1:
                log.error("CUDA out of memory on a single %s; nothing left to split (lower eval.max_length, or "
                          "a larger GPU / model.device=auto)", what)
                raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        middle = (start + stop + 1) // 2
        log.warning("CUDA out of memory on a batch of %d %s; retrying it as batches of %d and %d", stop - start,
                    what, middle - start, stop - middle)
        return combine([attempt(start, middle), attempt(middle, stop)])

    return attempt(0, rows)


def stack_generations(parts: list[Tensor], pad_token_id: int) -> Tensor:
    """Rows of ``[batch, prompt + steps]`` generations, right-padded with ``pad_token_id`` to one width."""
    width = max(part.shape[1] for part in parts)
    return torch.cat([torch.nn.functional.pad(part, (0, width - part.shape[1]), value=pad_token_id)
                      for part in parts], dim=0)


def _eos_ids(model: nn.Module) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def _forward_kwargs(model: nn.Module) -> tuple[str, dict]:
    """The forward's name for the KV cache (``cache`` from transformers 5.2x, ``past_key_values`` before)
    and ``logits_to_keep=1`` for the prefill where the forward takes it."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values",
            {"logits_to_keep": 1} if "logits_to_keep" in params else {})


def _new_cache(model: nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)  # sliding-window layers where the model has them
    except TypeError:  # an older signature
        return DynamicCache()


def _stop_check(stop: Sequence[str], decode: Callable[[list[int]], str]) -> Callable[[list[int]], bool]:
    """Whether a reply (token ids) contains a stop string, looking at its tail each step.

    Decoding the whole reply at every step costs time quadratic in its length (a 256-token
    reply: 33k token decodes per row; on a GPU this CPU work is a large share of a decode
    step). A stop string that first appears at this step ends in its last token, so it lies
    within the last ``4 * len(stop) + 16`` tokens (a character takes at most four byte-fallback
    tokens); a hit there is confirmed on the whole reply (a tail can decode differently at its
    start: a partial character, a leading space), so no row ends on a stop string its reply
    does not contain. lm-eval's own HF stopping criterion looks at a tail too (the stop's token
    length + 2).
    """
    window = 4 * max(len(text) for text in stop) + 16

    def stopped(reply: list[int]) -> bool:
        if not any(text in decode(reply[-window:]) for text in stop):
            return False
        return len(reply) <= window or any(text in decode(reply) for text in stop)

    return stopped


@torch.inference_mode()
def greedy_generate(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, *, max_new_tokens: int,
                    pad_token_id: int, stop: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None,
                    eos_token_ids: set[int] | None = None) -> Tensor:
    """Greedy decode of a left-padded batch; see the module docstring.

    ``stop``: strings that end a row once they appear in its decoded reply (``decode`` turns the
    reply's token ids into text; needed when ``stop`` is given). ``eos_token_ids``: tokens that
    end a row (default: the model's generation config).
    """
    if stop and decode is None:
        raise ValueError("greedy_generate: stop strings need a decode function")
    eos = _eos_ids(model) if eos_token_ids is None else set(eos_token_ids)
    if max_new_tokens <= 0:
        return input_ids
    batch = input_ids.shape[0]
    out = torch.full((batch, max_new_tokens), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    mask = attention_mask.to(input_ids.device).long()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache = _new_cache(model)
    cache_kw, prefill_kw = _forward_kwargs(model)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                   **{cache_kw: cache}, **prefill_kw).logits[:, -1]
    rows = torch.arange(batch, device=input_ids.device)  # the original row of each active row
    replies: list[list[int]] = [[] for _ in range(batch)]
    stopped = _stop_check(stop, decode) if stop else None
    steps = 0
    while True:
        token = logits.argmax(-1)
        out[rows, steps] = token
        steps += 1
        keep = []
        for i, (row, tok) in enumerate(zip(rows.tolist(), token.tolist())):
            replies[row].append(tok)
            finished = tok in eos or steps >= max_new_tokens or (stopped is not None and stopped(replies[row]))
            if not finished:
                keep.append(i)
        if len(keep) < len(rows):
            if not keep:
                break
            index = torch.tensor(keep, device=rows.device)
            rows, token = rows[index], token[index]
            mask, positions = mask[index], positions[index]
            # CPU indices index a cache on any device (and each layer's, when the model is split)
            cache.batch_select_indices(index.cpu())
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
        positions = positions[:, -1:] + 1
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions, use_cache=True,
                       **{cache_kw: cache}).logits[:, -1]
    return torch.cat([input_ids, out[:, :steps]], dim=1)



@torch.inference_mode()
def shared_context_logprobs(model: nn.Module, context: list[int], continuations: Sequence[list[int]], *,
                            pad_token_id: int, device: torch.device | str,
                            softmax_dtype: torch.dtype | None = None) -> list[tuple[float, bool]]:
    """(log-probability, greedy) of each continuation after one shared context, the context run once.

    lm-eval scores a k-way multiple-choice item as k sequences ``context + choice``, so the context
    is computed k times. Here it is computed once into a KV cache, which is repeated for the k
    choices; each choice then runs as ``[context[-1]] + choice[:-1]`` (right-padded). The numbers
    are those of the full sequences up to float rounding (different matmul shapes); both sides of
    a comparison use the same path. ``context`` needs at least 2 tokens.
    """
    if len(context) < 2 or not continuations or any(not c for c in continuations):
        raise ValueError("shared_context_logprobs needs a context of >= 2 tokens and non-empty continuations")
    cache = _new_cache(model)
    cache_kw, prefill_kw = _forward_kwargs(model)
    prefix = torch.tensor([context[:-1]], device=device)
    model(input_ids=prefix, attention_mask=torch.ones_like(prefix), use_cache=True, **{cache_kw: cache}, **prefill_kw)
    k, width = len(continuations), max(len(c) for c in continuations)
    cache.batch_repeat_interleave(k)
    ids = torch.full((k, width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((k, prefix.shape[1] + width), dtype=torch.long, device=device)
    mask[:, :prefix.shape[1]] = 1
    for row, cont in enumerate(continuations):
        inputs = [context[-1]] + cont[:-1]
        ids[row, :len(inputs)] = torch.tensor(inputs, device=device)
        mask[row, prefix.shape[1]:prefix.shape[1] + len(inputs)] = 1
    positions = torch.arange(prefix.shape[1], prefix.shape[1] + width, device=device).expand(k, -1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                   **{cache_kw: cache}).logits
    logprobs = torch.log_softmax(logits, dim=-1, dtype=softmax_dtype)
    out = []
    for row, cont in enumerate(continuations):
        target = torch.tensor(cont, device=logprobs.device)
        rows = logprobs[row, :len(cont)]
        out.append((float(rows.gather(-1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())))
    return out
