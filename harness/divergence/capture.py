"""The hidden states a model computed while answering the items, kept for the divergence stage.

A served text is an item's prompt as evaluated followed by the reference's reply. Its per-token
distributions under a model are the model's output head on the final (post-norm) hidden states at
its positions, and the forwards that answered the item already computed most of them: the prefill
ran the prompt, greedy decoding ran the model's own reply token by token, and on the quantized side
the reference's reply can be teacher-forced from the prompt's KV cache right after the prefill.
:class:`HiddenCapture` keeps those states by prompt token ids (filled by
:func:`harness.evaluation.generation.greedy_generate` and
:func:`~harness.evaluation.generation.shared_context_logprobs`), and :meth:`HiddenCapture.states`
assembles a served text's states from them, so neither model runs a prompt a second time. A text
whose states are not all known (a prompt read back from lm-eval's request checkpoint, one
truncated differently, a reply re-tokenized differently) is run again as before.

A slice the quantized side answers before its reference exists has no reply to teacher-force yet.
With ``hold_bytes`` > 0 each batch's prompt KV cache is then held (on the CPU, up to that many bytes
in all) and the replies are teacher-forced from it once the reference is read
(:func:`harness.evaluation.generation.teacher_force_held`): the prompt is still run once. A batch
whose cache does not fit is counted in ``not_held`` and its texts are run again.

States are kept on the CPU in the model's dtype: ``hidden_size`` values per prompt token (SmolLM2:
576 floats, 2.3 kB; the default job's ~65k prompt tokens: ~150 MB per model).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor


@dataclass
class CapturedPrompt:
    """One prompt's final hidden states from the forwards that answered it (CPU)."""

    prompt: Tensor  # [K, H] states of positions 0..K-1 (state i predicts token i + 1): K = P after a
    # generation's prefill, K = P - 1 after a shared-context scoring (its last token runs with each choice)
    fed: list[int] = field(default_factory=list)  # the model's own reply tokens fed back by greedy decoding
    steps: list[Tensor] = field(default_factory=list)  # [H] the state each fed token produced
    continuations: dict[tuple[int, ...], Tensor] = field(default_factory=dict)  # reply -> states of positions K..


class HiddenCapture:
    """Final hidden states of the prompts a model answered, by the prompt's token ids (module docstring).

    The first answer of a prompt is kept (a prompt answered twice has the same states).
    """

    def __init__(self, hold_bytes: int = 0) -> None:
        self.prompts: dict[tuple[int, ...], CapturedPrompt] = {}
        self.hold_bytes = hold_bytes  # prompt KV caches held for replies known later, at most (0: none)
        self.held: list[Any] = []  # harness.evaluation.generation.HeldPrefill, in the order of the batches
        self.held_size = 0  # bytes held now
        self.not_held = 0  # batches whose cache did not fit (their texts are run again)

    def room_for(self, size: int) -> bool:
        """Whether a cache of ``size`` bytes may be held; counts it in ``not_held`` when not."""
        if self.held_size + size <= self.hold_bytes:
            return True
        self.not_held += 1
        return False

    def __len__(self) -> int:
        return len(self.prompts)

    def add(self, prompt_ids: Sequence[int], states: Tensor) -> CapturedPrompt | None:
        """Record a prompt's states (moved to the CPU); None when the prompt is already recorded."""
        key = tuple(int(t) for t in prompt_ids)
        if key in self.prompts:
            return None
        self.prompts[key] = row = CapturedPrompt(states.detach().cpu())
        return row

    def states(self, prompt_ids: Sequence[int], reply_ids: Sequence[int]) -> Tensor | None:
        """[P + R - 1, H] states predicting tokens 1.. of ``prompt_ids + reply_ids``; None unless all are known.

        Along the reply: the model's own decode states while its reply is the given one (a
        teacher-forced pass computes the same: the same tokens after the same prompt), then the
        stored continuation states of that reply.
        """
        row = self.prompts.get(tuple(int(t) for t in prompt_ids))
        if row is None:
            return None
        prompt, reply = len(prompt_ids), tuple(int(t) for t in reply_ids)
        need, known = prompt + len(reply) - 1, len(row.prompt)
        if need <= known:
            return row.prompt[:need]
        parts, done = [row.prompt], known
        if known == prompt:  # after a prefill: the model's own decode states where its reply is this one
            own = 0
            while done < need and own < len(row.fed) and row.fed[own] == reply[own]:
                own, done = own + 1, done + 1
            if own:
                parts.append(torch.stack(row.steps[:own]))
        if done < need:
            continuation = row.continuations.get(reply)
            if continuation is None or known + len(continuation) < need:
                return None
            parts.append(continuation[done - known:need - known])
        return torch.cat(parts)
