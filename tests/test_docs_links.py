"""Every relative link in README.md and docs/*.md resolves, and every docs page is in the index.

The README is a short page that sends its reader to docs/ for everything else, so a link that
points nowhere (a page renamed, a heading reworded) loses a reader on the way. A link's path must
exist relative to the page holding it; a ``#anchor`` must be a heading of the target page, named
as GitHub names headings. Links inside code (fenced blocks, inline spans) are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+).*?\1")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def links(text: str) -> list[str]:
    """Targets of the inline links and images of a markdown page, code left out."""
    found: list[str] = []
    for line in _prose_lines(text):
        # A code span becomes as many x's: "`[a](b)`" is no link, while "[`x`](y)" stays one.
        found += _LINK.findall(_CODE_SPAN.sub(lambda span: "x" * len(span.group(0)), line))
    return found


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: link markup reduced to its text, lower case, punctuation
    dropped (hyphens and underscores kept), spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page; a repeated heading gets -1, -2, … as on GitHub."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    for line in _prose_lines(text):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken_links(page: Path) -> list[str]:
    """What is wrong with each relative link of a page, one line each."""
    problems = []
    for target in links(page.read_text()):
        if not target or _SCHEME.match(target):
            continue  # an absolute URL (http:, mailto:) is not this check's business
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"{page.name}: {target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            problems.append(f"{page.name}: {target}: no heading #{anchor} in {resolved.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_readme_links_the_docs_index_and_every_page_is_in_it() -> None:
    assert "docs/README.md" in links((ROOT / "README.md").read_text())
    indexed = {target.partition("#")[0] for target in links((DOCS / "README.md").read_text())}
    pages = {page.name for page in DOCS.glob("*.md")} - {"README.md"}
    assert pages - indexed == set(), "docs pages missing from docs/README.md"


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## The `x` part (b)\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md#the-x-part-b) [ok2](other.md#twice-1) [self](#page) ![img](other.md)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere) [web](https://example.org/x#y)\n"
        "`[in a span](nowhere.md)`\n\n```\n[in a block](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "page.md: missing.md: no such file",
        "page.md: other.md#nowhere: no heading #nowhere in other.md",
    ]
