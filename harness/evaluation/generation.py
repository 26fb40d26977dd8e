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

Both can keep, for the divergence stage, the final hidden states of the forwards that answer an
item (``capture``: a :class:`harness.divergence.capture.HiddenCapture`): the prompt's prefill, each
decode step, and, given a ``teacher`` reply for the prompt (the reference's, on the quantized side),
that reply teacher-forced from a copy of the prompt's KV cache right after the prefill; the answer
itself is computed exactly as without them (one prefill per prompt per model).
"""
from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from harness.divergence.capture import HiddenCapture

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


def _last_hidden(output: Any) -> Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def _capturing(model: nn.Module, into: list[Tensor]) -> Any:
    """A hook on the model's decoder that appends each forward's final (post-norm) hidden states to ``into``.

    The decoder computes them at every position even when the head keeps one (``logits_to_keep``)."""
    return model.get_decoder().register_forward_hook(lambda _module, _args, output: into.append(_last_hidden(output)))


Teacher = Callable[[tuple[int, ...]], Sequence[int] | None]  # a prompt's token ids -> the reply to teacher-force


def _record_prefill(capture: HiddenCapture, input_ids: Tensor, mask: Tensor, hidden: Tensor) -> list[Any]:
    """Each row's prompt states (the unpadded positions); the rows' capture entries (None: prompt already kept)."""
    rows = []
    for row in range(input_ids.shape[0]):
        valid = mask[row].bool()
        rows.append(capture.add(input_ids[row][valid].tolist(), hidden[row][valid.to(hidden.device)]))
    return rows


PADDING = 1.25  # a teacher-forcing pass runs at most this many tokens per reply token (right padding included)


def _teacher_force(model: nn.Module, cache: Any, cache_kw: str, prefill_kw: dict, input_ids: Tensor, mask: Tensor,
                   positions: Tensor, entries: list[Any], teacher: Teacher, seen: list[Tensor]) -> None:
    """Run each row's teacher reply (of >= 2 tokens) after its prompt, from the batch's KV cache.

    The reply's tokens but the last (which predicts nothing) run right-padded and masked, rows of similar
    length together (longest first, a pass padded to at most ``PADDING`` times its reply tokens); their
    states become the entry's continuation for that reply. The batch's own cache is left untouched.
    """
    wanted = []
    for row, entry in enumerate(entries):
        if entry is not None:
            reply = teacher(tuple(input_ids[row][mask[row].bool()].tolist()))
            if reply is not None and len(reply) >= 2:
                wanted.append((row, tuple(int(t) for t in reply)))
    wanted.sort(key=lambda pair: -len(pair[1]))
    passes: list[list[tuple[int, tuple[int, ...]]]] = []
    for pair in wanted:  # the longest reply of a pass is its first: its width
        if passes and len(passes[-1][0][1]) * (len(passes[-1]) + 1) <= \
                PADDING * (sum(len(r) for _, r in passes[-1]) + len(pair[1])):
            passes[-1].append(pair)
        else:
            passes.append([pair])
    for rows in passes:
        _teacher_pass(model, cache, cache_kw, prefill_kw, input_ids, mask, positions, entries, rows, seen)


def _select(cache: Any, index: Tensor) -> Any:
    """A cache of the rows ``index`` (CPU indices), the original left as it is."""
    layers = _layers(cache)
    if layers is None:  # another kind of cache: a whole copy, then the rows
        chosen = copy.deepcopy(cache)
        chosen.batch_select_indices(index)
        return chosen
    chosen = copy.copy(cache)
    chosen.layers = []
    for layer in layers:
        row = copy.copy(layer)
        row.keys, row.values = layer.keys[index.to(layer.keys.device)], layer.values[index.to(layer.values.device)]
        chosen.layers.append(row)
    return chosen


def _teacher_pass(model: nn.Module, cache: Any, cache_kw: str, prefill_kw: dict, input_ids: Tensor, mask: Tensor,
                  positions: Tensor, entries: list[Any], wanted: list[tuple[int, tuple[int, ...]]],
                  seen: list[Tensor]) -> None:
    """One forward of :func:`_teacher_force`: the replies of ``wanted`` (row, reply) after their prompts."""
    device = input_ids.device
    index = torch.tensor([row for row, _ in wanted], device=device)
    width = max(len(reply) - 1 for _, reply in wanted)
    ids = torch.zeros((len(wanted), width), dtype=input_ids.dtype, device=device)
    tail = torch.zeros((len(wanted), width), dtype=mask.dtype, device=device)
    for i, (_, reply) in enumerate(wanted):
        ids[i, :len(reply) - 1] = torch.tensor(reply[:-1], dtype=input_ids.dtype, device=device)
        tail[i, :len(reply) - 1] = 1
    start = positions[index, -1:] + 1
    model(input_ids=ids, attention_mask=torch.cat([mask[index], tail], dim=1),
          position_ids=start + torch.arange(width, device=device), use_cache=True,
          **{cache_kw: _select(cache, index.cpu())}, **prefill_kw)
    hidden = seen.pop().cpu()
    for i, (row, reply) in enumerate(wanted):
        entries[row].continuations[reply] = hidden[i, :len(reply) - 1]


@dataclass
class HeldPrefill:
    """A batch's prompt KV cache right after its prefill, held on the CPU until the replies to teacher-force
    after it are known (:func:`teacher_force_held`), with what :func:`_teacher_force` needs of the batch."""

    cache: Any
    devices: list[torch.device]  # each cache layer's device when it was held (a split model's differ)
    device: torch.device  # the input ids' device
    input_ids: Tensor
    mask: Tensor
    positions: Tensor
    entries: list[Any]  # the rows' capture entries (None: a prompt already kept from an earlier batch)
    size: int  # bytes of the cache


def _layers(cache: Any) -> list[Any] | None:
    """The cache's layers when each holds key and value tensors (transformers' DynamicCache); else None."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(getattr(layer, "keys", None), Tensor) and
                             isinstance(getattr(layer, "values", None), Tensor) for layer in layers):
        return None
    return list(layers)


