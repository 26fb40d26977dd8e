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

States are kept on the CPU in the model's dtype: ``hidden_size`` values per prompt token (SmolLM2:
576 floats, 2.3 kB; the default job's ~65k prompt tokens: ~150 MB per model).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

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

    def __init__(self) -> None:
        self.prompts: dict[tuple[int, ...], CapturedPrompt] = {}

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
