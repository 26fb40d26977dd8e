"""The package's structure: no import circle, and no import that runs back up the layer table.

The import graph is built from the source of ``harness/`` (every ``import`` and ``from ... import``,
inside functions too, and every ``importlib.import_module`` / ``__import__`` call whose module name is a
string literal), not from what Python happened to import, so an import deferred into a function to dodge
an ImportError still counts. The layers are read from the table in the README's *Architecture* section:
each row may import only from the rows below it, and every module must sit in a row.
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path
from typing import Collection, Mapping

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


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING`` (any ``<module>.TYPE_CHECKING``)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING" and isinstance(test.value, ast.Name)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Ids of the nodes that never run, so hold no runtime edge: the body of ``if TYPE_CHECKING:`` and the
    ``else:`` of ``if not TYPE_CHECKING:``.

    The other branch of each runs, so its imports are edges; so are both branches of a test that merely
    mentions the flag (``if TYPE_CHECKING or x:`` may run either).
    """
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        if _is_type_checking(node.test):
            dead = node.body
        elif isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not) \
                and _is_type_checking(node.test.operand):
            dead = node.orelse
        else:
            continue
        skipped.update(id(child) for statement in dead for child in ast.walk(statement))
    return skipped


def _literal(node: ast.expr | None) -> str | None:
    """The value of a string literal; None for anything else (a name computed at run time)."""
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _argument(call: ast.Call, position: int, keyword: str) -> ast.expr | None:
    """A call's argument, given by position or by keyword; None when it is not given."""
    if len(call.args) > position:
        return call.args[position]
    return next((given.value for given in call.keywords if given.arg == keyword), None)


def _relative(name: str, level: int, package: str) -> str:
    """``name`` imported ``level`` dots up from ``package`` (level 0: ``name`` itself), as Python resolves it."""
    if not level:
        return name
    base = package.rsplit(".", level - 1)[0]
    return f"{base}.{name}" if name else base


def _from_import(base: str, level: int, names: list[str], package: str, modules: Collection[str]) -> list[str]:
    """What ``from <level dots><base> import <names>`` imports: ``base.name`` where that is a module, else ``base``."""
    base = _relative(base, level, package)
    return [f"{base}.{name}" if f"{base}.{name}" in modules else base for name in names]


