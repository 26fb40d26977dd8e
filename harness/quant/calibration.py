"""Calibration data for methods that need activations (GPTQ, AWQ, SmoothQuant, static scales).

``quant.calibration.source`` chooses the text: an offline source of a given domain (``prose``,
the default, also called ``offline``; ``code``; ``multilingual``; ``math`` — built from what the
installed packages ship, see :mod:`harness.quant.calibration_sources`) or ``dataset``, a ``datasets``
dataset (name, config, split, text field) for cluster runs. Evaluation items are never used.
Seeded windows of ``seq_len`` tokens are drawn from the text; the token ids are hashed, and the
hash is logged and is part of every calibrated cache key (with the source and a digest of its
text for every source but the default: see :func:`source_identity`).

``quant.calibration.format`` lays each window out as the model is prompted: ``chat`` (the
default for a model evaluated through its chat template, ``auto``) renders consecutive stretches
of the source as user turns and assistant replies through the tokenizer's chat template (system
prompt included, as the evaluation renders it) and keeps the first ``seq_len`` tokens, so the
Hessians and activation ranges a method fits include the template's tokens and the positions
after them; ``plain`` keeps raw text windows (a base model's only format). The chat layout is
part of the calibrated cache key (:func:`source_identity`) besides the token hash.

:func:`calibration_passes` lists the parts of a scheme that run over the calibration set (its method, when
the method's registration says it needs calibration, and static scales); :func:`check_context` refuses a
context that lacks what they need before any weight changes.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from harness.config import CalibrationConfig, QuantConfig
from harness.infra.cache import Cache, stable_hash
from harness.quant import calibration_sources
from harness.quant.format_table import SchemeError
from harness.quant.methods import CONTEXT_NEEDS, get_method

log = logging.getLogger(__name__)

DATASET = "dataset"
FORMATS = ("auto", "chat", "plain")
# The chat layout: a user turn of USER_TOKENS source tokens, then a reply of REPLY_TOKENS, repeated until
# the rendered conversation fills seq_len (at 512: about two exchanges after the system prompt).
USER_TOKENS, REPLY_TOKENS = 64, 192


def available_sources() -> list[str]:
    """Every value quant.calibration.source accepts."""
    return calibration_sources.names() + [DATASET]


def validate_calibration(config: CalibrationConfig) -> None:
    """Config-time checks: a known source, a dataset name for ``dataset``, positive sizes."""
    if config.source != DATASET:
        try:
            calibration_sources.canonical(config.source)
        except KeyError:
            kinds = "; ".join(f"{s.name}: {s.kind}" for s in calibration_sources.SOURCES.values())
            raise SchemeError(f"quant.calibration.source={config.source!r} is unknown; use one of "
                              f"{available_sources()} ({kinds}; offline = prose; dataset: quant.calibration.dataset "
                              "from the datasets hub)") from None
    elif not config.dataset:
        raise SchemeError("quant.calibration.source=dataset needs quant.calibration.dataset (a datasets name, e.g. "
                          "wikitext, with quant.calibration.dataset_config); or use an offline source")
    for name in ("num_samples", "seq_len"):
        if getattr(config, name) < 1:
            raise SchemeError(f"quant.calibration.{name}={getattr(config, name)} must be at least 1")
    if config.format not in FORMATS:
        raise SchemeError(f"quant.calibration.format={config.format!r} is unknown; use chat (user turn + assistant "
                          "reply in the model's chat template), plain (raw text) or auto (chat when the model is "
                          "evaluated with its chat template)")


def calibration_passes(scheme: QuantConfig) -> list[tuple[str, frozenset[str]]]:
    """Each part of the scheme that runs over the calibration set, with what it needs from the context.

    The method (when calibrated), static activation scales and static KV-cache scales each make
    one pass; methods under ``rtn`` calibrate too when a scale is static (fp8_static, kv8).
    """
    passes = []
    spec = get_method(scheme.method)
    if spec.calibrated:
        passes.append((f"quant.method={spec.name}", spec.needs))
    if scheme.activations is not None and not scheme.activations.dynamic:
        passes.append(("static activation scales (quant.activations.dynamic=false)", frozenset({"batches"})))
    kv = scheme.kv_cache
    if kv is not None and any(s is not None and not s.dynamic for s in (kv.keys, kv.values)):
        passes.append(("static KV-cache scales (quant.kv_cache.*.dynamic=false)", frozenset({"batches"})))
    return passes


def check_context(scheme: QuantConfig, context: Any) -> None:
    """Refuse a context that lacks what the scheme's calibration passes need, before any work."""
    for what, needs in calibration_passes(scheme):
        missing = [f"{CONTEXT_NEEDS[n]}()" for n in sorted(needs) if not hasattr(context, CONTEXT_NEEDS[n])]
        if missing:
            raise SchemeError(f"{what} needs calibration data (a context with {', '.join(missing)}): pass a "
                              "CalibrationContext to quant.apply")


