"""The documentation holds together: every relative link and anchor in README.md and docs/
resolves, every docs/ path named in running text exists, and the generated reference pages are
what tools/gen_reference.py writes from the code today."""

from __future__ import annotations

import functools
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
DOCS_PATH = re.compile(r"(?<![\w/.-])(docs/[\w./-]+\.md)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text: lower case, punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading.strip()).lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading's anchor, a repeated one numbered as GitHub numbers it (``x``, ``x-1``)."""
    found, counts = set(), {}
    for _, line in prose(path):
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            base = anchor(match.group(1))
            count = counts.get(base, 0)
            counts[base] = count + 1
            found.add(f"{base}-{count}" if count else base)
    return frozenset(found)


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    problems = []
    for number, line in prose(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, fragment = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not resolved.exists():
                problems.append(f"{where}: no such file")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                problems.append(f"{where}: no heading with anchor #{fragment}")
    return problems


def test_every_relative_link_and_anchor_resolves() -> None:
    problems = [problem for path in pages() for problem in broken_links(path)]
    assert not problems, "\n".join(problems)


def test_every_docs_path_named_in_the_text_exists() -> None:
    problems = [f"{path.relative_to(REPO)}:{number}: {name}"
                for path in pages() for number, line in prose(path)
                for name in DOCS_PATH.findall(line) if not (REPO / name).is_file()]
    assert not problems, "\n".join(problems)


def test_the_checker_finds_a_broken_link_and_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading\n")
    page.write_text("[ok](other.md#a-code-heading) [gone](missing.md) "
                    "[no anchor](other.md#nowhere) [web](https://example.com/x.md)\n"
                    "```\n[in code](ignored.md)\n```\n")
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "missing.md: no such file", "other.md#nowhere: no heading with anchor #nowhere"]


def reference_generator():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        return importlib.import_module("gen_reference")
    finally:
        sys.path.remove(str(REPO / "tools"))


@pytest.mark.timeout(300)
def test_the_reference_pages_are_generated_from_the_code_as_it_is() -> None:
    generator = reference_generator()
    for path, text in generator.pages().items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.relative_to(REPO)} is out of date: run python tools/gen_reference.py")


def test_an_undocumented_config_field_is_refused() -> None:
    generator = reference_generator()

    @dataclass
    class Half:
        """Attributes:
        documented: a field with a description."""

        documented: int = 1
        forgotten: int = 2

    with pytest.raises(ValueError, match="forgotten"):
        generator.field_docs(Half)