def _importlib_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The names the module binds (at any scope) to ``importlib`` and to ``importlib.import_module``."""
    packages: set[str] = set()
    functions: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):  # `import importlib.util` binds `importlib` too
            packages.update(alias.asname or "importlib" for alias in node.names
                            if alias.name == "importlib" or alias.asname is None and alias.name.startswith("importlib."))
        elif isinstance(node, ast.ImportFrom) and node.module == "importlib" and not node.level:
            functions.update(alias.asname or alias.name for alias in node.names if alias.name == "import_module")
    return packages, functions


def _call_import(call: ast.Call, module: str, package: str, importlib_names: tuple[set[str], set[str]],
                 modules: Collection[str]) -> list[str]:
    """What an import call imports when its module name is a string literal: ``importlib.import_module(name)``
    (absolute, or relative with a literal ``package=``, ``__package__`` or ``__name__``), ``import_module(name)``
    imported from importlib, and ``__import__(name, ..., fromlist, level)``. [] for any other call, and for a
    name computed at run time, which cannot be resolved from the source."""
    packages, functions = importlib_names
    func = call.func
    name = _literal(_argument(call, 0, "name"))
    if name is None:
        return []
    if isinstance(func, ast.Name) and func.id == "__import__":
        level_node = _argument(call, 4, "level")
        level = 0 if level_node is None else getattr(level_node, "value", None)
        if not isinstance(level, int):
            return []
        fromlist = _argument(call, 3, "fromlist")
        names = [item for element in getattr(fromlist, "elts", []) for item in [_literal(element)] if item]
        return _from_import(name, level, names, package, modules) if names else [_relative(name, level, package)]
    named = isinstance(func, ast.Name) and func.id in functions  # import_module(...), from importlib
    dotted = isinstance(func, ast.Attribute) and func.attr == "import_module" \
        and isinstance(func.value, ast.Name) and func.value.id in packages  # importlib.import_module(...)
    if named or dotted:
        level = len(name) - len(name.lstrip("."))
        if not level:
            return [name]
        anchor = _argument(call, 1, "package")
        base = _literal(anchor) if not isinstance(anchor, ast.Name) else \
            {"__package__": package, "__name__": module}.get(anchor.id)
        return [_relative(name[level:], level, base)] if base else []
    return []


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
        importlib_names = _importlib_names(tree)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = _from_import(node.module or "", node.level, [alias.name for alias in node.names], package,
                                     modules)
            elif isinstance(node, ast.Call):
                names = _call_import(node, module, package, importlib_names, modules)
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


_RUNS_MAIN = {"main()", "raise SystemExit(main())", "sys.exit(main())"}


def is_command_face(path: Path) -> bool:
    """Whether ``harness/<tool>.py`` is a command face: a thin entry point that only runs a library ``main``.

    Its body, after an optional docstring, is exactly one ``from harness.<module> import main`` (or a relative
    ``from .<module> import main``) and one ``if __name__ == "__main__":`` whose body is ``main()``,
    ``raise SystemExit(main())`` or ``sys.exit(main())``; ``from __future__ import ...`` and ``import sys`` may
    stand beside them. Any other statement is library code, which belongs in a row of its own.
    """
    body = ast.parse(path.read_text(), filename=str(path)).body
    if body and isinstance(body[0], ast.Expr) and _literal(body[0].value) is not None:
        body = body[1:]
    imports_main = runs_main = False
    for statement in body:
        if isinstance(statement, ast.ImportFrom) and statement.module == "__future__":
            continue
        if isinstance(statement, ast.Import) and [(a.name, a.asname) for a in statement.names] == [("sys", None)]:
            continue
        if isinstance(statement, ast.ImportFrom) and not imports_main \
                and [(a.name, a.asname) for a in statement.names] == [("main", None)] \
                and (statement.level == 0 and (statement.module or "").startswith("harness.")
                     or statement.level == 1 and statement.module):
            imports_main = True
            continue
        if isinstance(statement, ast.If) and not runs_main and not statement.orelse \
                and ast.unparse(statement.test) == "__name__ == '__main__'" \
                and len(statement.body) == 1 and ast.unparse(statement.body[0]) in _RUNS_MAIN:
            runs_main = True
            continue
        return False
    return imports_main and runs_main


def command_faces(modules: dict[str, Path]) -> set[str]:
    """The top-level modules (``harness/<tool>.py``) that are command faces (:func:`is_command_face`)."""
    return {module for module, path in modules.items()
            if module.count(".") == 1 and path.name == module.split(".")[1] + ".py" and is_command_face(path)}


def layer_of(module: str, layers: list[str], faces: Collection[str] = ()) -> int | None:
    """Row of the table that holds ``module``; None when no row does (such a module cannot be checked).

    A row names a package (``harness/x/``: every module under it) or a top-level module (``harness/x.py``).
    Row 0 is written ``harness/__main__.py and the command faces (harness/<tool>.py)``: beside ``__main__`` it
    holds the ``faces`` (:func:`command_faces`) that no other row names, and the package's own ``__init__``
    (``harness``, the lazy public API, which reaches every layer as the command line does).
    """
    path = module.replace(".", "/")
    for row, entry in enumerate(layers):
        if entry.endswith("/") and (path + "/").startswith(entry):
            return row
        if entry.endswith(".py") and path == entry[:-3]:
            return row
    if "." not in module or module in faces:
        return 0
    return None


def unplaced(modules: dict[str, Path], layers: list[str]) -> list[str]:
    """What no row of the table holds, one line per top-level package (``harness/x/``) or module (``harness/x.py``)."""
    faces = command_faces(modules)
    out = set()
    for module, path in modules.items():
        if layer_of(module, layers, faces) is not None:
            continue
        top = module.split(".")[1]
        if module.count(".") > 1 or path.name == "__init__.py":  # a package needs a row of its own
            out.add(f"harness/{top}/ (a package that no row of the table names)")
        else:
            out.add(f"harness/{top}.py (no row of the table names it, and it is not a command face: "
                    "only `from harness.<module> import main` and `if __name__ == '__main__':` calling it)")
    return sorted(out)


def layer_violations(graph: Mapping[str, Collection[str]], layers: list[str], faces: Collection[str]) -> list[str]:
    """Every import that runs up the table, and every import to or from a module that no row holds (it cannot
    be checked, so it is reported rather than given a row)."""
    def where(row: int | None) -> str:
        return "in no row" if row is None else f"row {row}"

    problems = []
    for module, targets in sorted(graph.items()):
        row = layer_of(module, layers, faces)
        for target in sorted(targets):
            target_row = layer_of(target, layers, faces)
            if row is None or target_row is None or target_row < row:
                problems.append(f"{module} ({where(row)}) imports {target} ({where(target_row)})")
    return problems


@lru_cache(maxsize=1)
def package_graph() -> dict[str, frozenset[str]]:
    return {module: frozenset(targets) for module, targets in import_graph(module_files()).items()}


def plant(root: Path, files: dict[str, str]) -> dict[str, Path]:
    """A fake ``harness`` package under ``root`` with these files (path -> source); its modules."""
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    return module_files(root)


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


def test_only_the_branch_that_never_runs_is_type_checking_only(tmp_path):
    modules = plant(tmp_path / "harness", {
        "__init__.py": "",
        **{f"{name}.py": "" for name in ("dead1", "dead2", "dead3", "live1", "live2", "live3", "live4")},
        "b.py": "import typing\nfrom typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from harness import dead1\nelse:\n    from harness import live1\n"
                "if not TYPE_CHECKING:\n    import harness.live2\nelse:\n    import harness.dead2\n"
                "def f(x):\n"
                "    if typing.TYPE_CHECKING:\n        from harness import dead3\n"
                "    elif x:\n        from harness import live3\n"
                "    if TYPE_CHECKING or x:\n        from harness import live4\n",  # may run: an edge
    })
    assert import_graph(modules)["harness.b"] == {"harness.live1", "harness.live2", "harness.live3", "harness.live4"}


def test_an_import_call_with_a_literal_name_is_an_edge(tmp_path):
    modules = plant(tmp_path / "harness", {
        "__init__.py": "",
        "a/__init__.py": "",
        **{f"a/{name}.py": "" for name in ("one", "two", "four", "five")},
        "three.py": "",
        "low.py": "import importlib\nfrom importlib import import_module as load\n"
                  "def f(name):\n"
                  "    importlib.import_module('harness.a.one')\n"
                  "    load('.two', package='harness.a')\n"
                  "    __import__('harness.three')\n"
                  "    __import__('harness.a', fromlist=['four'])\n"
                  "    importlib.import_module(name)  # computed: cannot be resolved\n",
        "a/six.py": "from importlib import import_module\nimport_module('.five', __package__)\n",
    })
    graph = import_graph(modules)
    assert graph["harness.low"] == {"harness.a.one", "harness.a.two", "harness.three", "harness.a.four"}
    assert graph["harness.a.six"] == {"harness.a.five"}
    readme = tmp_path / "README.md"
    readme.write_text("## Architecture\n\n| package | what |\n|---|---|\n| `harness/three.py` | top |\n"
                      "| `harness/a/` | middle |\n| `harness/low.py` | bottom |\n")
    assert layer_violations(graph, layer_table(readme), command_faces(modules)) == [
        "harness.low (row 2) imports harness.a.four (row 1)", "harness.low (row 2) imports harness.a.one (row 1)",
        "harness.low (row 2) imports harness.a.two (row 1)", "harness.low (row 2) imports harness.three (row 0)"]


def test_a_module_in_no_row_is_reported_not_put_at_the_top(tmp_path):
    modules = plant(tmp_path / "harness", {
        "__init__.py": "",
        "__main__.py": "from harness.low import run\nrun()\n",
        "tool.py": '"""python -m harness.tool"""\nfrom harness.low import main\n\n'
                   "if __name__ == '__main__':\n    raise SystemExit(main())\n",
        "helper.py": "from harness.low import main\n\ndef f():\n    return main()\n",  # library code: no face
        "stray/__init__.py": "",
        "stray/x.py": "from harness import helper\n",
        "low.py": "def main():\n    return 0\n\ndef run():\n    from harness.stray import x\n",
    })
    readme = tmp_path / "README.md"
    readme.write_text("## Architecture\n\n| package | what |\n|---|---|\n"
                      "| `harness/__main__.py` and the command faces (`harness/<tool>.py`) | top |\n"
                      "| `harness/low.py` | bottom |\n")
    layers = layer_table(readme)
    faces = command_faces(modules)
    assert faces == {"harness.tool"}
    assert layer_of("harness.tool", layers, faces) == 0 and layer_of("harness.stray.x", layers, faces) is None
    assert [line.split(" ")[0] for line in unplaced(modules, layers)] == ["harness/helper.py", "harness/stray/"]
    assert layer_violations(import_graph(modules), layers, faces) == [
        "harness.helper (in no row) imports harness.low (row 1)",
        "harness.low (row 1) imports harness.stray.x (in no row)",
        "harness.stray.x (in no row) imports harness.helper (in no row)"]


def test_no_module_imports_a_layer_above_its_own():
    layers = layer_table()
    assert layers[-1] == "harness/errors.py" and "harness/job/" in layers  # the table was found and read
    for entry in layers[1:]:  # every row names something that exists
        assert (REPO / entry).exists(), f"README's architecture table names {entry}, which does not exist"
    assert layer_violations(package_graph(), layers, command_faces(module_files())) == []


def test_every_module_sits_in_a_row_of_the_table():
    # the top level holds the entry points and the command faces (a library main, run); everything else has a row
    assert unplaced(module_files(), layer_table()) == []


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
