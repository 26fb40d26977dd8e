"""Compare finished runs of the harness, schemes × slices (see :mod:`harness.compare`).

``python -m harness.compare experiment=quant-harness [sweep=ID] [tags.KEY=VALUE ...]
[runs=[ID,...]] [dirs=[results/...,...]] [tracking.uri=URI] [margin=0.02] [correction=holm|bh|none]
[name=NAME] [out=results/compare/NAME] [log=true]``
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any, Sequence

from harness.compare.options import CompareOptions
from harness.compare.pipeline import execute
from harness.compare.render.terminal import terminal_table

__all__ = ["main", "parse_cli"]

_ALIASES = {"tracking.uri": "tracking_uri", "compare.margin": "margin", "compare.correction": "correction"}


def _split_list(value: str) -> list[str]:
    return [part.strip().strip("'\"") for part in value.strip().strip("[]").split(",") if part.strip()]


def _convert(name: str, raw: str) -> Any:
    kind = {f.name: str(f.type) for f in dataclasses.fields(CompareOptions)}[name]
    if raw.lower() in ("null", "none") and "None" in kind:
        return None
    try:
        if kind.startswith("list[int]"):
            return [int(v) for v in _split_list(raw)]
        if kind.startswith("list"):
            return _split_list(raw)
        if kind == "bool":
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        if kind.startswith("float"):
            return float(raw)
        if kind == "int":
            return int(raw)
    except ValueError:
        raise SystemExit(f"error: {name}={raw!r} is not a valid {kind}") from None
    return raw


def parse_cli(argv: Sequence[str]) -> CompareOptions:
    """``key=value`` arguments (``tags.KEY=VALUE`` for MLflow tags) into ``CompareOptions``."""
    names = [f.name for f in dataclasses.fields(CompareOptions)]
    values: dict[str, Any] = {"tags": {}}
    for arg in argv:
        key, sep, raw = arg.partition("=")
        if not sep:
            raise SystemExit(f"error: argument {arg!r} is not key=value, e.g. experiment=quant-harness sweep=ID")
        if key.startswith("tags."):
            values["tags"][key[len("tags."):]] = raw
            continue
        key = _ALIASES.get(key, key)
        if key not in names or key == "tags":
            raise SystemExit(f"error: unknown option {key!r}; valid: {', '.join(_ALIASES)}, tags.KEY, "
                             f"{', '.join(n for n in names if n != 'tags')}")
        values[key] = _convert(key, raw)
    options = CompareOptions(**values)
    try:
        options.check()
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return options


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per downloaded table
    options = parse_cli(argv)
    try:
        report = execute(options, write=True)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(terminal_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
