"""The package's structure: no import circle, and no import that runs back up the layer table.

The import graph is built from the source of ``harness/`` (every ``import`` and ``from ... import``,
inside functions too), not from what Python happened to import, so an import deferred into a
function to dodge an ImportError still counts. The layers are read from the table in the README's
*Architecture* section: each row may import only from the rows below it.
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "harness"


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its ``__init__``)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:`` (never executed, so never a runtime edge)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node) if isinstance(child, (ast.Import, ast.ImportFrom)))
    return skipped


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the harness modules it imports (``from harness import x`` names module ``harness.x``)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_only(tree)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            found.update(target for name in names if name.split(".")[0] == "harness"
                         for target in [resolve(name)] if target and target != module)
        graph[module] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_table(readme: Path = REPO / "README.md") -> list[str]:
    """The first-column paths of the README's architecture table, top row first (``harness/x/`` or ``harness/x.py``)."""
    text = readme.read_text()
    section = text.split("## Architecture", 1)
    assert len(section) == 2, "README.md has no '## Architecture' section with the layer table"
    rows = [line for line in section[1].split("\n## ", 1)[0].splitlines() if line.startswith("| `harness/")]
    return [re.match(r"\| `(harness/[^`]+)`", row).group(1) for row in rows]


def layer_of(module: str, layers: list[str]) -> int:
    """Row of the table that holds ``module`` (row 0, the command line, holds what no other row names)."""
    path = module.replace(".", "/")
    for row, entry in enumerate(layers):
        if entry.endswith("/") and (path + "/").startswith(entry):
            return row
        if entry.endswith(".py") and path == entry[:-3]:
            return row
    return 0


@lru_cache(maxsize=1)
def package_graph() -> dict[str, frozenset[str]]:
    return {module: frozenset(targets) for module, targets in import_graph(module_files()).items()}


def test_the_package_has_no_import_circle():
    graph = package_graph()
    assert len(graph) > 50  # the whole package was read
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle_through_a_function_level_import(tmp_path):
    root = tmp_path / "harness"
    (root / "a").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a" / "__init__.py").write_text('"""A package."""\n')
    (root / "a" / "one.py").write_text("from harness.b import two\n")
    (root / "b.py").write_text("def f():\n    from harness.a import one\n")
    (root / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from harness.b import f\n")
    graph = import_graph(module_files(root))
    assert graph["harness.b"] == {"harness.a.one"}
    assert graph["harness.c"] == set()  # a type-only import is no edge
    assert cycles(graph) == [["harness.a.one", "harness.b"]]


def test_no_module_imports_a_layer_above_its_own():
    layers = layer_table()
    assert layers[-1] == "harness/errors.py" and "harness/job/" in layers  # the table was found and read
    for entry in layers[1:]:  # every row names something that exists
        assert (REPO / entry).exists(), f"README's architecture table names {entry}, which does not exist"
    upward = sorted(f"{module} (row {layer_of(module, layers)}) imports {target} (row {layer_of(target, layers)})"
                    for module, targets in package_graph().items() for target in targets
                    if layer_of(target, layers) < layer_of(module, layers))
    assert upward == []


def test_every_module_sits_in_a_row_of_the_table():
    layers = layer_table()
    top_level = {m for m in module_files() if m.count(".") == 1 and not (PACKAGE / m.split(".")[1]).is_dir()}
    commands = {m for m in top_level if layer_of(m, layers) == 0}
    # the top level holds the entry points and the command faces, each a few lines
    for module in commands:
        path = PACKAGE / (module.split(".")[1] + ".py")
        if path.name not in ("__init__.py", "__main__.py"):
            assert len(path.read_text().splitlines()) <= 10, f"{path} is a command face: it only calls the library"


# quant's __init__ is its method registry: importing it registers every method, so it imports torch by design
@pytest.mark.parametrize("package", sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()
                                           and p.name != "quant"))
def test_package_inits_are_cheap_to_import(package):
    source = (PACKAGE / package / "__init__.py").read_text()
    tree = ast.parse(source)
    heavy = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             and any(alias.name.split(".")[0] in {"torch", "transformers", "lm_eval", "mlflow", "matplotlib"}
                     for alias in node.names) or isinstance(node, ast.ImportFrom)
             and (node.module or "").split(".")[0] in {"torch", "transformers", "lm_eval", "mlflow", "matplotlib"}]
    assert heavy == [], f"harness/{package}/__init__.py imports {heavy}: keep a package's face cheap"
