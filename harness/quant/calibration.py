"""Calibration data for methods that need activations (GPTQ, AWQ, SmoothQuant, static scales).

Two sources: a ``datasets`` dataset (name, config, split, text field) for cluster runs,
and an offline default that works without any hub: English prose and code shipped by
installed packages (the docstrings of Python's standard library modules, in a fixed
order). Evaluation items are never used. The token ids of the calibration set are hashed;
the hash is logged and is part of every calibrated cache key.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from harness.cache import Cache, stable_hash
from harness.config import CalibrationConfig, QuantConfig

log = logging.getLogger(__name__)

# Standard-library modules with long, well-written docstrings; fixed so every machine agrees.
_OFFLINE_MODULES = (
    "argparse", "asyncio.events", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "fractions", "functools", "heapq", "http.client",
    "http.server", "inspect", "ipaddress", "itertools", "json", "logging", "multiprocessing.pool", "pathlib",
    "pickle", "random", "re", "shutil", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "tokenize", "typing", "unittest.case", "urllib.parse", "uuid", "zipfile",
)


def offline_corpus() -> str:
    """Deterministic text from the installed standard library's docstrings."""
    parts: list[str] = []
    for name in _OFFLINE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        docs = [inspect.getdoc(module) or ""]
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if getattr(obj, "__module__", None) == module.__name__ and (inspect.isclass(obj) or inspect.isfunction(obj)):
                docs.append(inspect.getdoc(obj) or "")
        parts.append("\n\n".join(d for d in docs if len(d) > 80))
    return "\n\n".join(parts)


def dataset_corpus(config: CalibrationConfig) -> str:
    from datasets import load_dataset

    data = load_dataset(config.dataset, config.dataset_config, split=config.split)
    return "\n\n".join(t for t in data[config.text_field] if t and t.strip())


def calibration_tokens(tokenizer: Any, config: CalibrationConfig) -> Tensor:
    """[num_samples, seq_len] token windows sampled (seeded) from the corpus."""
    text = offline_corpus() if config.source == "offline" else dataset_corpus(config)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    needed = config.seq_len
    if len(ids) <= needed:
        raise ValueError(f"calibration corpus has {len(ids)} tokens, fewer than calibration.seq_len={needed}")
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
            log.info("calibration set: %d x %d tokens, hash %s", *self._tokens.shape, self.calibration_hash)
        return self._tokens

    @property
    def calibration_hash(self) -> str:
        return stable_hash(self.tokens().tolist(), 16)

    def calibration_batches(self) -> list[Tensor]:
        tokens = self.tokens()
        return [tokens[i:i + self.batch_size] for i in range(0, len(tokens), self.batch_size)]
