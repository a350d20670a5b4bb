"""The benchmark scripts' CSV output: each writes its rows to stdout and, with --out, to a file."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path


def write_csv(path: Path | None, columns: Sequence[str], rows: Sequence[dict]) -> None:
    """Write `rows` (header `columns`) to `path`, creating its folder; nothing when `path` is None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(rows)
