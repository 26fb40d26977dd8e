"""One command-line convention for every entry point: Hydra-style ``key=value`` overrides.

Every ``python -m harness.<tool>`` takes the same kinds of argument:

* ``key=value`` (dotted keys for nested fields, ``[a,b]`` for lists) setting a field of the
  tool's own options dataclass (:attr:`Tool.options`);
* for tools that work on a model and scheme (:attr:`Tool.run_config`), every other
  ``key=value`` is a Hydra override of the run config, composed exactly as
  ``python -m harness`` composes it (``model=... quant=... slices=... eval.batch_size=8``);
* bare words (paths) collected into the field named by :attr:`Tool.positional`;
* ``-h`` / ``--help`` prints the options with their defaults and exits 0;
* ``-v`` / ``--verbose`` shows libraries' log messages on the console too (otherwise they go
  to the job's log, :func:`harness.infra.joblog.job_console`).

A typo (an unknown key, a wrong type, an unknown config-group option) fails before any work,
with a message in one style: ``error: <what is wrong>; <what is valid>``, exit status 2.
:func:`main` also turns the errors a user can fix (bad model source, bad scheme, unreachable
tracking server, ...) into that one clean message instead of a traceback; real bugs keep theirs.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Sequence, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.errors import EXIT_USAGE, UsageError, UserError

T = TypeVar("T")
_HELP = ("-h", "--help", "help")
_VERBOSE = ("-v", "--verbose")
_GROUPS = ("model", "quant", "slices")


@dataclass(frozen=True)
class Tool(Generic[T]):
    """What an entry point accepts: its own options, and whether it composes the run config."""

    prog: str  # e.g. "python -m harness.gate"
    summary: str  # one paragraph for --help
    options: type[T] | None = None  # dataclass of the tool's own key=value options
    run_config: bool = False  # other key=value arguments are overrides of the run config
    positional: str | None = None  # options field (a list) that collects bare arguments
    flags: tuple[str, ...] = ()  # bare flags the tool accepts (e.g. "-m"); returned in Parsed.flags
    bad_input_status: int = EXIT_USAGE  # exit status of a user error (harness.decision.gate: 3, since 2 means inconclusive)


@dataclass
class Parsed(Generic[T]):
    options: T | None
    overrides: list[str] = field(default_factory=list)  # run-config overrides, as given
    flags: set[str] = field(default_factory=set)
    _run: Any = None

    @property
    def run(self):
        """The composed, validated :class:`harness.config.RunConfig` (composed once, on first use)."""
        if self._run is None:
            self._run = compose_run(self.overrides)
        return self._run


def _field_names(schema: type) -> set[str]:
    return {f.name for f in dataclasses.fields(schema)}


def group_option_problem(overrides: Sequence[str]) -> str | None:
    """Name unknown config-group options and list the available ones with where each comes from (Hydra does not
    for lists): the package's presets, those of your config directories (``--config-dir``, ``hydra.searchpath``,
    ``$HARNESS_CONFIG_PATH``: :mod:`harness.infra.presets`), and for a model ``hf:<hub id or directory>``."""
    from harness.config import moved_settings_problem
    from harness.infra import presets

    try:
        dirs = presets.requested(overrides)
    except UsageError as exc:
        return str(exc)
    for arg in overrides:
        moved = moved_settings_problem(arg.split("=", 1)[0])
        if moved:
            return moved
        match = re.fullmatch(r"(?:\+|~)?(model|quant|slices)=(.+)", arg)
        if not match:
            continue
        group, value = match.groups()
        options = presets.presets(group, dirs)
        chosen = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
        unknown = [v for v in chosen if v not in options and not (group == "model" and v.startswith(presets.HUB_PREFIX))]
        if unknown:
            return f"unknown {group} option(s) {unknown}; available {group} options: " \
                   f"{presets.describe_options(group, dirs)}"
    return None


def prepare_main_args(argv: Sequence[str]) -> list[str]:
    """``python -m harness``'s arguments before Hydra reads them: ``model.path=DIR`` alone becomes
    ``model=hf:DIR``; your config directories are put on Hydra's search path (before the package's); an unknown
    group option is a :class:`UsageError`; your presets that shadow packaged ones are said in one line (stderr)."""
    from harness.infra import presets

    argv = presets.expand_model_path(argv)
    problem = group_option_problem(argv)
    if problem:
        raise UsageError(problem)
    dirs = presets.activate(presets.requested(argv))
    note = presets.shadow_note(dirs)
    if note:
        print(note, file=sys.stderr)
    return argv


def compose_run(overrides: Sequence[str]):
    """The run config for ``overrides`` as a typed object; bad overrides raise :class:`UsageError`."""
    from hydra.errors import HydraException

    from harness.config import compose

    overrides = _config_dir_as_searchpath(overrides)
    problem = group_option_problem(overrides)
    if problem:
        raise UsageError(problem)
    try:
        return OmegaConf.to_object(compose(list(overrides)))
    except (HydraException, OmegaConfBaseException) as exc:
        raise UsageError(f"{_first_line(exc)}; see `python -m harness --cfg job` for the run config's keys") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _build_options(schema: type[T], assignments: list[str], positional: list[str], positional_field: str | None,
                   prog: str) -> T:
    base = OmegaConf.structured(schema)
    try:
        given = OmegaConf.from_dotlist(assignments)
        if positional_field is not None and positional:
            given = OmegaConf.merge(given, {positional_field: positional})
        merged = OmegaConf.merge(base, given)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        valid = ", ".join(sorted(_field_names(schema)))
        key = getattr(exc, "full_key", None)
        where = f"{key}: " if key else ""
        raise UsageError(f"{where}{_first_line(exc)}; {prog} options: {valid}") from exc


def parse(tool: Tool[T], argv: Sequence[str]) -> Parsed[T]:
    """Split ``argv`` into the tool's options, run-config overrides and flags (see the module doc)."""
    own = _field_names(tool.options) if tool.options else set()
    assignments: list[str] = []
    overrides: list[str] = []
    bare: list[str] = []
    flags: set[str] = set()
    argv = _config_dir_as_searchpath(argv) if tool.run_config else list(argv)
    for arg in argv:
        if arg in tool.flags:
            flags.add(arg)
            continue
        if arg.startswith("-") and "=" not in arg:
            raise UsageError(f"unknown flag {arg!r}; {tool.prog} takes key=value arguments"
                             + (f" and the flags {', '.join(tool.flags)}" if tool.flags else "")
                             + " (see --help)")
        key, sep, _ = arg.partition("=")
        if not sep:
            if tool.positional is None:
                raise UsageError(f"argument {arg!r} is not key=value; {tool.prog} takes no bare arguments (see --help)")
            bare.append(arg)
            continue
        head = key.lstrip("+~").split(".")[0]
        if head in own:
            assignments.append(arg)
        elif tool.run_config:
            overrides.append(arg)
        else:
            valid = ", ".join(sorted(own)) or "none"
            raise UsageError(f"unknown option {key!r}; {tool.prog} options: {valid}")
    if tool.options is not None:
        options = _build_options(tool.options, assignments, bare, tool.positional, tool.prog)
    else:
        options = None
    parsed: Parsed[T] = Parsed(options, overrides, flags)
    if tool.run_config:
        problem = group_option_problem(overrides)
        if problem:
            raise UsageError(problem)
    return parsed


