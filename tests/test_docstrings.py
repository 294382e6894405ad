"""Docstrings state the contract: what, shapes, the paper's section. How a choice came to be and how
kvrl compares with reference code live in docs/fidelity.md, so no docstring of the package or the
benchmarks runs over MAX_LINES."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 40


def long_docstrings(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every module, class and function docstring of ``source`` over ``max_lines``."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None and len(doc.splitlines()) > max_lines:
                found.append((getattr(node, "name", "<module>"), len(doc.splitlines())))
    return found


def test_the_check_finds_a_long_docstring():
    body = "\n".join(f"    line {i}" for i in range(MAX_LINES))
    source = f'"""Module.\n{body}"""\n\nclass A:\n    """One line."""\n\n    def f(self):\n        """f.\n{body}"""\n'
    assert long_docstrings(source) == [("<module>", MAX_LINES + 1), ("f", MAX_LINES + 1)]
    assert long_docstrings(f'"""Module.\n{body[: body.rindex(chr(10))]}"""\n') == []


def test_no_docstring_runs_over_40_lines():
    files = sorted(p for folder in ("kvrl", "benchmarks") for p in (ROOT / folder).rglob("*.py"))
    assert len(files) > 50
    hits = [
        f"{p.relative_to(ROOT)}: {name} ({lines} lines)"
        for p in files
        for name, lines in long_docstrings(p.read_text())
    ]
    assert not hits, (
        f"docstrings over {MAX_LINES} lines (keep the contract; move provenance to docs/fidelity.md):\n"
        + "\n".join(hits)
    )
