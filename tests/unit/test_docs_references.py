"""User-facing documents cite only files that ship with the repository."""

from __future__ import annotations

import re
from pathlib import Path

from streambp_bench.paper import readme

REPO = Path(__file__).resolve().parents[2]


def _cited_markdown(text: str) -> set[str]:
    return set(re.findall(r"\b([\w./-]+\.md)\b", text))


def test_readmes_cite_only_markdown_files_in_the_repository():
    shipped = {path.name for path in REPO.rglob("*.md") if ".git" not in path.parts}
    texts = {
        "README.md": (REPO / "README.md").read_text(),
        "results/README.md": (REPO / "results" / "README.md").read_text(),
        "readme.render": readme.render(REPO / "results"),
    }
    texts.update({f"docs/{page.name}": page.read_text() for page in (REPO / "docs").glob("*.md")})
    for where, text in texts.items():
        missing = {name for name in _cited_markdown(text) if Path(name).name not in shipped}
        assert not missing, f"{where} cites {sorted(missing)}, which the repository does not have"
