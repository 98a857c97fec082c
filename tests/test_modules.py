"""How the modules relate, read from their source: a constant's name means one thing in every
package (issue 57 item 4).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


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
