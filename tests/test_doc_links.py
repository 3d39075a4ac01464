"""The documentation's links hold: every relative link in README.md, docs/*.md and
benchmarks/README.md names a file or folder that exists in the repository, every #anchor names a
heading of the page it points to, and no link leaves the repository (issue 39). Standard library only."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "benchmarks" / "README.md", *(REPO / "docs").glob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def links(text: str) -> list[str]:
    prose = CODE_SPAN.sub("", FENCE.sub("", text))  # brackets in code are code, not links
    return INLINE_LINK.findall(prose) + REFERENCE_DEF.findall(prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path, text: str | None = None) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(FENCE.sub("", path.read_text() if text is None else text)):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def problems(page: Path, text: str | None = None) -> list[str]:
    """What is wrong with the links of ``page`` (its text, or ``text`` as if it were the page's)."""
    found = []
    for target in links(page.read_text() if text is None else text):
        if EXTERNAL.match(target) or target.startswith("//"):
            continue  # a web address: checked by nobody here, and it does not point into the file system
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part)
        if path_part.startswith("/"):
            found.append(f"{target}: an absolute path")
            continue
        resolved = (page.parent / path_part).resolve() if path_part else page
        if resolved != REPO and REPO not in resolved.parents:
            found.append(f"{target}: points outside the repository")
            continue
        if path_part and not resolved.exists():
            found.append(f"{target}: no such file")
            continue
        if anchor and resolved.suffix == ".md" and (resolved == page or resolved.is_file()) and \
                anchor not in anchors(resolved, text if resolved == page else None):
            found.append(f"{target}: no heading #{anchor} in {resolved.relative_to(REPO)}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_inside_the_repository(page):
    assert problems(page) == [], f"{page.relative_to(REPO)}: broken links"


def test_no_page_names_a_path_outside_the_repository():
    """Not even as text: a `../shared/...` path in a command or code span is a reader's dead end."""
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for target in re.findall(r"(?<![\w.])((?:\.\./)+[\w.\-/]+)", line):
                resolved = (page.parent / target).resolve()
                assert resolved == REPO or REPO in resolved.parents, \
                    f"{page.relative_to(REPO)}:{number} names {target}, outside the repository"


def test_the_checker_catches_what_it_is_for():
    """A link outside, a missing file and a missing anchor are reported; code and web links are not."""
    page = REPO / "docs" / "_probe.md"
    text = ("# Title here\n\n[a](../../outside.md) [b](missing.md) [c](#nope) [d](#title-here) "
            "[e](https://example.com) `[f](missing.md)` [g](store.md#the-commit-protocol) [h](store.md#nope)\n\n"
            "```\n[i](missing.md)\n```\n")
    assert problems(page, text) == ["../../outside.md: points outside the repository", "missing.md: no such file",
                                    "#nope: no heading #nope in docs/_probe.md",
                                    "store.md#nope: no heading #nope in docs/store.md"]


def test_slugs_follow_github():
    assert slug("Peer A/B (`peer_ab.py`): peagle's draft against speculators', same store, same budget") == \
        "peer-ab-peer_abpy-peagles-draft-against-speculators-same-store-same-budget"
    assert slug("Real scale on one GPU (issue 36): owed") == "real-scale-on-one-gpu-issue-36-owed"
    assert slug("Two methods (`method_step.py`, and `quality.py`'s `eagle3-*` variants)") == \
        "two-methods-method_steppy-and-qualitypys-eagle3--variants"
