"""Slices: named groups of lm-eval tasks plus the texts their divergence is measured on.

An offline slice is a directory ``slices/<name>/`` (of the package, or beside your own
``slices/<name>.yaml`` in a config directory of yours: :mod:`harness.infra.presets`) holding lm-eval task YAMLs whose
``custom_dataset`` hook calls the slice's deterministic item generator
(``slices/<name>/generate.py``). The harness passes the item-set settings (size, seed,
item count, tokenizer) as lm-eval task metadata, so lm-eval and the harness see the same
items. A registry slice names tasks from lm-eval's own registry (real benchmarks that
need the dataset hub) and is meant for cluster runs.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from harness.config import SLICES_DIR, SliceConfig
from harness.errors import UserError
from harness.infra import presets
from harness.infra.cache import stable_hash


class SliceError(UserError, ValueError):
    """A slice cannot be used as configured; the message says why and what to do."""


@dataclass(frozen=True)
class Slice:
    name: str
    config: SliceConfig
    directory: Path | None  # None for registry slices

    def metadata(self, seed: int, tokenizer_path: str | None = None, max_length: int | None = None) -> dict[str, Any]:
        """Item-set settings handed to the generator (through lm-eval's task metadata)."""
        meta: dict[str, Any] = {"size": self.config.size, "seed": seed}
        if self.config.n_items is not None:
            meta["n_items"] = self.config.n_items
        if tokenizer_path:
            meta["tokenizer"] = tokenizer_path
        if max_length:
            meta["max_length"] = max_length
        meta.update(dict(self.config.metadata))
        return meta

    def generator(self) -> ModuleType:
        if self.directory is None:
            raise SliceError(f"slice {self.name!r} is a registry slice and has no offline generator")
        return import_slice_module(self.directory, "generate")

    def items(self, **metadata: Any) -> list[dict]:
        return self.generator().items(**metadata)

    def divergence_texts(self, **metadata: Any) -> list[str]:
        """Gold texts (prompt + reference answer) on which KL and PPL are measured."""
        module = self.generator()
        if hasattr(module, "divergence_texts"):
            texts = list(module.divergence_texts(**metadata))
        else:
            texts = [item["gold_text"] for item in module.items(**metadata) if item.get("gold_text")]
        return texts[: self.config.divergence_texts]


def import_slice_module(directory: Path, name: str) -> ModuleType:
    """Import ``<directory>/<name>.py`` under a unique module name (slices are not a package)."""
    qualified = f"harness_slice_{directory.name}_{name}"
    if directory.resolve().parent != SLICES_DIR.resolve():  # a slice of your config directory: its own module
        qualified = f"harness_slice_{directory.name}_{stable_hash(str(directory.resolve()), 8)}_{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    path = directory / f"{name}.py"
    spec = importlib.util.spec_from_file_location(qualified, path)
    if spec is None or spec.loader is None:
        raise SliceError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    sys.path.insert(0, str(directory))  # the generator may import its siblings
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(directory))
    return module


def resolve(slices: dict[str, SliceConfig]) -> list[Slice]:
    """Check every selected slice before any model is loaded."""
    if not slices:
        raise SliceError("no slices selected; pass e.g. slices=math or slices=all")
    resolved = []
    for name, config in slices.items():
        if config.registry:
            resolved.append(Slice(name, config, None))
            continue
        # slices/<name>/ of your config directories first (harness.infra.presets), then the package's
        directory = presets.slice_directory(name) or SLICES_DIR / name
        if not (directory / "generate.py").exists():
            available = sorted(p.name for p in SLICES_DIR.iterdir() if (p / "generate.py").exists())
            mine = [f"{d.path}/slices/" for d in presets.active()]
            raise SliceError(f"slice {name!r} has no generator at {directory}/generate.py; offline slices: {available}"
                             + (f" and those under {', '.join(mine)}" if mine else "")
                             + "; an offline slice is slices/<name>/ with its task YAMLs and generate.py")
        yaml_tasks = {p.stem for p in directory.glob("*.yaml")}
        missing = [t for t in config.tasks if t not in yaml_tasks]
        if missing:
            raise SliceError(f"slice {name!r} names tasks {missing} that have no YAML in {directory}; found {sorted(yaml_tasks)}")
        if config.size not in getattr(import_slice_module(directory, "generate"), "SIZES", {config.size: 0}):
            raise SliceError(f"slice {name!r}: size={config.size!r} is not one of "
                             f"{sorted(import_slice_module(directory, 'generate').SIZES)}")
        resolved.append(Slice(name, config, directory))
    return resolved


def check_hub_for_registry(slices: list[Slice]) -> None:
    """Registry tasks download datasets from the hub: fail fast when it is unreachable."""
    registry = [s for s in slices if s.directory is None]
    if not registry:
        return
    names = ", ".join(f"{s.name} ({', '.join(s.config.tasks)})" for s in registry)
    if os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("0", "") or os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        raise SliceError(f"registry slices {names} need the dataset hub but HF_(HUB|DATASETS)_OFFLINE is set; "
                         "run them on a machine with hub access, or use the offline slices (e.g. slices=all)")
    from huggingface_hub import HfApi
    try:
        next(iter(HfApi().list_datasets(limit=1)), None)
    except Exception as exc:
        raise SliceError(
            f"registry slices {names} download their datasets from the Hugging Face hub, which cannot be reached "
            f"here ({type(exc).__name__}). Fix: run them on a machine with hub access (a cluster job), or pick the "
            "offline slices (slices=all, slices=math, ...).") from None
