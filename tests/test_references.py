"""Every reference in the repository is one a reader can follow: no internal notes, seeds or issue
numbers (a user has none of them), and every link of the README and the docs resolves."""

import re
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent

# What only the project's own notes and tracker know: cite a paper by title and link, reference code
# by repository@commit, and say what holds instead of which issue changed it.
FORBIDDEN = {
    "a seed document": re.compile(r"\bseeds? 00\d"),
    "the reference notes": re.compile(r"\bmethods\.md\b|(?<![\w/])reference/[\w-]+\.md\b"),
    "the shared folder": re.compile(r"\.\./shared\b"),
    "an issue number": re.compile(r"\bissues? #\d+|(?<![\w&/#])#\d{1,3}\b(?![\w-])"),
}


def forbidden(text: str) -> list[tuple[int, str, str]]:
    """(line, what, the match) of every reference a reader cannot follow in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        found += [(number, what, m.group()) for what, rx in FORBIDDEN.items() for m in rx.finditer(line)]
    return found


def sources() -> list[Path]:
    """The package, docs, recipes, tests, benchmarks, launchers and the project's own files."""
    files = [
        ROOT / name
        for name in ("README.md", "CHANGELOG.md", "CONTRIBUTING.md", "setup.cfg", "pyproject.toml", ".ci/run")
    ]
    for folder, patterns in {
        "kvrl": ("*.py", "*.json", "*.cpp"),
        "docs": ("*.md",),
        "recipes": ("*.yaml",),
        "tests": ("*.py",),
        "benchmarks": ("*.py", "*.md"),
        "launch": ("*.sh", "*.yaml", "*.sbatch"),
    }.items():
        files += [p for pattern in patterns for p in (ROOT / folder).rglob(pattern)]
    return sorted(p for p in files if p.is_file() and p != Path(__file__).resolve())


def test_the_checker_finds_a_planted_reference():
    planted = "G-KV (seed 004, App. E.1) as methods.md §8 says; see reference/vllm.md and ../shared (issue #35, #36)"
    assert {what for _, what, _ in forbidden(planted)} == set(FORBIDDEN)
    assert [m for _, _, m in forbidden("x\nthe recipe of seed 004")] == ["seed 004"]
    # what a reader can follow stays allowed: paths, anchors, colours, commits, item lists
    clean = (
        "kvrl/kernels/reference/mixed.py, docs/results.md#the-main-job, color='#1f77b4', "
        "microsoft/G-KV@6db3b2e, seed 0, step #, [link](#anchor-2)"
    )
    assert forbidden(clean) == []


def test_no_reference_a_reader_cannot_follow():
    hits = [
        f"{p.relative_to(ROOT)}:{line}: {what} ({match!r})"
        for p in sources()
        for line, what, match in forbidden(p.read_text(errors="replace"))
    ]
    assert not hits, "references a user cannot follow (cite the paper or repository@commit instead):\n" + "\n".join(
        hits
    )


# ---- links ------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def broken_links(page: Path) -> list[str]:
    """Every link of a markdown page that does not resolve: a relative file that is not there, an
    #anchor its page does not have, an http(s) address that is not one (no network is asked)."""
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if target.startswith(("http://", "https://")):
            url = urlparse(target)
            if not url.netloc or " " in target:
                broken.append(target)
            continue
        if target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(target)
    return broken


def pages() -> list[Path]:
    return [
        p
        for p in [
            ROOT / "README.md",
            ROOT / "CHANGELOG.md",
            ROOT / "CONTRIBUTING.md",
            ROOT / "benchmarks" / "README.md",
            *sorted((ROOT / "docs").glob("*.md")),
        ]
        if p.exists()
    ]


def test_every_link_of_the_readme_and_the_docs_resolves():
    assert len(pages()) >= 8
    broken = [f"{p.relative_to(ROOT)}: {t}" for p in pages() for t in broken_links(p)]
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The replay: memory, time\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n[ok](other.md) [ok](other.md#the-replay-memory-time) [ok](#page) "
        "[ok](https://arxiv.org/abs/2512.00504)\n"
        "[gone](missing.md) [no anchor](other.md#nowhere) [bad](https://) \n"
        "```\n[in code](ignored.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md", "other.md#nowhere", "https://"]
