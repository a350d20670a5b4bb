"""Model directories the tests build: a config.json written where a test asks, read back as any user's
local model directory is (`streambp_core.models.catalogue`)."""

from __future__ import annotations

import json
from pathlib import Path


def config_directory(parent: Path, name: str, values: dict) -> str:
    """`parent / name` (made if missing) holding `values` as its config.json; its path as text."""
    directory = parent / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(values, default=str))
    return str(directory)