def _hold(capture: HiddenCapture, cache: Any, input_ids: Tensor, mask: Tensor, positions: Tensor,
          entries: list[Any]) -> None:
    """Keep a copy of the batch's prompt KV cache on the CPU for :func:`teacher_force_held`, if it fits the
    capture's ``hold_bytes``; the batch's own cache (still decoding) is left untouched."""
    layers = _layers(cache)
    if layers is None or not any(entry is not None for entry in entries):
        return
    size = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
    if not capture.room_for(size):
        return
    held = copy.copy(cache)
    held.layers = []
    for layer in layers:
        copied = copy.copy(layer)
        copied.keys, copied.values = layer.keys.to("cpu", copy=True), layer.values.to("cpu", copy=True)
        held.layers.append(copied)
    capture.held.append(HeldPrefill(held, [layer.keys.device for layer in layers], input_ids.device, input_ids.cpu(),
                                    mask.cpu(), positions.cpu(), entries, size))
    capture.held_size += size


@torch.inference_mode()
def teacher_force_held(model: nn.Module, capture: HiddenCapture | None, teacher: Teacher) -> None:
    """Teacher-force the replies known now after the prompts whose KV caches ``capture`` holds (:func:`_hold`),
    as :func:`greedy_generate` does right after a prefill when the replies are known then; frees the caches.
    A held batch that runs out of CUDA memory is let go: the replies it did not reach run again, whole, in the
    divergence stage (with the same numbers)."""
    if capture is None or not capture.held:
        return
    seen: list[Tensor] = []
    hook = _capturing(model, seen)
    cache_kw, prefill_kw = _forward_kwargs(model)
    try:
        while capture.held:
            held = capture.held.pop(0)
            capture.held_size -= held.size
            if not _teacher_force_one(model, held, cache_kw, prefill_kw, teacher, seen):
                log.warning("CUDA out of memory teacher-forcing the replies after %d held prompts; the texts it did "
                            "not reach run again from their first token", len(held.entries))
                seen.clear()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            del held
    finally:
        hook.remove()


