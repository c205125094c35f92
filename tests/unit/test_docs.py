"""The documentation holds together: a short README, every docs page reachable from it, no broken
relative link in README.md or docs/**/*.md.

Links are markdown's ``[text](target)`` and ``![alt](target)``; ``http(s)`` / ``mailto`` targets and
``#anchor``-only targets are not checked, and an anchor after a file (``page.md#part``) is dropped.
Links inside fenced code blocks and inline code are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 200

_FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) or ![alt](target), with an optional "title"; the text may hold nested brackets.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _strip_code(text: str) -> str:
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def relative_links(page: Path) -> list[str]:
    """The relative link targets of a markdown page, anchors removed, in order."""
    targets = []
    for target in _LINK.findall(_strip_code(page.read_text(encoding="utf-8"))):
        if _EXTERNAL.match(target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path:
            targets.append(path)
    return targets


def resolve(page: Path, target: str) -> Path:
    return (REPO / target.lstrip("/")) if target.startswith("/") else (page.parent / target)


def doc_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_the_link_parser_finds_what_a_reader_would_click(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "See [a](a.md), [b](sub/b.md#part), ![img](pic.png \"title\"), [site](https://example.com),\n"
        "[here](#local), [`code` in text](c.md), [x [y]](d.md).\n"
        "Not links: `[e](e.md)` and\n```bash\n[f](f.md)\n```\n", encoding="utf-8")
    assert relative_links(page) == ["a.md", "sub/b.md", "pic.png", "c.md", "d.md"]


def test_the_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; at most {MAX_README_LINES} (move detail to docs/)"


def test_the_readme_names_the_commands_first() -> None:
    text = README.read_text(encoding="utf-8")
    first_block = text.split("```", 2)[1]
    assert "make serve" in first_block and "make test" in first_block


@pytest.mark.parametrize("page", [README, *doc_pages()], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_at_a_file_that_exists(page: Path) -> None:
    broken = [target for target in relative_links(page) if not resolve(page, target).exists()]
    assert not broken, f"{page.relative_to(REPO)} links to missing files: {broken}"


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    seen: set[Path] = set()
    todo = [README.resolve()]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for target in relative_links(page):
            linked = resolve(page, target).resolve()
            if linked.suffix == ".md" and linked.is_file() and linked.is_relative_to(REPO):
                todo.append(linked)
    orphans = [str(p.relative_to(REPO)) for p in doc_pages() if p.resolve() not in seen]
    assert not orphans, f"docs pages no link leads to from README.md: {orphans}"