def check_format(config: CalibrationConfig, chat_template: bool, model_name: str) -> None:
    """Config-time check: ``format=chat`` needs a model evaluated through its chat template."""
    if config.format == "chat" and not chat_template:
        raise SchemeError(f"quant.calibration.format=chat: model {model_name!r} is not evaluated with a chat "
                          "template (model.chat_template=false), so its calibration has no chat format to follow; "
                          "use quant.calibration.format=plain (or auto), or model.chat_template=true")


def resolved_format(config: CalibrationConfig, chat_template: bool) -> str:
    """``chat`` or ``plain``: ``auto`` follows whether the model is evaluated with its chat template."""
    if config.format == "auto":
        return "chat" if chat_template else "plain"
    return config.format


CHAT_LAYOUT = f"chat-v1/{USER_TOKENS}+{REPLY_TOKENS}"  # what the cache key records of the chat layout


def source_identity(config: CalibrationConfig, chat: bool = False) -> dict[str, Any] | None:
    """What the calibrated-weight cache key records about the source: None for the default in plain format.

    The default (``prose``/``offline``) adds nothing, so its keys are those from before sources
    existed; any other source adds its name and a digest of its text (an offline source) or the
    dataset's coordinates, so a code-calibrated and a prose-calibrated GPTQ never share an entry
    even if their token hashes were equal. ``chat`` (the resolved format) adds the chat layout.
    """
    if config.source == DATASET:
        identity: dict[str, Any] | None = {"source": DATASET, "dataset": config.dataset,
                                           "dataset_config": config.dataset_config, "split": config.split,
                                           "text_field": config.text_field}
    elif calibration_sources.is_default(config.source):
        identity = None
    else:
        name = calibration_sources.canonical(config.source)
        identity = {"source": name, "digest": calibration_sources.source_digest(name)}
    if chat:
        identity = {**(identity or {}), "format": CHAT_LAYOUT}
    return identity


def offline_corpus(source: str = calibration_sources.DEFAULT) -> str:
    """The text of an offline source (default: the prose docstrings, as before sources existed)."""
    return calibration_sources.source_text(source)


def dataset_corpus(config: CalibrationConfig) -> str:
    from datasets import load_dataset

    data = load_dataset(config.dataset, config.dataset_config, split=config.split)
    return "\n\n".join(t for t in data[config.text_field] if t and t.strip())


def calibration_tokens(tokenizer: Any, config: CalibrationConfig, chat: bool = False,
                       think_tags: tuple[str, str] | None = None, template_args: dict | None = None) -> Tensor:
    """[num_samples, seq_len] token windows sampled (seeded) from the corpus; ``chat``: as conversations, thinking
    as the model is evaluated (``think_tags``, ``template_args``: :func:`chat_window`)."""
    validate_calibration(config)
    text = dataset_corpus(config) if config.source == DATASET else offline_corpus(config.source)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    needed = config.seq_len
    if len(ids) <= needed:
        raise SchemeError(f"calibration source {config.source!r} has {len(ids)} tokens, fewer than "
                          f"quant.calibration.seq_len={needed}; lower seq_len or use a larger source")
    rng = random.Random(f"calibration/{config.seed}")
    starts = [rng.randrange(0, len(ids) - needed) for _ in range(config.num_samples)]
    if chat:
        return torch.stack([chat_window(tokenizer, ids, start, needed, think_tags, template_args) for start in starts])
    return torch.stack([ids[s:s + needed] for s in starts])