def _config_dir_as_searchpath(argv: Sequence[str]) -> list[str]:
    """``--config-dir DIR`` (``-cd DIR``, ``--config-dir=DIR``) as ``python -m harness`` takes it: your config
    directory first on the search path, here written as the first entry of ``hydra.searchpath``."""
    dirs: list[str] = []
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config-dir", "-cd"):
            if i + 1 >= len(args):
                raise UsageError(f"{arg} needs a directory: {arg} DIR")
            dirs.append(args[i + 1])
            i += 2
            continue
        if arg.startswith("--config-dir="):
            dirs.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    if not dirs:
        return rest
    from harness.infra import presets

    entries = [f"file://{Path(d).expanduser().resolve()}" for d in dirs]
    for j, arg in enumerate(rest):
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") == "hydra.searchpath":
            rest[j] = f"hydra.searchpath=[{','.join(entries + presets.searchpath_value(value))}]"
            return rest
    return [*rest, f"hydra.searchpath=[{','.join(entries)}]"]


def _describe_type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "")


def help_text(tool: Tool, argv: Sequence[str] = ()) -> str:
    """Usage, the options with their types, defaults and comments, and the run-config groups with every preset and
    where it comes from (the package, or a config directory of yours that ``argv`` or the environment names)."""
    from harness.infra import presets

    usage = [tool.prog]
    if tool.positional:
        usage.append(f"[{tool.positional.upper()} ...]")
    if tool.options:
        usage.append("[option=value ...]")
    if tool.run_config:
        usage.append("[model=... quant=... slices=... other run overrides]")
    lines = ["usage: " + " ".join(usage), "", tool.summary.strip(), ""]
    if tool.options:
        lines.append("options:")
        defaults = OmegaConf.structured(tool.options)
        for f in dataclasses.fields(tool.options):
            value = defaults.get(f.name) if f.name in defaults else None
            shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            note = f.metadata.get("help", "")
            lines.append(f"  {f.name}={shown!s}  ({_describe_type(f.type)}){'  ' + note if note else ''}")
    lines.append("flags: " + " ".join([*tool.flags, "-v (libraries' messages on the console too)"]))
    if tool.run_config:
        lines.append("")
        lines.append("run config (as `python -m harness`; `python -m harness --cfg job` prints every key):")
        try:
            dirs = presets.requested(argv)
        except UsageError:
            dirs = []
        for group in _GROUPS:
            lines.append(f"  {group}=  {presets.describe_options(group, dirs)}")
        lines.append("  your own presets: --config-dir DIR, hydra.searchpath=[file://DIR] or "
                     f"${presets.ENV_VAR} (docs/guides/your-own-presets.md)")
    return "\n".join(lines)


def _say_shadowed(overrides: Sequence[str]) -> None:
    """One line on stderr when your presets shadow packaged ones of the same name."""
    from harness.infra import presets

    try:
        note = presets.shadow_note(presets.requested(overrides))
    except UsageError:
        return  # said when the run config is composed
    if note:
        print(note, file=sys.stderr)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types whose message already names the problem and its fix (no traceback needed):
    every :class:`harness.errors.UserError`, and a missing file named by the user."""
    return (UserError, FileNotFoundError)


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(tool: Tool[T], body: Callable[[Parsed[T]], int | None], argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` for ``tool`` and call ``body``; user-fixable errors print one line and exit with
    ``tool.bad_input_status`` (2 unless the tool says otherwise).

    ``body`` returns the exit status (``None`` means 0). Logging is set up once here.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = any(a in _VERBOSE for a in argv)
    argv = [a for a in argv if a not in _VERBOSE]
    if any(a in _HELP for a in argv):
        print(help_text(tool, argv))
        return 0
    try:
        parsed = parse(tool, argv)
    except UsageError as exc:
        fail(str(exc))
        return tool.bad_input_status
    if tool.run_config:
        _say_shadowed(parsed.overrides)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    from harness.infra.joblog import job_console

    try:
        with job_console(verbose=verbose):
            status = body(parsed)
    except user_errors() as exc:
        fail(str(exc))
        return tool.bad_input_status
    return 0 if status is None else int(status)
