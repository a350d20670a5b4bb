"""A CSV file read strictly and rewritten safely by several processes at once.

- Reading: UTF-8 text, with or without a byte-order mark (a spreadsheet saving the file adds one); a
  file that is not UTF-8 text, holds NUL bytes, is a directory, or whose rows do not have
  the header's cells (a row cut short, or the last row cut mid-row: no end of line) is a SchemaError
  naming the line, never a half-parsed row.
- Rewriting: `locked(path)` holds an exclusive lock (the `filelock` package, a `.NAME.lock` file beside
  the CSV) around a read-merge-replace, so concurrent writers never lose each other's rows;
  `atomic_rewrite` writes a temporary file in the same directory, fsyncs it, gives it the old file's
  permission bits (a new file gets the umask's) and `os.replace`s it over the file. Through a symlink
  the file it points to is rewritten and the link is kept.
- Appending (under the same lock): `append_records` writes the new rows' bytes at the end of the file in
  one `write` and fsyncs it, so a row costs its own bytes, not the file's; an append that fails or is
  interrupted (an exception, Ctrl-C, SIGTERM) truncates the file back to its old size. `read_tail`
  reads only the rows past a known offset (what other writers appended since).
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import secrets
import signal
import stat
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from filelock import FileLock, Timeout

from streambp_bench.errors import SchemaError
from streambp_core.config import ConfigError

LOCK_TIMEOUT_S = 300.0
"""How long a writer waits for another one's read-merge-replace before giving up."""


Record = dict[str, str]


def real_path(path: str | os.PathLike[str]) -> Path:
    """`path` with every symlink resolved: the file a rewrite must replace."""
    return Path(os.path.realpath(path))


def read_records(path: Path) -> tuple[list[str] | None, list[tuple[int, Record]]]:
    """(header, [(line number, record)]) of an existing CSV; SchemaError when it is not one (module doc)."""
    if path.is_dir():
        raise SchemaError(f"{path} is a directory, not a CSV file")
    check_regular(path)
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:  # a spreadsheet's byte-order mark
            text = handle.read()
    except UnicodeDecodeError as error:
        raise SchemaError(f"{path} is not a text CSV file (byte {error.start} is not UTF-8)") from None
    reader = csv.DictReader(io.StringIO(text))
    records = []
    try:
        header = reader.fieldnames
        for record in reader:
            _check_cells(path, reader.line_num, record, len(header or ()))
            records.append((reader.line_num, record))
    except csv.Error as error:
        raise SchemaError(f"{path}, line {reader.line_num}: not a CSV file ({error})") from None
    if records and not text.endswith(("\n", "\r")):
        raise SchemaError(f"{path}, line {records[-1][0]}: the file ends mid-row (no end of line after it)")
    return header, records


TAIL_CHECK_BYTES = 256
"""Bytes before a known end of a CSV that `read_tail` compares with what they were (`bytes_before`)."""


def bytes_before(path: Path, offset_bytes: int) -> bytes:
    """The `TAIL_CHECK_BYTES` bytes of `path` before `offset_bytes` (fewer at the start of the file)."""
    with path.open("rb") as handle:
        handle.seek(max(offset_bytes - TAIL_CHECK_BYTES, 0))
        return handle.read(min(offset_bytes, TAIL_CHECK_BYTES))


def read_tail(path: Path, offset_bytes: int, header: Sequence[str], before: bytes
              ) -> list[tuple[int, Record]]:
    """The records of `path` from byte `offset_bytes` on, read with `header`, when the bytes before it are
    still `before` (`bytes_before` when that end was read) and end a row; SchemaError otherwise (the file
    was replaced or changed in place, not only appended to) or when the tail is not whole rows. Line
    numbers count from the tail's first row as 1."""
    start = max(offset_bytes - len(before), 0)
    with path.open("rb") as handle:
        handle.seek(start)
        data = handle.read()
    if data[: offset_bytes - start] != before or (offset_bytes and not before.endswith(b"\n")):
        raise SchemaError(f"{path} changed since it was read (the bytes before {offset_bytes} differ)")
    tail = data[offset_bytes - start:]
    try:
        text = tail.decode("utf-8")
    except UnicodeDecodeError as error:
        where = offset_bytes + error.start
        raise SchemaError(f"{path} is not a text CSV file (byte {where} is not UTF-8)") from None
    if text and not text.endswith(("\n", "\r")):
        raise SchemaError(f"{path}: the file ends mid-row (no end of line after its last row)")
    reader = csv.DictReader(io.StringIO(text), fieldnames=list(header))
    records = []
    try:
        for record in reader:
            _check_cells(path, reader.line_num, record, len(header))
            records.append((reader.line_num, record))
    except csv.Error as error:
        raise SchemaError(f"{path}: not a CSV file past byte {offset_bytes} ({error})") from None
    return records


