"""How the modules relate, read from their source: the app's modules import one another without
cycles, only app/ui.py touches `App`'s private members, and a constant's name means one thing in
every package (issue 57 items 4 and 6).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "app"


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def app_imports(path: Path) -> set[str]:
    """The app/ modules `path` imports when it runs: inside functions too, not under TYPE_CHECKING."""
    tree, typing_only = parsed(path), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            typing_only |= {id(n) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "app":
            found |= {alias.name for alias in node.names}  # from app import layout
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("app."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("app.")}
    return found


def test_no_app_module_imports_one_that_imports_it_back():
    graph = {path.stem: app_imports(path) for path in APP.glob("*.py")}
    for module in graph:
        seen, todo = set(), [module]
        while todo:
            for imported in graph.get(todo.pop(), ()):
                if imported not in seen:
                    seen.add(imported)
                    todo.append(imported)
        assert module not in seen, f"app/{module}.py imports itself back through {sorted(seen)}"


def test_the_cycle_check_sees_an_import_inside_a_function(tmp_path):
    path = tmp_path / "store.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.ui import App\n\n"
                    "def run():\n    from app.reading import Reading\n    from app import layout\n")
    assert app_imports(path) == {"reading", "layout"}


def private_uses(path: Path) -> list[str]:
    """`app._x` or `ui._x` (any private member of an `App` reached by those names) in `path`."""
    return [ast.unparse(node) for node in ast.walk(parsed(path))
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and ast.unparse(node.value).split(".")[-1] in ("app", "ui")]


def test_only_the_app_class_reaches_its_private_members(tmp_path):
    """The page (app/layout.py) and the other modules use `App`'s public surface."""
    for path in [*APP.rglob("*.py"), ROOT / "app.py"]:
        if path != APP / "ui.py":
            assert private_uses(path) == [], path.relative_to(ROOT)
    page = tmp_path / "layout.py"  # what app/layout.py did
    page.write_text("def build(app):\n    return app._yarn() != 1, self.ui._levels(), app.__class__, app.c\n")
    assert sorted(private_uses(page)) == ["app._yarn", "self.ui._levels"]


def module_constants(path: Path) -> dict[str, str]:
    """Upper-case names a module assigns at its top, with their expressions."""
    found = {}
    for node in parsed(path).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if (
            isinstance(node, ast.AnnAssign) and node.value) else []
        found |= {t.id: ast.unparse(node.value) for t in targets if isinstance(t, ast.Name) and t.id.isupper()}
    return found


def test_a_constant_name_means_one_thing_in_every_package():
    """`CHAT_ROOM_TOKENS` was 2048 in engine/session.py and 1024 in app/session.py with different
    meanings: a name two modules define holds the same value in both."""
    values: dict[str, dict[str, str]] = {}
    for path in [ROOT / "app.py", *(p for package in ("engine", "app", "api") for p in (ROOT / package).rglob("*.py"))]:
        for name, value in module_constants(path).items():
            values.setdefault(name, {})[str(path.relative_to(ROOT))] = value
    differing = {name: where for name, where in values.items() if len(set(where.values())) > 1}
    assert differing == {}
