"""The README and every page under docs/ link only to files (and headings) that exist.

A relative link ``[text](path#anchor)`` or image ``![alt](path)`` must name a file or folder of
this tree, and its anchor one of the target page's headings, as GitHub makes anchors of them
(lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats). Links inside
code (fenced blocks, inline spans) are text, not links; ``http(s)://`` and ``mailto:`` links
are not followed. The README also stays the front door: at most 200 lines, with the very test
command ``.ci/run`` runs.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
README_MAX_LINES = 200


def prose(text: str, spans: bool = False) -> str:
    """``text`` without fenced code blocks, and without inline code spans unless ``spans``; lines kept in place."""
    out, fence = [], None
    for line in text.splitlines():
        marker = re.match(r"^\s*(`{3,}|~{3,})", line)
        if fence is None and marker:
            fence = marker.group(1)
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line if spans else re.sub(r"(`+)(?:(?!\1).)+\1", "", line))
    return "\n".join(out)


def github_anchor(heading: str, seen: dict[str, int]) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    return slug if n == 0 else f"{slug}-{n}"


@cache
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    return frozenset(github_anchor(m.group(1), seen)
                     for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(page.read_text(), spans=True), re.M))


def links(page: Path) -> list[tuple[int, str]]:
    out = []
    for number, line in enumerate(prose(page.read_text()).splitlines(), 1):
        out += [(number, m.group(1)) for m in LINK.finditer(line)]
    return out


def broken(page: Path) -> list[str]:
    out = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not resolved.exists():
            out.append(f"{where} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            out.append(f"{where} (no heading #{anchor} in {resolved.relative_to(ROOT)})")
    return out


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    fences = [n for n, line in enumerate(page.read_text().splitlines(), 1) if re.match(r"^\s*```", line)]
    assert len(fences) % 2 == 0, f"{page.relative_to(ROOT)}: a code block opened at line {fences[-1]} never closes"
    assert not broken(page), "\n".join(broken(page))


def test_the_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: yes\n\n## Repeat\n\n## Repeat\n")
    page.write_text("[ok](other.md#a-code-heading-yes) [ok](other.md#repeat-1) [web](https://example.com)\n"
                    "[gone](missing.md) [bad anchor](other.md#nope) `[in code](missing.md)`\n"
                    "```\n[in a block](missing.md)\n```\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = broken(page)
    finally:
        ROOT = saved
    assert found == ["page.md:2: missing.md (no such file)",
                     "page.md:2: other.md#nope (no heading #nope in other.md)"]


def test_the_readme_is_a_front_door_showing_the_ci_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "README.md is the front door: move detail into docs/"
    command = re.search(r"^TEST_COMMAND='(.+)'$", (ROOT / ".ci" / "run").read_text(), re.M).group(1)
    assert f"```sh\n{command}\n```" in readme
    assert "```sh\npython3 -m venv .venv && . .venv/bin/activate && pip install -e . && strata serve\n```" in readme
    assert "docs/index.md" in readme
