"""docs/models.md and README.md say what the family table and the shipped presets hold: the counts, every
family by its model_type and every preset by name."""

from __future__ import annotations

import re
from pathlib import Path

from streambp_core.models.families import FAMILIES
from streambp_core.models.load import list_presets

ROOT = Path(__file__).resolve().parents[2]
MODELS = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _number(pattern: str, text: str) -> int:
    found = re.search(pattern, " ".join(text.split()))
    assert found, pattern
    return int(found.group(1))


def test_the_family_count_is_the_tables() -> None:
    assert _number(r"The engine runs (\d+) decoder families", MODELS) == len(FAMILIES)
    assert _number(r"The engine runs (\d+) families", README) == len(FAMILIES)


def test_every_family_is_named_by_its_model_type() -> None:
    missing = [f.model_type for f in FAMILIES if f"`{f.model_type}`" not in MODELS]
    assert not missing, missing


def test_the_preset_counts_and_names_are_the_shipped_files() -> None:
    presets = list_presets()
    tiny = [name for name in presets if name.startswith("tiny/")]
    assert _number(r"lists the (\d+) presets", MODELS) == len(presets)
    assert _number(r"(\d+) published models", MODELS) == len(presets) - len(tiny)
    assert _number(r"(\d+) test models", MODELS) == len(tiny)
    missing = [name for name in presets if f"`{name}`" not in MODELS]
    assert not missing, missing
