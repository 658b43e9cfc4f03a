"""The documents' links hold: every relative link in README.md and docs/*.md names a file of the repository, and every
#anchor a heading of its page, as GitHub makes anchors from headings."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(page: Path) -> str:
    """The page without its fenced code blocks, whose `#` lines are comments and whose brackets are code."""
    return FENCE.sub("", page.read_text())


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: its text (code spans' contents, links' text) lower-cased, every character but
    letters, digits, spaces, hyphens and underscores dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(prose(page)):
        base = anchor(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(CODE_SPAN.sub("", prose(page))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and (linked.suffix != ".md" or fragment not in anchors(linked)):
            broken.append(f"{target}: no such heading in {linked.relative_to(ROOT)}")
    return broken


def test_anchors_follow_githubs_rules():
    assert anchor("`make run` and `chatq up`") == "make-run-and-chatq-up"
    assert anchor("What is kept in `~/.cache/chatq`") == "what-is-kept-in-cachechatq"
    assert anchor("Redis high availability (Sentinel)") == "redis-high-availability-sentinel"
    assert anchor("chatq's CPU kernels") == "chatqs-cpu-kernels"
    assert anchor("The GPU engine against transformers, 2026-12-04") == "the-gpu-engine-against-transformers-2026-12-04"


def test_every_relative_link_and_anchor_of_the_documents_resolves():
    assert len(PAGES) > 5
    assert {str(p.relative_to(ROOT)): broken_links(p) for p in PAGES if broken_links(p)} == {}
