"""The README stays short and indexes docs/: every page it links exists, every page is linked, and
every relative link in README.md and docs/ resolves to a file in the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 220
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _docs_index() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## Docs\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def _relative_links(text: str) -> list[str]:
    return [target.split("#", 1)[0] for target in LINK.findall(text)
            if not re.match(r"[a-z]+:", target) and not target.startswith("#")]


def test_readme_is_short() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= MAX_README_LINES


def test_the_docs_index_links_exactly_the_docs_pages() -> None:
    linked = {target for target in _relative_links(_docs_index()) if target.startswith("docs/")}
    pages = {f"docs/{page.name}" for page in DOCS.glob("*.md")}
    assert pages, "docs/ holds no pages"
    assert linked - pages == set(), f"the index links missing pages {sorted(linked - pages)}"
    assert pages - linked == set(), f"pages not in the index {sorted(pages - linked)}"


def test_relative_links_resolve_to_files_in_the_repository() -> None:
    for document in (README, *sorted(DOCS.glob("*.md"))):
        for target in _relative_links(document.read_text(encoding="utf-8")):
            resolved = (document.parent / target).resolve()
            assert resolved.is_relative_to(REPO) and resolved.is_file(), f"{document.name} links {target}"
