"""The fault matrix (docs/faults.md) names tests that exist: a renamed or removed test would leave a promise
that nothing checks."""

import re
from pathlib import Path

from tests.launching import REPO


def test_every_test_the_fault_matrix_names_exists():
    text = (REPO / "docs" / "faults.md").read_text()
    named = re.findall(r"(tests/[\w/]+\.py)::(\w+)", text)
    assert len(named) >= 30
    missing = [
        f"{path}::{name}"
        for path, name in named
        if not (REPO / path).is_file() or not re.search(rf"def {name}\(", (REPO / path).read_text())
    ]
    assert missing == []


def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _broken_links(page: Path) -> list[str]:
    """Relative links of one markdown page (outside code blocks) whose file, or whose #heading in a markdown file,
    does not exist."""
    broken = []
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{page.name}: {target}")
        elif anchor and resolved.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(), flags=re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(f"{page.name}: {target} (no such heading)")
    return broken


def test_every_relative_link_of_the_readme_and_docs_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks").rglob("*.md"))]
    assert len(pages) >= 30
    assert [link for page in pages for link in _broken_links(page)] == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "there.md").write_text("## A five-minute tour: `make x`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n[a](missing.md) [b](#title) [c](#nope) [d](https://example.org/x)\n"
        "[e](there.md#a-five-minute-tour-make-x)\n"
        "```\n[f](inside_a_code_block.md)\n```\n[g](there.md#gone)\n"
    )
    assert _broken_links(page) == [
        "page.md: missing.md",
        "page.md: #nope (no such heading)",
        "page.md: there.md#gone (no such heading)",
    ]
