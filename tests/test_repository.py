"""The repository's own rules that a reader checks by eye: no measured figure in a comment, a
docstring or a UI string (docs/STYLE.md §7; `scripts/measured_figures.py`)."""

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _scanner():
    spec = importlib.util.spec_from_file_location("measured_figures", ROOT / "scripts" / "measured_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_measured_figure_in_comments_docstrings_or_ui_strings():
    scanner = _scanner()
    found = scanner.scan(scanner.scanned_files(ROOT), ROOT)
    assert not found, "measured figures (move them to benchmarks/history/):\n" + "\n".join(
        f"{path}:{line}: {text}" for path, line, text in found
    )


def test_scanner_flags_figures_and_not_hardware_facts_or_settings():
    scanner = _scanner()
    python = (
        '"""Decode one token (a check of 5 tokens took 44 vs 22 ms)."""\n'  # 1: a docstring's timing
        "x = 1  # 16 registers, 32 lanes, on a 2-core CPU\n"  # 2: hardware facts
        "y = 2  # 1.09-1.13x faster on one thread\n"  # 3: a speed-up
        "z = 3  # polls every 10 ms; gives up after 5 s\n"  # 4: settings
        'LABEL = "Prefill at 410 tokens/s"\n'  # 5: a UI string with a speed
    )
    assert [line for line, _ in scanner.figures_in_python(python)] == [1, 3]
    assert [line for line, _ in scanner.figures_in_python(python, ui=True)] == [1, 3, 5]
    cpp = (
        "// 6 x 2 accumulators, 15 of 16 registers\n"  # 1: hardware facts
        "/* every Q5_0 linear of the 0.5B, 1 thread:\n   35-42 vs 41-49 ms */\n"  # 2-3: a timing
        'const char* s = "// 3 ms";  // 8 KiB at D = 128\n'  # 4: a figure in a string, not a comment
    )
    assert [line for line, _ in scanner.figures_in_cpp(cpp)] == [3]


ENGINE = Path(__file__).resolve().parent.parent / "engine"
ENGINE_LINE_BUDGET = 5000  # docs/STYLE.md section 9, every model family included
FUNCTION_LINE_BUDGET = 40


def long_functions(root: Path, limit: int) -> list[str]:
    """`path:name (lines)` for every function or method longer than `limit` lines, def to last line."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n_lines = node.end_lineno - node.lineno + 1
                if n_lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.name} ({n_lines})")
    return found


def test_the_engine_keeps_its_budget_and_its_functions_short():
    n_lines = sum(len(p.read_text().splitlines()) for p in ENGINE.rglob("*.py"))
    assert n_lines <= ENGINE_LINE_BUDGET, f"engine/ has {n_lines:,} lines of Python, over the budget"
    assert long_functions(ENGINE, FUNCTION_LINE_BUDGET) == []


def test_the_function_check_sees_a_long_method(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(40))
    (tmp_path / "m.py").write_text(f"class A:\n    def f(self):\n{body}\n")
    assert long_functions(tmp_path, 40) == [f"{tmp_path.name}/m.py:f (41)"]
    assert long_functions(tmp_path, 41) == []
