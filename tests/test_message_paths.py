"""Every repository path the code names to a user exists: in an error message, a warning, a log line or a docstring.

A message that says "see harness/candidate.py" after that file moved sends a user nowhere. The check reads
every string literal of ``harness/`` and ``slices/`` (f-strings' fixed parts included), picks out what looks
like a path into this repository (``harness/…``, ``conf/…``, ``scripts/…``, ``docs/…``, ``benchmarks/…``,
``slices/…``, ``tests/…``), and asks the file system. Paths with a placeholder (``<name>``, ``{model}``,
``*``) are templates, not names, and are left out.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("harness", "conf", "scripts", "docs", "benchmarks", "slices", "tests", "notebooks")
PATH = re.compile(r"(?<![\w./-])(?:" + "|".join(ROOTS) + r")/[\w./-]*[\w/]")


def string_literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant in a Python file, f-strings' fixed parts included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def named_paths(text: str) -> list[str]:
    """The repository paths named in ``text`` (templates with ``<``, ``{`` or ``*`` left out)."""
    found = []
    for match in PATH.finditer(text):
        end = match.end()
        if end < len(text) and text[end] in "<{*":
            continue  # e.g. conf/quant/<name>.yaml, results/{key}
        found.append(match.group(0).rstrip("."))
    return found


def missing_paths(sources: list[Path]) -> list[str]:
    out = []
    for source in sources:
        for line, text in string_literals(source):
            for name in named_paths(text):
                if not (REPO / name).exists():
                    out.append(f"{source.relative_to(REPO)}:{line}: {name}")
    return out


def test_every_path_named_in_the_code_exists():
    sources = sorted((REPO / "harness").rglob("*.py")) + sorted((REPO / "slices").rglob("*.py"))
    assert len(sources) > 100
    assert missing_paths(sources) == []


def test_the_check_finds_a_stale_path_and_skips_a_template(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('raise ValueError("see harness/candidate.py or conf/quant/<name>.yaml, or harness/cli.py")\n')
    names = [name for _, text in string_literals(planted) for name in named_paths(text)]
    assert names == ["harness/candidate.py", "harness/cli.py"]
    assert [name for name in names if not (REPO / name).exists()] == ["harness/candidate.py"]
