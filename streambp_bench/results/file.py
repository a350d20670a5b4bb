"""A results CSV on disk: rows are upserted by key with atomic writes.

Re-running a point replaces its row; each write goes to a temporary file that `os.replace` moves over the
old one, so an interrupted sweep (Ctrl-C, kill -9) keeps every finished row and never leaves a
half-written file, and the read-merge-replace holds a file lock, so concurrent sweeps into one CSV lose
no rows (`streambp_bench.results.csv_io`):

    results = ResultsFile("results/sweep.csv")
    if ResultRow.key_of(**point) not in {row.key() for row in results.rows()}:  # point: KEY_COLUMNS
        results.upsert(ResultRow(**point, **measured, **provenance(...)))
"""

from __future__ import annotations

import os
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from streambp_bench.errors import SchemaError
from streambp_bench.results import csv_io
from streambp_bench.results.row import COLUMNS, ResultRow, rows_to_frame
from streambp_bench.results.schema_history import ADDED_COLUMNS, complete_schema_1, is_schema_1

if TYPE_CHECKING:  # pandas is imported where a frame is built: writing rows does not need it
    import pandas as pd


class ResultsFile:
    """A results CSV on disk: load it, upsert rows by key (atomically), list the finished points."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> pd.DataFrame:
        """All rows as a typed DataFrame (`rows_to_frame`); FileNotFoundError without a file; SchemaError."""
        if not self.path.exists():
            raise FileNotFoundError(f"no such results file: {self.path}")
        return rows_to_frame(self.rows())

    def rows(self) -> list[ResultRow]:
        """All rows, parsed and validated (SchemaError names the line of a bad cell); [] without a file."""
        rows = []
        for line_number, record in self._records():
            try:
                rows.append(ResultRow.from_record(record))
            except (TypeError, ValueError) as error:
                raise SchemaError(f"{self.path}, line {line_number}: {error}") from None
        return rows

    def upsert(self, row: ResultRow) -> None:
        """Write `row`, replacing the row with the same key if there is one (atomic rewrite)."""
        self.append_many([row])

    def append_many(self, rows: Iterable[ResultRow]) -> None:
        """Upsert several rows in one locked, atomic read-merge-replace; within `rows` the last of equal
        keys wins, and rows other writers added meanwhile are kept."""
        new_rows = list(rows)
        with csv_io.locked(self.path):
            by_key = {row.key(): row for row in self.rows()}
            by_key.update((row.key(), row) for row in new_rows)
            csv_io.atomic_rewrite(self.path, COLUMNS, [row.to_record() for row in by_key.values()])

    def check_target(self) -> None:
        """Before any work: SchemaError or ConfigError (one line) unless rows can be written here: an
        existing file must be a results CSV of this schema (or schema 1), and its folder writable."""
        self.rows()
        csv_io.check_writable(self.path)

    def _records(self) -> list[tuple[int, dict[str, str]]]:
        """(line number, raw record) per row, header checked, schema-1 records completed
        (`schema_history`); [] when the file does not exist."""
        if not self.path.exists():
            return []
        header, records = csv_io.read_records(self.path)
        if is_schema_1(header):
            return [(line, complete_schema_1(record)) for line, record in records]
        added = [name for name in ADDED_COLUMNS if header and name not in header]
        check_header([*header, *added] if header else header, self.path)
        defaults = {name: ADDED_COLUMNS[name] for name in added}
        return [(line, {**record, **defaults}) for line, record in records]


def check_header(header: typing.Sequence[str] | None, path: Path) -> None:
    """Raise SchemaError naming the missing and unexpected columns unless `header` is this schema's
    (a schema-1 header, still read, is checked by `schema_history.is_schema_1` before this)."""
    if not header:
        raise SchemaError(f"{path} is empty: no CSV header")
    missing = [name for name in COLUMNS if name not in header]
    extra = [str(name) for name in header if name not in COLUMNS]
    if missing or extra:
        found = {"missing": missing, "unexpected": extra}
        detail = "; ".join(f"{what} columns: {_some(names)}" for what, names in found.items() if names)
        raise SchemaError(f"{path} is not a streambp-bench results CSV ({detail})")


def _some(names: list[str], limit: int = 8) -> str:
    """The first `limit` names, comma-separated, then how many more."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