def chat_window(tokenizer: Any, ids: Tensor, start: int, length: int, think_tags: tuple[str, str] | None = None,
                template_args: dict | None = None) -> Tensor:
    """``length`` tokens of a conversation rendered through the tokenizer's chat template.

    From ``start`` on, the source is cut into alternating user turns (:data:`USER_TOKENS`) and
    assistant replies (:data:`REPLY_TOKENS`), decoded, rendered as the evaluation renders a prompt
    (the template's own system prompt and special tokens) and encoded as lm-eval encodes one
    (``divergence.encode_prompt``); exchanges are added until the conversation reaches ``length``
    tokens, then it is cut there. Windows running past the end of the source wrap to its start.

    A thinking model (``think_tags``: its trace's tags) is calibrated as it is evaluated: each assistant reply is a
    trace (its first half, between the tags) and an answer (the rest), and ``template_args`` (``enable_thinking``)
    go to the chat template, which renders the traces it keeps as it does when the model is served.
    """
    from harness.divergence.scoring import encode_prompt

    if not getattr(tokenizer, "chat_template", None):
        raise SchemeError("quant.calibration.format=chat: the model's tokenizer has no chat template; use "
                          "quant.calibration.format=plain")
    messages: list[dict[str, str]] = []
    cursor = start
    while True:
        for role, size in (("user", USER_TOKENS), ("assistant", REPLY_TOKENS)):
            piece = ids[torch.arange(cursor, cursor + size) % len(ids)]
            content = tokenizer.decode(piece).strip()
            if role == "assistant" and think_tags is not None:
                half = size // 2
                content = (f"{think_tags[0]}\n{tokenizer.decode(piece[:half]).strip()}\n{think_tags[1]}\n\n"
                           f"{tokenizer.decode(piece[half:]).strip()}")
            messages.append({"role": role, "content": content})
            cursor += size
        encoded = encode_prompt(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False,
                                                                         **(template_args or {})))
        if len(encoded) >= length:
            return torch.tensor(encoded[:length], dtype=torch.long)


@dataclass
class CalibrationContext:
    """What a method may need besides the model; the token set is built on first use."""

    model_key: str
    tokenizer: Any
    config: CalibrationConfig
    device: torch.device
    cache: Cache
    scheme: QuantConfig
    batch_size: int = 8
    chat_template: bool = False  # the model is evaluated through its chat template (format=auto follows it)
    # a thinking model's trace tags (model.thinking): chat-format calibration replies carry a trace (chat_window)
    think_tags: tuple[str, str] | None = None
    template_args: dict = field(default_factory=dict)  # e.g. enable_thinking, passed to the chat template
    _tokens: Tensor | None = field(default=None, repr=False)

    @property
    def format(self) -> str:
        """The calibration format in force: chat or plain."""
        return resolved_format(self.config, self.chat_template)

    def tokens(self) -> Tensor:
        if self._tokens is None:
            chat = self.format == "chat"
            self._tokens = calibration_tokens(self.tokenizer, self.config, chat=chat,
                                              think_tags=self.think_tags if chat else None,
                                              template_args=self.template_args if chat else None)
            thinking = f", thinking {self.think_tags[0]}…{self.think_tags[1]} {self.template_args}" \
                if chat and self.think_tags else ""
            log.info("calibration set (%s, %s%s): %d x %d tokens, hash %s", self.config.source, self.format, thinking,
                     *self._tokens.shape, self.calibration_hash)
        return self._tokens

    @property
    def calibration_hash(self) -> str:
        return stable_hash(self.tokens().tolist(), 16)

    def calibration_batches(self) -> list[Tensor]:
        tokens = self.tokens()
        return [tokens[i:i + self.batch_size] for i in range(0, len(tokens), self.batch_size)]