def _teacher_force_one(model: nn.Module, held: HeldPrefill, cache_kw: str, prefill_kw: dict, teacher: Teacher,
                       seen: list[Tensor]) -> bool:
    """One held batch's teacher forcing (its cache back on its devices); False when CUDA memory ran out."""
    try:
        for layer, device in zip(held.cache.layers, held.devices):
            layer.keys, layer.values = layer.keys.to(device), layer.values.to(device)
        _teacher_force(model, held.cache, cache_kw, prefill_kw, held.input_ids.to(held.device),
                       held.mask.to(held.device), held.positions.to(held.device), held.entries, teacher, seen)
        return True
    except torch.cuda.OutOfMemoryError:
        held.cache = None  # its layers on the device go with it
        return False


@torch.inference_mode()
def greedy_generate(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, *, max_new_tokens: int,
                    pad_token_id: int, stop: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None,
                    eos_token_ids: set[int] | None = None, capture: HiddenCapture | None = None,
                    teacher: Teacher | None = None, prefill_rows: int | None = None) -> Tensor:
    """Greedy decode of a left-padded batch; see the module docstring.

    ``stop``: strings that end a row once they appear in its decoded reply (``decode`` turns the
    reply's token ids into text; needed when ``stop`` is given). ``eos_token_ids``: tokens that
    end a row (default: the model's generation config). ``capture``: keeps each prompt's prefill
    and decode states, and with ``teacher`` (prompt ids -> a reply) that reply's teacher-forced
    states (module docstring); without ``teacher``, each batch's prompt KV cache is held for
    :func:`teacher_force_held` within the capture's ``hold_bytes``. ``prefill_rows``: prompts are prefilled
    that many rows at a time (each group padded to its own longest prompt) and then decode as one batch,
    so a decode step carries every unfinished row; None: one prefill of the whole batch. The groups are cut where
    padding would grow (:func:`prefill_groups`). A model whose caches cannot be joined (sliding-window layers,
    :func:`joins_caches`) prefills the batch at once: give it at most ``prefill_rows`` rows.
    """
    if capture is None:
        return _greedy(model, input_ids, attention_mask, max_new_tokens, pad_token_id, stop, decode, eos_token_ids,
                       None, None, [], prefill_rows)
    seen: list[Tensor] = []
    hook = _capturing(model, seen)
    try:
        return _greedy(model, input_ids, attention_mask, max_new_tokens, pad_token_id, stop, decode, eos_token_ids,
                       capture, teacher, seen, prefill_rows)
    finally:
        hook.remove()


def _prefill(model: nn.Module, input_ids: Tensor, mask: Tensor, cache_kw: str, prefill_kw: dict,
             capture: HiddenCapture | None, teacher: Teacher | None, seen: list[Tensor], trim: bool
             ) -> tuple[Any, Tensor, Tensor, Tensor, list[Any]]:
    """One group's prefill: (KV cache, mask, positions, last logits, capture entries); with ``trim``, the columns
    that pad every row of the group are dropped first. The capture's teacher-forcing or hold follows it."""
    if trim:
        first = first_used_column(mask)
        input_ids, mask = input_ids[:, first:], mask[:, first:]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache = _new_cache(model)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                   **{cache_kw: cache}, **prefill_kw).logits[:, -1]
    entries = _record_prefill(capture, input_ids, mask, seen.pop()) if capture is not None else []
    if teacher is not None and any(entry is not None for entry in entries):
        _teacher_force(model, cache, cache_kw, prefill_kw, input_ids, mask, positions, entries, teacher, seen)
    elif capture is not None and teacher is None and capture.hold_bytes:  # the replies are not known yet
        _hold(capture, cache, input_ids, mask, positions, entries)
    return cache, mask, positions, logits, entries


