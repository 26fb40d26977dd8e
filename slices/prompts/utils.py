"""The prompts slice's task and per-reply scorer.

:class:`PromptLogTask` renders each row's own chat messages (system prompt and earlier turns kept) through the
model's chat template, or as plain ``Role: text`` turns for a model without one, and gives each request its row's
token cap (``max_tokens``; lowered by ``eval.max_gen_toks`` where that cap is lower).

There is no gold answer. ``acc`` is a **usable reply**: not empty, not a refusal (the refusals slice's matcher),
not ending in a loop (the long-generation slice's detector). The token-cap hit needs the reply's tokens and is
counted with the other two-reply outcomes in :mod:`harness.results.prompt_outcomes`, as are the outcomes that
compare the two replies (identical, first differing token, length ratio, JSON / code / language kept).
"""
from __future__ import annotations

import json
from typing import Any

from lm_eval.api.task import ConfigurableTask

from harness.results import prompt_outcomes


def _messages(doc: dict) -> list[dict[str, str]]:
    return [dict(m) for m in json.loads(doc["messages_json"])]


class PromptLogTask(ConfigurableTask):
    """A generation task whose prompt is the row's whole conversation, each request with the row's own cap."""

    def __init__(self, *args: Any, config: dict | None = None, **kwargs: Any) -> None:
        config = {k: v for k, v in dict(config or {}).items() if k != "class"}
        super().__init__(*args, config=config, **kwargs)
        default = int((self.config.metadata or {}).get("max_tokens") or 0)
        if default > 0:  # prompts.max_tokens: the cap of rows without their own
            generation = dict(self.config.generation_kwargs or {})
            generation["max_gen_toks"] = default
            self.set_config(key="generation_kwargs", value=generation)
        self._base_cap = int((self.config.generation_kwargs or {}).get("max_gen_toks", 256))

    def fewshot_context(self, doc: dict, num_fewshot: int, system_instruction: str | None = None,
                        apply_chat_template: bool = False, fewshot_as_multiturn: bool = False,
                        chat_template: Any = None, gen_prefix: str | None = None) -> str:
        messages = _messages(doc)
        if system_instruction:  # lm-eval's --system_instruction, before the row's own
            messages = [{"role": "system", "content": system_instruction}, *messages]
        if apply_chat_template and chat_template is not None:
            return chat_template(messages, add_generation_prompt=True)
        return plain_text(messages)

    def construct_requests(self, doc: dict, ctx: Any, **kwargs: Any) -> Any:
        requests = super().construct_requests(doc, ctx, **kwargs)
        row_cap = int(doc.get("max_tokens") or 0)
        for request in requests if isinstance(requests, list) else [requests]:
            context, generation = request.arguments
            generation = dict(generation)
            current = int(generation.get("max_gen_toks", self._base_cap))
            # the row's own cap; a lower cap set over the task (eval.max_gen_toks, a thinking budget) still binds
            cap = row_cap if row_cap > 0 else current
            generation["max_gen_toks"] = min(cap, current) if current < self._base_cap else cap
            request.arguments = (context, generation)
        return requests


def plain_text(messages: list[dict[str, str]]) -> str:
    """A conversation as plain turns for a model without a chat template, ending where the assistant answers."""
    names = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
    turns = [f"{names.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
    return "\n\n".join(turns) + "\n\nAssistant:"


def score(response: str) -> dict[str, int]:
    """A reply's gold-free checks (harness.results.prompt_outcomes.reply_checks): ``acc`` (usable), ``refused``,
    ``loop``, ``empty``."""
    checks = prompt_outcomes.reply_checks(response)
    usable = not (checks["empty"] or checks["refused"] or checks["loop"])
    return {"acc": int(usable), "refused": checks["refused"], "loop": checks["loop"], "empty": checks["empty"]}


def process_results(doc: dict, results: list[str]) -> dict[str, int]:
    """lm-eval hook: ``acc`` is a usable reply; ``refused`` and ``loop`` say why one is not."""
    out = score(results[0])
    out.pop("empty")
    return out
