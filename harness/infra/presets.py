"""Where presets come from: the package's ``conf/``, your own config directories, and models named by hub id.

A config directory is laid out as the package's ``conf/``: ``model/<name>.yaml``, ``quant/<name>.yaml`` and
``slices/<name>.yaml``, and for an offline slice of its own a directory ``slices/<name>/`` beside that YAML,
holding the slice's lm-eval task YAMLs and its item generator (lm-eval reads it as its ``include_path``).
Yours are named by, first to last:

* ``--config-dir DIR`` (``-cd DIR``), Hydra's flag of ``python -m harness``;
* ``hydra.searchpath=[file:///DIR,...]``, Hydra's override (a plain path is taken too);
* ``$HARNESS_CONFIG_PATH``: directories separated by ``os.pathsep`` (``:``), for a cluster's shared presets.

Each comes before the package's ``conf/`` on Hydra's search path, so a preset of yours named as a packaged
one shadows it (:func:`shadow_note` says so in one line). A model needs no preset at all:
``model=hf:<hub id or local directory>`` is composed here (:class:`HubModelSource`) with its name taken from
the id, or from the directory's own config.json, and its context length from that config.json when it is on
this machine. Nothing here touches the network.

Which directories are in use is set once per process by :func:`activate` (the command line does, and so does
:func:`harness.config.compose`); a job Hydra launched elsewhere (a Slurm array) reads them back from its
Hydra config's search path.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

from harness.errors import UsageError

ENV_VAR = "HARNESS_CONFIG_PATH"
PACKAGE_CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("model", "quant", "slices")
HUB_PREFIX = "hf:"  # model=hf:<hub id or directory>
PROVIDER = "harness"  # Hydra search-path provider of your directories: "harness (--config-dir)", ...
HUB_SCHEME = "harness-hub"
DEFAULT_MAX_LENGTH = 8192  # harness.config.ModelConfig.max_length


@dataclass(frozen=True)
class ConfigDir:
    """One of your config directories and what named it (``--config-dir``, ``hydra.searchpath``, ``$HARNESS_CONFIG_PATH``)."""

    path: Path
    via: str

    def __str__(self) -> str:
        return f"{self.path} ({self.via})"


def _searchpath_entry(entry: str) -> Path | None:
    """The directory of one ``hydra.searchpath`` entry: ``file://DIR``, ``pkg://module/sub`` or a plain path."""
    entry = str(entry).strip()
    if entry.startswith("file://"):
        return Path(entry[len("file://"):]).expanduser()
    if entry.startswith("pkg://"):
        module, _, sub = entry[len("pkg://"):].partition("/")
        try:
            spec = importlib.util.find_spec(module.replace("/", "."))
        except (ImportError, ValueError):
            return None
        locations = list(spec.submodule_search_locations or []) if spec else []
        return Path(locations[0]) / sub if locations else None
    if "://" in entry:  # another config source (structured://, ...): no directory of presets
        return None
    return Path(entry).expanduser() if entry else None


