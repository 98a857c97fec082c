"""List the measured figures left in comments, docstrings and UI strings (docs/STYLE.md §7).

A figure (a time, a speed, a speed-up) is true on one machine on one day: it belongs in
`benchmarks/RESULTS.md` or the dated log in `benchmarks/history/`, and the UI shows what this machine
measured. Scanned: the comments and docstrings of engine/, app/, api/ and benchmarks/ (Python, and
the C++ of engine/csrc), and every other string literal of app/. Hardware facts ("16 registers",
"2-core") are not figures. Prints `path:line: text` per line, then the count; exits 1 if any.

    python scripts/measured_figures.py [file ...]
"""

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("engine", "app", "api", "benchmarks")
UI_PACKAGE = "app"  # its other string literals are what the reader sees

_N = r"\d+(?:[.,]\d+)?"
FIGURE = re.compile(
    "|".join(
        [
            rf"{_N}\s?(?:ms|us|µs|μs|ns|minutes?)\b",  # a duration
            rf"{_N}\s(?:s|sec|seconds?)\b(?!\s?[-+*/=])",  # not "4090s", "2 s + 1"
            rf"{_N}\s?(?:tokens?|tok|t)/s\b",  # a decoding speed
            rf"{_N}\s?[KMGT]i?B/s\b",  # a bandwidth
            rf"{_N}\s?cycles\b",
            r"\d+\.\d+[x×](?![\w.])|×\s?\d+\.\d+",  # a ratio: 1.12x, ×2.3 (not 6 x 2, 2x4090, x16)
            r"~\d+[x×]|\d+[x×] (?:faster|slower|the time)",  # "grown 8x" and "16x less" are arithmetic
            rf"{_N}\s?%\s(?:faster|slower|longer|shorter|less|more)\b|{_N}\s?% of (?:a|the) (?:\S+ ){{0,3}}step",
        ]
    )
)
# a setting or a datasheet's figure, not a measurement: "every 10 ms", "at most 50 / 100 ms", "1008 GB/s peak"
_SETTING = re.compile(r"\b(?:every|each|after|at most|within)\s+(?:[\d.,]+\s*(?:/|and|or|to)\s*)?$")
_SPEC = re.compile(r"\s(?:peak|raw)\b")
# quoted text in a comment is an example of output or a cited title: "ETA 12 s", 'up to 2.31x'
_QUOTED = re.compile(r'"[^"]*"|(?<!\w)\'[^\'\n]*\'(?!\w)')
_STRING_QUOTES = re.compile(r'^[rRbBuUfF]*(?:"""|\'\'\'|"|\')|(?:"""|\'\'\'|"|\')$')
_CPP_TOKEN = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.DOTALL)


def has_figure(line: str) -> bool:
    """Whether `line` states a measured time, speed or speed-up."""
    line = _QUOTED.sub('""', line)
    return any(not _SETTING.search(line[: m.start()]) and not _SPEC.match(line, m.end()) for m in FIGURE.finditer(line))


def _flagged(first_line: int, text: str) -> list[tuple[int, str]]:
    """The lines of `text` (starting at `first_line`) that carry a figure."""
    return [(first_line + i, line.strip()) for i, line in enumerate(text.split("\n")) if has_figure(line)]


def _docstring_starts(source: str) -> set[tuple[int, int]]:
    """(line, column) of every module, class and function docstring."""
    starts = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
                starts.add((first.lineno, first.col_offset))
    return starts


def figures_in_python(source: str, ui: bool = False) -> list[tuple[int, str]]:
    """Lines of comments and docstrings (and, if `ui`, of any string literal) with a figure."""
    docstrings = _docstring_starts(source)
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found += _flagged(tok.start[0], tok.string)
        elif tok.type == tokenize.STRING and (ui or tok.start in docstrings):
            found += _flagged(tok.start[0], _STRING_QUOTES.sub("", tok.string))
    return found


def figures_in_cpp(source: str) -> list[tuple[int, str]]:
    """Lines of `//` and `/* */` comments with a figure (string literals are skipped)."""
    found = []
    for match in _CPP_TOKEN.finditer(source):
        if match.group().startswith("/"):
            found += _flagged(source.count("\n", 0, match.start()) + 1, match.group())
    return found


def scanned_files(root: Path = ROOT) -> list[Path]:
    """The Python and C++ sources of the scanned packages, tests excepted."""
    files = [p for d in SCANNED for pattern in ("*.py", "*.cpp") for p in (root / d).rglob(pattern)]
    return sorted(p for p in files if not p.name.startswith("test_"))


def scan(files: list[Path], root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(path relative to `root`, line, text) of every figure in `files`."""
    found = []
    for path in files:
        rel = path.resolve().relative_to(root).as_posix()
        source = path.read_text(encoding="utf-8")
        if path.suffix == ".cpp":
            lines = figures_in_cpp(source)
        else:
            lines = figures_in_python(source, ui=rel.startswith(UI_PACKAGE + "/"))
        found += [(rel, line, text) for line, text in lines]
    return found


def main() -> int:
    files = [Path(arg) for arg in sys.argv[1:]] or scanned_files()
    found = scan(files)
    for rel, line, text in found:
        print(f"{rel}:{line}: {text}")
    print(f"{len(found)} line(s) with a measured figure")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
