"""The ``code`` calibration source: Python source of standard-library modules, docstrings cut.

Real, idiomatic Python (definitions, control flow, comments) that every machine with the same
Python has. Docstrings are removed so the text is code rather than the ``prose`` source again;
a docstring that is a body's only statement stays (removing it would leave invalid code), so
every module's text still parses. HumanEval is not used: the code slice evaluates on its
problems and scores KL on their canonical solutions.
"""
from __future__ import annotations

import ast
import importlib
import inspect

# Pure-Python modules, mostly code; fixed so every machine with the same Python agrees.
MODULES = (
    "argparse", "base64", "bisect", "calendar", "colorsys", "configparser", "copy", "csv", "dataclasses",
    "difflib", "enum", "fnmatch", "fractions", "functools", "glob", "graphlib", "heapq", "html.parser",
    "ipaddress", "json.decoder", "json.encoder", "pprint", "queue", "random", "sched", "shlex", "statistics",
    "string", "textwrap", "tokenize", "urllib.parse", "uuid",
)


def _docstring_lines(tree: ast.Module) -> set[int]:
    """1-based line numbers of docstrings that can be removed without emptying a body."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        first = body[0] if body else None
        if (len(body) > 1 and isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def strip_docstrings(source: str) -> str:
    """``source`` without the lines of its removable docstrings (comments are kept)."""
    drop = _docstring_lines(ast.parse(source))
    return "\n".join(line for number, line in enumerate(source.splitlines(), 1) if number not in drop)


def module_sources() -> list[tuple[str, str]]:
    """(module name, source without docstrings) for each module of MODULES that imports."""
    out = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
            source = inspect.getsource(module)
        except (ImportError, OSError, TypeError):
            continue
        out.append((name, strip_docstrings(source)))
    return out


def code_text() -> str:
    return "\n\n".join(f"# module: {name}\n{source}" for name, source in module_sources())