def searchpath_value(value: str) -> list[str]:
    """The entries of a ``hydra.searchpath=`` override's value, parsed as Hydra parses it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([f"hydra.searchpath={value}"])[0].value()
    except Exception:  # Hydra refuses it later, in its own words
        return []
    return [str(v) for v in parsed] if isinstance(parsed, list) else [str(parsed)]


def requested(args: Sequence[str], environ: Optional[dict] = None) -> list[ConfigDir]:
    """Your config directories named by command-line ``args`` and the environment, first to last.

    A directory named twice counts once (its first mention); the package's own ``conf/`` is never one of yours.
    A directory that does not exist is a :class:`UsageError` naming who named it.
    """
    environ = os.environ if environ is None else environ
    found: list[ConfigDir] = []
    args = list(args)
    for i, arg in enumerate(args):
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            found.append(ConfigDir(Path(args[i + 1]).expanduser(), "--config-dir"))
        elif arg.startswith("--config-dir="):
            found.append(ConfigDir(Path(arg.split("=", 1)[1]).expanduser(), "--config-dir"))
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") == "hydra.searchpath":
            for entry in searchpath_value(value):
                path = _searchpath_entry(entry)
                if path is not None:
                    found.append(ConfigDir(path, "hydra.searchpath"))
    for part in str(environ.get(ENV_VAR, "")).split(os.pathsep):
        if part.strip():
            found.append(ConfigDir(Path(part.strip()).expanduser(), f"${ENV_VAR}"))
    out: list[ConfigDir] = []
    seen = {PACKAGE_CONF.resolve()}
    for entry in found:
        resolved = entry.path.resolve()
        if resolved in seen:
            continue
        if not resolved.is_dir():
            raise UsageError(f"{entry.via} names {entry.path}, which is not a directory; give a config directory "
                             "holding model/, quant/ or slices/ presets")
        seen.add(resolved)
        out.append(ConfigDir(resolved, entry.via))
    return out


_ACTIVE: list[ConfigDir] | None = None


def activate(dirs: Iterable[ConfigDir]) -> list[ConfigDir]:
    """Use ``dirs`` as this process's config directories (Hydra's search path, slices, option lists)."""
    global _ACTIVE
    _ACTIVE = list(dirs)
    return _ACTIVE


def active() -> list[ConfigDir]:
    """This process's config directories: those :func:`activate` set; in a job Hydra launched (a Slurm array),
    those on its Hydra config's search path; else ``$HARNESS_CONFIG_PATH``'s."""
    if _ACTIVE is not None:
        return list(_ACTIVE)
    from_hydra = _from_hydra_config()
    if from_hydra is not None:
        return from_hydra
    return requested([])


def _from_hydra_config() -> list[ConfigDir] | None:
    try:
        from hydra.core.hydra_config import HydraConfig
        if not HydraConfig.initialized():
            return None
        sources = HydraConfig.get().runtime.config_sources
    except Exception:
        return None
    out = []
    for source in sources:
        provider = str(source.get("provider", ""))
        if provider.startswith(PROVIDER + " (") and source.get("schema") == "file":
            out.append(ConfigDir(Path(str(source.get("path"))), provider[len(PROVIDER) + 2:-1]))
    return out


def presets(group: str, dirs: Sequence[ConfigDir]) -> dict[str, ConfigDir | None]:
    """Every option of ``group``, name -> where it is read from (None: the package); the first directory wins."""
    out: dict[str, ConfigDir | None] = {}
    for directory in dirs:
        for path in sorted((directory.path / group).glob("*.yaml")):
            out.setdefault(path.stem, directory)
    for path in sorted((PACKAGE_CONF / group).glob("*.yaml")):
        out.setdefault(path.stem, None)
    return out


def shadowed(dirs: Sequence[ConfigDir]) -> list[tuple[str, str, ConfigDir]]:
    """(group, name, directory) of each of your presets named as a packaged one (yours is used)."""
    out = []
    for group in GROUPS:
        packaged = {p.stem for p in (PACKAGE_CONF / group).glob("*.yaml")}
        for name, where in presets(group, dirs).items():
            if where is not None and name in packaged:
                out.append((group, name, where))
    return out


def shadow_note(dirs: Sequence[ConfigDir]) -> str | None:
    """One line naming your presets that shadow packaged ones, or None."""
    found = shadowed(dirs)
    if not found:
        return None
    return "your presets shadow packaged ones of the same name (yours are used): " + ", ".join(
        f"{group}={name} from {where.path}" for group, name, where in found)


def describe_options(group: str, dirs: Sequence[ConfigDir]) -> str:
    """The options of ``group`` for a message: the package's, then each directory's, each with its source."""
    table = presets(group, dirs)
    parts = [", ".join(sorted(n for n, w in table.items() if w is None)) + " (packaged)"]
    for directory in dirs:
        mine = sorted(n for n, w in table.items() if w == directory)
        if mine:
            parts.append(f"{', '.join(mine)} (from {directory})")
    if group == "model":
        parts.append(f"or {HUB_PREFIX}<hub id or local directory>")
    return "; ".join(parts)


def slice_directory(name: str, dirs: Sequence[ConfigDir] | None = None) -> Path | None:
    """``slices/<name>/`` of the first of your directories holding it (task YAMLs, generate.py), else None."""
    for directory in active() if dirs is None else dirs:
        candidate = directory.path / "slices" / name
        if candidate.is_dir():
            return candidate
    return None


# ----------------------------------------------------------------------------------------------------------------
# model=hf:<hub id or directory>


def hub_model_config(target: str) -> dict:
    """The model section of ``model=hf:<target>``: source hf, its path, its name and what its config.json says.

    The name is the hub id's last part, or for a local directory the hub id its config.json records
    (``_name_or_path``), else the directory's name, made safe for run names. The context length is the config's
    ``max_position_embeddings`` where that is below the default (a hub id not in the local cache: the default).
    """
    target = str(target).strip()
    if not target:
        raise UsageError(f"model={HUB_PREFIX} names no model; give a hub id (model=hf:Qwen/Qwen3-8B) or a directory")
    local = Path(target).expanduser()
    config = read_config_json(target)
    if local.is_dir():
        recorded = str((config or {}).get("_name_or_path") or "")
        base = recorded if recorded and not Path(recorded).is_absolute() else local.resolve().name
        path = str(local.resolve())
    else:
        base, path = target, target
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in base.rstrip("/").split("/")[-1]) or "model"
    section: dict = {"name": name, "source": "hf", "path": path}
    positions = (config or {}).get("max_position_embeddings")
    if isinstance(positions, int) and 0 < positions < DEFAULT_MAX_LENGTH:
        section["max_length"] = positions
    if local.is_dir():
        section["chat_template"] = has_chat_template(local)
    return section


def read_config_json(target: str, revision: str | None = None) -> dict | None:
    """A model's config.json from a local directory or the local hub cache; None when neither has it."""
    local = Path(target).expanduser() / "config.json"
    if local.is_file():
        try:
            return json.loads(local.read_text())
        except (OSError, ValueError):
            return None
    try:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(target, "config.json", revision=revision)
    except Exception:  # not a hub id
        return None
    if isinstance(found, str):
        try:
            return json.loads(Path(found).read_text())
        except (OSError, ValueError):
            return None
    return None


