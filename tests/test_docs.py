"""The docs' examples run: every ```python block of the README and of a page under docs/, in order, as one script
(a page's blocks build on each other, as a reader's session would). The benchmarks' index,
benchmarks/README.md, lists every script, and every benchmark path the repository names exists."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BENCHMARKS = ROOT / "benchmarks"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PAGES = sorted(p for p in [ROOT / "README.md", *DOCS.glob("*.md")] if BLOCK.search(p.read_text()))


def test_pages_with_examples_exist():
    assert {p.name for p in PAGES} >= {"README.md", "environments.md"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_pages_examples_run(page, tmp_path):
    script = tmp_path / f"{page.stem}_page.py"  # not trl.py: a script named like a package shadows it
    script.write_text("\n\n".join(BLOCK.findall(page.read_text())))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{page.name}'s examples failed:\n{proc.stderr[-3000:]}"


def scripts() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in BENCHMARKS.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_benchmark_is_in_a_group_and_in_the_index():
    index = (BENCHMARKS / "README.md").read_text()
    assert len(scripts()) >= 10
    loose = [s for s in scripts() if s.count("/") != 2]
    assert not loose, f"{loose}: a benchmark lives in a group folder, benchmarks/<group>/<name>.py"
    missing = [s for s in scripts() if f"python {s}" not in index]
    assert not missing, f"benchmarks/README.md gives no command for {missing}: add each one's row"


def test_every_benchmark_the_repository_names_exists():
    """A moved or removed script leaves no stale path in the README, docs, recipes, code or tests."""
    texts = [
        ROOT / "README.md",
        *DOCS.rglob("*.md"),
        *BENCHMARKS.rglob("*.md"),
        *BENCHMARKS.rglob("*.py"),
        *(ROOT / "recipes").rglob("*.yaml"),
        *(ROOT / "kvrl").rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
    ]
    named = {
        (m, p.relative_to(ROOT).as_posix()) for p in texts for m in re.findall(r"benchmarks/[\w/]+\.py", p.read_text())
    }
    gone = sorted((m, where) for m, where in named if not (ROOT / m).is_file())
    assert not gone, f"(path, where it is named) of benchmarks that do not exist: {gone}"


RENDERED = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), BENCHMARKS / "README.md", ROOT / "CHANGELOG.md"]


def outside_fences(text: str) -> tuple[list[str], int]:
    """(the lines outside code fences, how many fences are left open at the end): CommonMark's rule
    that a fence closes on a line of at least as many of the same backticks or tildes, with no info string."""
    lines, fence = [], None
    for line in text.splitlines():
        m = re.match(r" {0,3}(`{3,}|~{3,})(.*)$", line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
            if not m.group(2).strip():
                fence = None
        elif fence is None:
            lines.append(line)
    return lines, int(fence is not None)


@pytest.mark.parametrize("page", RENDERED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_page_renders_its_headings_and_tables(page):
    """A Markdown renderer (markdown-it, CommonMark with GitHub's tables) finds every heading and table the
    page's source has: a stray fence once turned the README's last 68 lines into one code block."""
    from markdown_it import MarkdownIt

    text = page.read_text()
    lines, unclosed = outside_fences(text)
    assert not unclosed, f"{page.name}: a code fence is never closed"
    headings = [line for line in lines if re.match(r"#{1,6} ", line)]
    tables = [line for line in lines if re.fullmatch(r"\|?(\s*:?-{3,}:?\s*\|)+\s*:?-*:?\s*\|?", line.strip())]
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    rendered_headings = [t for t in tokens if t.type == "heading_open"]
    rendered_tables = [t for t in tokens if t.type == "table_open"]
    assert len(rendered_headings) == len(headings), (
        f"{page.name}: {len(headings)} headings in the source, {len(rendered_headings)} rendered"
    )
    assert len(rendered_tables) == len(tables), (
        f"{page.name}: {len(tables)} tables in the source, {len(rendered_tables)} rendered"
    )
