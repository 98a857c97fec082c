"""The engine's modules import each other without a cycle (docs/STYLE.md §1, layers): every import
counts, at the top of a module or inside a function (a lazy import that dodges a cycle is a cycle),
except those under `if TYPE_CHECKING:`, which never run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.Module, modules: set[str]) -> set[str]:
    """The modules of `modules` that `tree` imports anywhere but under `if TYPE_CHECKING:`."""
    skipped = {id(node) for guard in ast.walk(tree)
               if isinstance(guard, ast.If) and ast.unparse(guard.test).endswith("TYPE_CHECKING")
               for stmt in guard.body for node in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from engine import models` imports the module engine.models; `from engine.x import y`, engine.x
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                      for alias in node.names}
    return found & modules


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: the modules of the package at `root` that it imports}."""
    paths = {module_name(path, root): path for path in root.rglob("*.py")}
    return {name: imported(ast.parse(path.read_text()), set(paths)) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None: a depth-first search for an edge back
    into the current path."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            cycle = visit(nxt, path + [node])
            if cycle:
                return cycle
        done.add(node)
        return None

    return next((cycle for node in sorted(graph) if (cycle := visit(node, []))), None)


def test_engine_modules_import_each_other_without_a_cycle():
    graph = import_graph(ENGINE)
    assert {"engine.loading", "engine.models", "engine.quant", "engine.kv.full"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize(("sources", "cycle"), [
    ({"a": "import pkg.b", "b": "def f():\n    from pkg import a"}, ["pkg.a", "pkg.b", "pkg.a"]),  # a lazy import
    ({"a": "from pkg.b import x", "b": "from pkg.c import y", "c": "from pkg import a"},
     ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]),
    ({"a": "import pkg.b", "b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a"}, None),
    ({"a": "import pkg.b", "b": "import os"}, None),
])
def test_the_cycle_finder_sees_lazy_and_long_cycles_and_skips_type_checking(tmp_path, sources, cycle):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    for name, text in sources.items():
        (root / f"{name}.py").write_text(text + "\n")
    assert find_cycle(import_graph(root)) == cycle