def has_chat_template(directory: Path) -> bool:
    """Whether a saved tokenizer carries a chat template (an instruct model's prompts need it)."""
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    try:
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(tokenizer_config.get("chat_template"))


def expand_model_path(overrides: Sequence[str]) -> list[str]:
    """``model.path=DIR`` with no ``model=`` choice is ``model=hf:DIR``: a model from its path, named from its
    config, not the default preset's package with another path."""
    overrides = list(overrides)
    if any(re.match(r"[+~]*model=", o) for o in overrides):
        return overrides
    out = []
    for override in overrides:
        key, sep, value = override.partition("=")
        out.append(f"model={HUB_PREFIX}{value}" if sep and key == "model.path" and value else override)
    return out


def _hub_target(config_path: str) -> str | None:
    """``<target>`` of a Hydra config path ``model/hf:<target>[.yaml]``, else None."""
    prefix = f"model/{HUB_PREFIX}"
    if not config_path.startswith(prefix):
        return None
    target = config_path[len(prefix):]
    return target[:-len(".yaml")] if target.endswith(".yaml") else target


class UserConfigDirs(SearchPathPlugin):
    """Hydra's search path with your directories before the package's ``conf/``, and the hf: model source last."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        mains = [e for e in search_path.get_path() if e.provider == "main"]
        for directory in active():
            element = f"file://{directory.path}"
            if any(e.path == element for e in search_path.get_path()):
                continue
            provider = f"{PROVIDER} ({directory.via})"
            if mains:
                search_path.prepend(provider, element, anchor=SearchPathQuery(provider="main"))
            else:
                search_path.append(provider, element)
        search_path.append(PROVIDER, f"{HUB_SCHEME}://")


class HubModelSource(ConfigSource):
    """Answers Hydra's ``model/hf:<target>`` with :func:`hub_model_config` (no file, no network)."""

    @staticmethod
    def scheme() -> str:
        return HUB_SCHEME

    def load_config(self, config_path: str) -> ConfigResult:
        target = _hub_target(config_path)
        if target is None:
            raise ValueError(f"{config_path} is not a model=hf: config")
        return ConfigResult(config=OmegaConf.create(hub_model_config(target)), path=f"{HUB_SCHEME}://",
                            provider=self.provider, header={"package": None})

    def available(self) -> bool:
        return True

    def is_group(self, config_path: str) -> bool:
        return False

    def is_config(self, config_path: str) -> bool:
        return _hub_target(config_path) is not None

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> list[str]:
        return []


_REGISTERED = False


def register_with_hydra() -> None:
    """Register the search-path plugin and the hf: model source with Hydra (once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from hydra.core.plugins import Plugins

    for plugin in (UserConfigDirs, HubModelSource):
        Plugins.instance().register(plugin)
    _REGISTERED = True
