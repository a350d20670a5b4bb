"""A results CSV on disk: rows are upserted by key, appended or atomically rewritten.

Rows of new points are appended (`csv_io.append_records`): a point costs its own bytes, not the file's.
Re-running a point replaces its row, and a file of an older header is brought to this one: both rewrite
the whole file, to a temporary file that `os.replace` moves over the old one. Either way an interrupted
sweep (Ctrl-C, SIGTERM, kill -9) keeps every finished row and never leaves a half-written file, and every
write holds the file's lock, so concurrent sweeps into one CSV lose no rows (`streambp_bench.results
.csv_io`). A ResultsFile remembers the keys it has seen and where the file ended: the next append reads
only what other writers added since (the whole file again only when it was replaced or changed in place).

    results = ResultsFile("results/sweep.csv")
    if ResultRow.key_of(**point) not in {row.key() for row in results.rows()}:  # point: KEY_COLUMNS
        results.upsert(ResultRow(**point, **measured, **provenance(...)))
"""

from __future__ import annotations

import os
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from streambp_bench.errors import SchemaError
from streambp_bench.results import csv_io
from streambp_bench.results.row import COLUMNS, ResultRow, rows_to_frame
from streambp_bench.results.schema_history import ADDED_COLUMNS, complete_schema_1, is_schema_1

if TYPE_CHECKING:  # pandas is imported where a frame is built: writing rows does not need it
    import pandas as pd


@dataclass
class _KeyIndex:
    """The keys of a file's rows and where the file ended when they were read (its device and inode tell a
    replaced file from an appended one)."""

    file_id: tuple[int, int, int]
    size_bytes: int
    keys: set[tuple[str, ...]]
    before: bytes = b""
    """The bytes before `size_bytes` as they were (`csv_io.bytes_before`): a file replaced under a
    reused inode number is told apart from one appended to."""


class ResultsFile:
    """A results CSV on disk: load it, upsert rows by key (append or atomic rewrite), list its points."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._index: _KeyIndex | None = None

    def load(self) -> pd.DataFrame:
        """All rows as a typed DataFrame (`rows_to_frame`); FileNotFoundError without a file; SchemaError."""
        if not self.path.exists():
            raise FileNotFoundError(f"no such results file: {self.path}")
        return rows_to_frame(self.rows())

    def rows(self) -> list[ResultRow]:
        """All rows, parsed and validated (SchemaError names the line of a bad cell); [] without a file."""
        return self._parsed(self._records())

    def _parsed(self, records: list[tuple[int, dict[str, str]]]) -> list[ResultRow]:
        """The rows of (line number, record) pairs; SchemaError names the line of a bad cell."""
        rows = []
        for line_number, record in records:
            try:
                rows.append(ResultRow.from_record(record))
            except (TypeError, ValueError) as error:
                raise SchemaError(f"{self.path}, line {line_number}: {error}") from None
        return rows

    def upsert(self, row: ResultRow) -> None:
        """Write `row`, replacing the row with the same key if there is one (`append_many`)."""
        self.append_many([row])

    def append_many(self, rows: Iterable[ResultRow]) -> None:
        """Upsert several rows under the file's lock; within `rows` the last of equal keys wins, and rows
        other writers added meanwhile are kept. New keys in a file of this header are appended; a key
        already there, a new file or an older header rewrite the file atomically."""
        new_rows = {row.key(): row for row in rows}
        with csv_io.locked(self.path) as real:
            keys = self._known_keys(real)
            if keys is not None and keys.isdisjoint(new_rows):
                records = [row.to_record() for row in new_rows.values()]
                size_bytes = csv_io.append_records(real, COLUMNS, records)
                keys.update(new_rows)
                self._index = _index_of(real, keys, size_bytes)
                return
            by_key = {row.key(): row for row in self.rows()}
            by_key.update(new_rows)
            csv_io.atomic_rewrite(self.path, COLUMNS, [row.to_record() for row in by_key.values()])
            self._index = _index_of(real, set(by_key))

    def replace_many(self, rows: Iterable[ResultRow], stale: Callable[[ResultRow], bool]) -> None:
        """Upsert `rows` and drop, in the same atomic rewrite under the file's lock, every other row that
        `stale` names (e.g. an estimate at a length the re-run search no longer finds)."""
        new_rows = {row.key(): row for row in rows}
        with csv_io.locked(self.path) as real:
            kept = {row.key(): row for row in self.rows() if row.key() in new_rows or not stale(row)}
            kept.update(new_rows)
            csv_io.atomic_rewrite(self.path, COLUMNS, [row.to_record() for row in kept.values()])
            self._index = _index_of(real, set(kept))

    def _known_keys(self, real: Path) -> set[tuple[str, ...]] | None:
        """The keys in the file at `real` (the caller holds its lock), read from the end this object last
        saw when the file was only appended to since; None when rows cannot be appended (no file yet, or a
        header other than this schema's: a rewrite brings it up to date)."""
        if not real.is_file():
            return None
        index, size_bytes, file_id = self._index, real.stat().st_size, _file_id(real)
        if index is not None and (file_id == index.file_id and size_bytes == index.size_bytes or
                                  file_id[:2] == index.file_id[:2] and size_bytes > index.size_bytes):
            try:
                tail = csv_io.read_tail(real, index.size_bytes, COLUMNS, index.before)
                index.keys.update(ResultRow.from_record(record).key() for _, record in tail)
                self._index = _index_of(real, index.keys, size_bytes)
                return index.keys
            except (SchemaError, TypeError, ValueError):
                pass  # changed in place, not only appended to: read it whole
        self._index = None
        header, records = csv_io.read_records(real)
        if list(header or ()) != list(COLUMNS):
            return None
        keys = {row.key() for row in self._parsed(records)}
        self._index = _index_of(real, keys, size_bytes)
        return keys

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


def _index_of(real: Path, keys: set[tuple[str, ...]], size_bytes: int | None = None) -> _KeyIndex:
    """The index of the file at `real` holding `keys`, ending at `size_bytes` (None: its size now)."""
    size_bytes = real.stat().st_size if size_bytes is None else size_bytes
    return _KeyIndex(_file_id(real), size_bytes, keys, csv_io.bytes_before(real, size_bytes))


def _file_id(path: Path) -> tuple[int, int, int]:
    """(device, inode, modification time in ns) of the file at `path`: an atomic rewrite gives it a new
    inode, a write its time (a file of the size last seen but another time was changed in place)."""
    status = path.stat()
    return status.st_dev, status.st_ino, status.st_mtime_ns


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
