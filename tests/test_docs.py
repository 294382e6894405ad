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
