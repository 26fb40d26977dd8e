"""``python -m harness.compare key=value ...``: compare finished runs (see :mod:`harness.compare`).

The arguments follow :mod:`harness.cli` (options = :class:`CompareOptions`, ``--help`` lists
them). On top of that convention this command keeps its historical spellings:
``tracking.uri``, ``compare.margin`` and ``compare.correction`` are aliases of
``tracking_uri``, ``margin`` and ``correction``, ``tags.KEY=VALUE`` adds one MLflow tag (KEY
may contain dots, e.g. ``tags.harness.kind``), and string values stay the text typed (run id
``0123`` or sweep ``1e5`` are not read as numbers).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Sequence

from harness import cli
from harness.compare.comparison import execute
from harness.compare.options import CompareOptions
from harness.compare.render.terminal import terminal_table
from harness.errors import UsageError

__all__ = ["ALIASES", "TOOL", "main", "normalise", "parse_options"]

ALIASES = {"tracking.uri": "tracking_uri", "compare.margin": "margin", "compare.correction": "correction"}

TOOL = cli.Tool(
    prog="python -m harness.compare",
    summary="Side-by-side comparison of finished runs: schemes × slices with paired statistics corrected across "
            "every test of the comparison. Runs come from MLflow (experiment, sweep=ID, tags.KEY=VALUE, "
            "runs=[ID,...]) or from results directories (dirs=[...]); writes results/compare/<name>/ "
            "(comparison.md, comparison.html, plots, parquet tables) and logs it as an MLflow run tagged "
            "harness.kind=comparison. Aliases: tracking.uri, compare.margin, compare.correction.",
    options=CompareOptions,
)

_KINDS = {f.name: str(f.type) for f in dataclasses.fields(CompareOptions)}


def _quoted(text: str) -> str:
    """``text`` as a YAML single-quoted scalar that OmegaConf keeps verbatim (no interpolation)."""
    return "'" + text.replace("'", "''").replace("${", "\\${") + "'"


def _split_list(value: str) -> list[str]:
    return [part.strip().strip("'\"") for part in value.strip().strip("[]").split(",") if part.strip()]


def _literal(key: str, raw: str) -> str:
    kind = _KINDS.get(key, "")
    if raw.lower() in ("null", "none") and "None" in kind:
        return "null"
    if kind.startswith("str"):
        return _quoted(raw)
    if kind == "list[str]":
        return "[" + ",".join(_quoted(part) for part in _split_list(raw)) + "]"
    return raw


def normalise(argv: Sequence[str]) -> list[str]:
    """Rewrite aliases, fold every ``tags.KEY=VALUE`` into one ``tags={...}`` and quote string values,
    so :func:`harness.cli.parse` reads this command's historical spellings; other arguments pass as given."""
    out: list[str] = []
    tags: dict[str, str] = {}
    for arg in argv:
        key, sep, raw = arg.partition("=")
        if not sep:
            out.append(arg)
        elif key.startswith("tags.") and len(key) > len("tags."):
            tags[key[len("tags."):]] = raw
        else:
            key = ALIASES.get(key, key)
            out.append(f"{key}={_literal(key, raw)}")
    if tags:
        out.append("tags={" + ", ".join(f"{_quoted(k)}: {_quoted(v)}" for k, v in tags.items()) + "}")
    return out


def _checked(options: CompareOptions) -> CompareOptions:
    try:
        options.check()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return options


def parse_options(argv: Sequence[str]) -> CompareOptions:
    """The command line as :class:`CompareOptions`; a bad argument raises :class:`harness.UsageError`."""
    return _checked(cli.parse(TOOL, normalise(argv)).options)


def _body(parsed: cli.Parsed[CompareOptions]) -> int:
    options = _checked(parsed.options)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per downloaded table
    try:
        report = execute(options, write=True)
    except ValueError as exc:  # no such experiment, no matching runs, a comparison run given as a run
        return cli.fail(str(exc))
    print(terminal_table(report))
    if not options.dirs:  # runs from MLflow: the same runs side by side in its UI
        from harness.results.tracking import headline_link

        link = headline_link(options.tracking_uri, options.experiment, options.sweep)
        if link:
            print(f"MLflow headline view: {link}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; user errors print one ``error: ...`` line and return 2."""
    return cli.main(TOOL, _body, normalise(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
