"""The ``prose`` calibration source: standard-library docstrings, in a fixed order.

This was the only offline calibration text before sources existed (then called ``offline``);
it is built exactly as it was then, so default calibration sets and cache keys are unchanged.
"""
from __future__ import annotations

import importlib
import inspect

# Standard-library modules with long, well-written docstrings; fixed so every machine agrees.
MODULES = (
    "argparse", "asyncio.events", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "fractions", "functools", "heapq", "http.client",
    "http.server", "inspect", "ipaddress", "itertools", "json", "logging", "multiprocessing.pool", "pathlib",
    "pickle", "random", "re", "shutil", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "tokenize", "typing", "unittest.case", "urllib.parse", "uuid", "zipfile",
)


def prose_text() -> str:
    """Deterministic text from the installed standard library's docstrings."""
    parts: list[str] = []
    for name in MODULES:
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