# a prefill group grows while it pads at most this many cells per prompt token and holds at most PREFILL_TOKENS
# prompt tokens: longer prompts gain nothing from sharing a forward (their matmuls are already large) and, alone,
# need no padding mask (torch's CPU attention runs its causal path 1.5x faster than a masked one)
PREFILL_PADDING = 1.1
PREFILL_TOKENS = 1024


def prefill_groups(lengths: Sequence[int], rows: int) -> list[tuple[int, int]]:
    """Consecutive rows ``[start, stop)`` prefilled together: at most ``rows`` of them, padded to at most
    ``PREFILL_PADDING`` times their tokens, at most ``PREFILL_TOKENS`` tokens (a single row may exceed both).
    lm-eval orders a batch by length, so neighbours are alike."""
    groups, start = [], 0
    while start < len(lengths):
        stop, longest, tokens = start + 1, lengths[start], lengths[start]
        while stop < len(lengths) and stop - start < rows:
            wider, more = max(longest, lengths[stop]), tokens + lengths[stop]
            if more > PREFILL_TOKENS or (stop - start + 1) * wider > PREFILL_PADDING * more:
                break
            stop, longest, tokens = stop + 1, wider, more
        groups.append((start, stop))
        start = stop
    return groups


def first_used_column(mask: Tensor) -> int:
    """The first column of a left-padded batch that some row uses (the columns before it pad every row)."""
    return int((mask.sum(0) > 0).nonzero()[0])


def joins_caches(model: nn.Module) -> bool:
    """Whether this model's KV caches of prompts prefilled apart can decode as one batch (:func:`_merge`)."""
    return _mergeable(_new_cache(model))


def _mergeable(cache: Any) -> bool:
    """Whether caches of this kind can be joined along the batch (:func:`_merge`): full-attention layers only
    (a sliding-window layer keeps a window, not every position)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers:
        return all(type(layer) is DynamicLayer for layer in layers)
    return getattr(cache, "layer_class_to_replicate", None) is DynamicLayer


def _left_pad(tensor: Tensor, width: int, dim: int) -> Tensor:
    missing = width - tensor.shape[dim]
    if not missing:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _merge(parts: list[tuple[Any, Tensor, Tensor, Tensor, list[Any]]]) -> tuple[Any, Tensor, Tensor, Tensor, list[Any]]:
    """Groups prefilled apart, joined into one batch: each left-padded (masked) to the longest, rows in order.

    Positions are explicit per row, so a row's padding changes no position; its keys there are masked out."""
    width = max(part[1].shape[1] for part in parts)
    cache = parts[0][0]
    for index, layer in enumerate(cache.layers):
        layer.keys = torch.cat([_left_pad(part[0].layers[index].keys, width, 2) for part in parts])
        layer.values = torch.cat([_left_pad(part[0].layers[index].values, width, 2) for part in parts])
    mask = torch.cat([_left_pad(part[1], width, 1) for part in parts])
    positions = torch.cat([_left_pad(part[2], width, 1) for part in parts])
    logits = torch.cat([part[3] for part in parts])
    return cache, mask, positions, logits, [entry for part in parts for entry in part[4]]