def _check_cells(path: Path, line: int, record: dict, expected: int) -> None:
    """SchemaError unless a DictReader record has exactly the header's cells."""
    missing = sum(value is None for key, value in record.items() if key is not None)
    extra = len(record.get(None) or ())
    if missing or extra:
        found = expected - missing + extra
        raise SchemaError(f"{path}, line {line}: {found} cells where the header has {expected} (cut short?)")


@contextlib.contextmanager
def locked(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold the writers' lock of the CSV at `path` (resolved through symlinks); yields the real path."""
    real = real_path(path)
    real.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(real.with_name(f".{real.name}.lock")), timeout=LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except Timeout:
        raise ConfigError(f"{path}: another writer held its lock for over {LOCK_TIMEOUT_S:g} s") from None
    try:
        yield real
    finally:
        lock.release()


def atomic_rewrite(path: str | os.PathLike[str], header: Sequence[str], records: Sequence[Record]) -> None:
    """Replace the CSV at `path` (through symlinks) with `header` and `records`, atomically (module doc)."""
    real = real_path(path)
    real.parent.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(real.stat().st_mode) if real.exists() else None
    temp = real.with_name(f".{real.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    with _sigterm_raises(), _named(path):
        _write_and_replace(real, temp, mode, header, records)


@contextlib.contextmanager
def _named(path: str | os.PathLike[str]) -> Iterator[None]:
    """An OSError of a write (ENOSPC, EIO, EDQUOT) names `path`, so its one `error:` line says which file
    could not be written."""
    try:
        yield
    except OSError as error:
        if error.filename is not None or error.errno is None:
            raise
        raise OSError(error.errno, f"cannot write results: {error.strerror}", str(path)) from None


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While a temporary file exists: SIGTERM raises SystemExit(143) (in the main thread), so the rewrite's
    cleanup removes the file before the process ends as SIGTERM would have ended it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _write_and_replace(real: Path, temp: Path, mode: int | None, header: Sequence[str],
                       records: Sequence[Record]) -> None:
    """Write `temp`, give it `mode`, and replace `real` with it; remove `temp` whatever happens."""
    descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    try:
        with os.fdopen(descriptor, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(header))
            writer.writeheader()
            writer.writerows(records)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(temp, mode)
        os.replace(temp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def append_records(path: str | os.PathLike[str], header: Sequence[str], records: Sequence[Record]) -> int:
    """Append `records` (cells in `header`'s order, the rewrite's dialect) to the existing CSV at `path`
    (through symlinks; the caller holds `locked` and has checked the header); returns the file's new size
    in bytes. Whatever interrupts it, the file is left at its old size (module doc)."""
    buffer = io.StringIO()
    csv.DictWriter(buffer, fieldnames=list(header)).writerows(records)
    payload = buffer.getvalue().encode("utf-8")
    real = real_path(path)
    try:
        descriptor = os.open(real, os.O_WRONLY | os.O_APPEND)
    except PermissionError:
        raise ConfigError(f"cannot write {path}: {real} is read-only") from None
    try:
        with _sigterm_raises(), _named(path):
            size_bytes = os.fstat(descriptor).st_size
            try:
                written = 0
                while written < len(payload):  # one write for a point's rows; a short write goes on
                    written += os.write(descriptor, payload[written:])
                os.fsync(descriptor)
            except BaseException:
                os.ftruncate(descriptor, size_bytes)
                raise
    finally:
        os.close(descriptor)
    return size_bytes + len(payload)


def check_regular(path: str | os.PathLike[str]) -> None:
    """ConfigError when `path` exists (through its symlinks) but is not a regular file: a device such as
    /dev/zero (endless to read) or /dev/full, a FIFO or a socket is no results file."""
    real = real_path(path)
    if real.exists() and not real.is_dir() and not real.is_file():
        raise ConfigError(f"{path}: {real} is not a regular file (a results file must be a regular file or "
                          "a new path)")


def check_writable(path: str | os.PathLike[str]) -> None:
    """ConfigError when a file could not be created or replaced at `path`: the file itself (or its writers'
    lock) exists read-only, or its nearest existing folder is not a directory or not writable."""
    check_regular(path)
    real = real_path(path)
    for target in (real, real.with_name(f".{real.name}.lock")):
        if target.is_file() and not os.access(target, os.W_OK):
            raise ConfigError(f"cannot write {path}: {target} is read-only")
    folder = real.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"cannot write {path}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write {path}: no permission to write in {folder}")
