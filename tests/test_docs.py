"""The docs' examples run: every ```python block of a page under docs/, in order, as one script
(a page's blocks build on each other, as a reader's session would)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PAGES = sorted(p for p in DOCS.glob("*.md") if BLOCK.search(p.read_text()))


def test_pages_with_examples_exist():
    assert {p.name for p in PAGES} >= {"environments.md"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_pages_examples_run(page, tmp_path):
    script = tmp_path / f"{page.stem}.py"
    script.write_text("\n\n".join(BLOCK.findall(page.read_text())))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{page.name}'s examples failed:\n{proc.stderr[-3000:]}"