def _greedy(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int, pad_token_id: int,
            stop: Sequence[str], decode: Callable[[list[int]], str] | None, eos_token_ids: set[int] | None,
            capture: HiddenCapture | None, teacher: Teacher | None, seen: list[Tensor],
            prefill_rows: int | None = None) -> Tensor:
    """:func:`greedy_generate`'s decode; with ``capture``, ``seen`` receives the decoder's states of each forward."""
    if stop and decode is None:
        raise ValueError("greedy_generate: stop strings need a decode function")
    eos = _eos_ids(model) if eos_token_ids is None else set(eos_token_ids)
    if max_new_tokens <= 0:
        return input_ids
    batch = input_ids.shape[0]
    out = torch.full((batch, max_new_tokens), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    mask = attention_mask.to(input_ids.device).long()
    cache_kw, prefill_kw = _forward_kwargs(model)
    groups = prefill_groups(mask.sum(1).tolist(), prefill_rows) if prefill_rows and joins_caches(model) \
        else [(0, batch)]
    parts = [_prefill(model, input_ids[a:b], mask[a:b], cache_kw, prefill_kw, capture, teacher, seen,
                      trim=b - a < batch)
             for a, b in groups]
    cache, mask, positions, logits, entries = parts[0] if len(parts) == 1 else _merge(parts)
    del parts  # the groups' own caches: only the joined one is kept while decoding
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
        if capture is not None:
            states = seen.pop()[:, -1].cpu()
            for i, (row, tok) in enumerate(zip(rows.tolist(), token.tolist())):
                if entries[row] is not None:
                    entries[row].fed.append(tok)
                    entries[row].steps.append(states[i])
    return torch.cat([input_ids, out[:, :steps]], dim=1)



@torch.inference_mode()
def shared_context_logprobs(model: nn.Module, context: list[int], continuations: Sequence[list[int]], *,
                            pad_token_id: int, device: torch.device | str,
                            softmax_dtype: torch.dtype | None = None,
                            capture: HiddenCapture | None = None) -> list[tuple[float, bool]]:
    """(log-probability, greedy) of each continuation after one shared context, the context run once.

    lm-eval scores a k-way multiple-choice item as k sequences ``context + choice``, so the context
    is computed k times. Here it is computed once into a KV cache, which is repeated for the k
    choices; each choice then runs as ``[context[-1]] + choice[:-1]`` (right-padded). The numbers
    are those of the full sequences up to float rounding (different matmul shapes); both sides of
    a comparison use the same path. ``context`` needs at least 2 tokens. ``capture`` keeps the
    context's states and each choice's (the divergence stage scores the chosen one from them).
    """
    if len(context) < 2 or not continuations or any(not c for c in continuations):
        raise ValueError("shared_context_logprobs needs a context of >= 2 tokens and non-empty continuations")
    seen: list[Tensor] = []
    hook = _capturing(model, seen) if capture is not None else None
    try:
        return _shared_context(model, context, continuations, pad_token_id, device, softmax_dtype, capture, seen)
    finally:
        if hook is not None:
            hook.remove()


def _shared_context(model: nn.Module, context: list[int], continuations: Sequence[list[int]], pad_token_id: int,
                    device: torch.device | str, softmax_dtype: torch.dtype | None, capture: HiddenCapture | None,
                    seen: list[Tensor]) -> list[tuple[float, bool]]:
    """:func:`shared_context_logprobs`' forwards; with ``capture``, ``seen`` receives the decoder's states."""
    cache = _new_cache(model)
    cache_kw, prefill_kw = _forward_kwargs(model)
    prefix = torch.tensor([context[:-1]], device=device)
    model(input_ids=prefix, attention_mask=torch.ones_like(prefix), use_cache=True, **{cache_kw: cache}, **prefill_kw)
    entry = capture.add(context, seen.pop()[0]) if capture is not None else None
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
    if entry is not None:
        states = seen.pop().cpu()
        for row, cont in enumerate(continuations):
            entry.continuations[tuple(int(t) for t in cont)] = states[row, :len(cont)]
    logprobs = torch.log_softmax(logits, dim=-1, dtype=softmax_dtype)
    out = []
    for row, cont in enumerate(continuations):
        target = torch.tensor(cont, device=logprobs.device)
        rows = logprobs[row, :len(cont)]
        out.append((float(rows.gather(-1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())))
    return out
