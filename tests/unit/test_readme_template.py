"""`results/README.md` is composed from the results CSVs and the prose of `paper/readme_template.md`."""

from __future__ import annotations

import re
from pathlib import Path

from streambp_bench.paper import prose, readme

REPO = Path(__file__).resolve().parents[2]
PAPER = REPO / "streambp_bench" / "paper"


def test_the_committed_readme_is_what_the_composer_writes_from_the_committed_csvs() -> None:
    assert readme.render(REPO / "results") == (REPO / "results" / "README.md").read_text(encoding="utf-8")


def test_every_block_of_the_template_is_used_and_every_block_used_is_there() -> None:
    used = {name for path in PAPER.glob("*.py")
            for name in re.findall(r"""\bprose\(\s*["']([\w-]+)["']""", path.read_text(encoding="utf-8"))}
    assert used == set(prose.blocks())
    assert all(text and not text.startswith("\n") for text in prose.blocks().values())
