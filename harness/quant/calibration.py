"""Calibration data for methods that need activations (GPTQ, AWQ, SmoothQuant, static scales).

``quant.calibration.source`` chooses the text: an offline source of a given domain (``prose``,
the default, also called ``offline``; ``code``; ``multilingual``; ``math`` — built from what the
installed packages ship, see :mod:`harness.calibration_sources`) or ``dataset``, a ``datasets``
dataset (name, config, split, text field) for cluster runs. Evaluation items are never used.
Seeded windows of ``seq_len`` tokens are drawn from the text; the token ids are hashed, and the
hash is logged and is part of every calibrated cache key (with the source and a digest of its
text for every source but the default: see :func:`source_identity`).
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from harness import calibration_sources
from harness.cache import Cache, stable_hash
from harness.config import CalibrationConfig, QuantConfig
from harness.quant.tensor import SchemeError

log = logging.getLogger(__name__)

DATASET = "dataset"


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


def source_identity(config: CalibrationConfig) -> dict[str, Any] | None:
    """What the calibrated-weight cache key records about the source: None for the default.

    The default (``prose``/``offline``) adds nothing, so its keys are those from before sources
    existed; any other source adds its name and a digest of its text (an offline source) or the
    dataset's coordinates, so a code-calibrated and a prose-calibrated GPTQ never share an entry
    even if their token hashes were equal.
    """
    if config.source == DATASET:
        return {"source": DATASET, "dataset": config.dataset, "dataset_config": config.dataset_config,
                "split": config.split, "text_field": config.text_field}
    if calibration_sources.is_default(config.source):
        return None
    name = calibration_sources.canonical(config.source)
    return {"source": name, "digest": calibration_sources.source_digest(name)}


def offline_corpus(source: str = calibration_sources.DEFAULT) -> str:
    """The text of an offline source (default: the prose docstrings, as before sources existed)."""
    return calibration_sources.source_text(source)


def dataset_corpus(config: CalibrationConfig) -> str:
    from datasets import load_dataset

    data = load_dataset(config.dataset, config.dataset_config, split=config.split)
    return "\n\n".join(t for t in data[config.text_field] if t and t.strip())


def calibration_tokens(tokenizer: Any, config: CalibrationConfig) -> Tensor:
    """[num_samples, seq_len] token windows sampled (seeded) from the corpus."""
    validate_calibration(config)
    text = dataset_corpus(config) if config.source == DATASET else offline_corpus(config.source)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    needed = config.seq_len
    if len(ids) <= needed:
        raise SchemeError(f"calibration source {config.source!r} has {len(ids)} tokens, fewer than "
                          f"quant.calibration.seq_len={needed}; lower seq_len or use a larger source")
    rng = random.Random(f"calibration/{config.seed}")
    starts = [rng.randrange(0, len(ids) - needed) for _ in range(config.num_samples)]
    return torch.stack([ids[s:s + needed] for s in starts])


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
    _tokens: Tensor | None = field(default=None, repr=False)

    def tokens(self) -> Tensor:
        if self._tokens is None:
            self._tokens = calibration_tokens(self.tokenizer, self.config)
            log.info("calibration set (%s): %d x %d tokens, hash %s", self.config.source, *self._tokens.shape,
                     self.calibration_hash)
        return self._tokens

    @property
    def calibration_hash(self) -> str:
        return stable_hash(self.tokens().tolist(), 16)

    def calibration_batches(self) -> list[Tensor]:
        tokens = self.tokens()
        return [tokens[i:i + self.batch_size] for i in range(0, len(tokens), self.batch_size)]
