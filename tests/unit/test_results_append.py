"""Appending a point to a results CSV costs the point's bytes, not the file's; a re-run point, an older
header or a file changed behind the writer's back still goes through the whole-file path, and an append
that is interrupted leaves the file as it was."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streambp_bench.results import ResultRow, ResultsFile, csv_io
from streambp_bench.results.schema_history import ADDED_COLUMNS

FILE_ROWS = 3000
REPO = Path(__file__).parents[2]


def _row(seq_len_tokens: int, value: float | None = None) -> ResultRow:
    return ResultRow(method="streambp", model="m", seq_len_tokens=seq_len_tokens, source="simulated",
                     metric="peak_memory", value=float(seq_len_tokens if value is None else value),
                     device_name="d", timestamp="2025-06-01T12:00:00+00:00")


def _io_counters() -> dict[str, int]:
    """This process's bytes passed to write() and read() so far (Linux /proc/self/io)."""
    lines = Path("/proc/self/io").read_text().splitlines()
    return {name: int(value) for name, value in (line.split(": ") for line in lines)}


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's /proc/self/io")
def test_an_append_writes_and_reads_its_own_bytes_not_the_files(tmp_path: Path) -> None:
    path = tmp_path / "sweep.csv"
    ResultsFile(path).append_many(_row(i) for i in range(1, FILE_ROWS + 1))
    file = ResultsFile(path)
    file.upsert(_row(FILE_ROWS + 1))  # the first append of a writer reads the file once (its keys)
    inode, size_bytes = path.stat().st_ino, path.stat().st_size
    row_bytes = size_bytes // (FILE_ROWS + 2)
    before = _io_counters()
    file.upsert(_row(FILE_ROWS + 2))
    after = _io_counters()
    written, read = after["wchar"] - before["wchar"], after["rchar"] - before["rchar"]
    assert size_bytes > 500_000
    assert written == path.stat().st_size - size_bytes  # the row's bytes, nothing else
    assert written < 2 * row_bytes
    assert read < 16 * row_bytes  # the tail since the last append, not the file
    assert path.stat().st_ino == inode  # appended in place, not replaced
    assert [row.seq_len_tokens for row in ResultsFile(path).rows()] == list(range(1, FILE_ROWS + 3))


def test_rows_another_writer_appended_are_seen_and_replaced_not_duplicated(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    first, second = ResultsFile(path), ResultsFile(path)
    first.upsert(_row(1))
    second.upsert(_row(2))
    first.upsert(_row(3))
    first.upsert(_row(2, value=20.0))  # second's row, read from the tail first saw nothing of
    rows = ResultsFile(path).rows()
    assert [(row.seq_len_tokens, row.value) for row in rows] == [(1, 1.0), (2, 20.0), (3, 3.0)]


def test_a_file_replaced_or_edited_in_place_is_read_again_whole(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    first, second = ResultsFile(path), ResultsFile(path)
    first.append_many([_row(1), _row(2)])
    second.upsert(_row(1, value=10.0))  # a rewrite: a new file under the name
    first.upsert(_row(1, value=11.0))
    assert [(row.seq_len_tokens, row.value) for row in ResultsFile(path).rows()] == [(1, 11.0), (2, 2.0)]
    text = path.read_text()
    path.write_text(text.replace("streambp,m,sft,2,", "streambp,m,sft,7,"))  # same size, in place
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    first.upsert(_row(7, value=70.0))
    assert [(row.seq_len_tokens, row.value) for row in ResultsFile(path).rows()] == [(1, 11.0), (7, 70.0)]


@pytest.mark.parametrize("crash", [OSError("disk full"), KeyboardInterrupt()])
def test_an_append_cut_short_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash: BaseException
) -> None:
    path = tmp_path / "r.csv"
    file = ResultsFile(path)
    file.append_many([_row(1), _row(2)])
    before = path.read_bytes()
    real_write = os.write

    def write_half_then_crash(descriptor: int, data: bytes) -> int:
        real_write(descriptor, data[: len(data) // 2])
        raise crash

    monkeypatch.setattr(csv_io.os, "write", write_half_then_crash)
    with pytest.raises(type(crash)):
        file.upsert(_row(3))
    monkeypatch.undo()
    assert path.read_bytes() == before
    file.upsert(_row(3))
    assert [row.seq_len_tokens for row in ResultsFile(path).rows()] == [1, 2, 3]


def test_a_file_of_an_older_header_is_rewritten_in_this_schema(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    ResultsFile(path).upsert(_row(1))
    header, *lines = path.read_text().splitlines(keepends=True)
    names = header.strip().split(",")
    index = names.index(next(name for name in reversed(names) if name in ADDED_COLUMNS))

    def without(line: str) -> str:
        cells = line.rstrip("\r\n").split(",")
        return ",".join(cells[:index] + cells[index + 1:]) + "\r\n"

    path.write_text("".join(without(line) for line in [header, *lines]), newline="")
    ResultsFile(path).upsert(_row(2))
    assert path.read_text().splitlines()[0] == header.strip()  # the current header, written whole
    assert [row.seq_len_tokens for row in ResultsFile(path).rows()] == [1, 2]


APPENDER = """
import sys
from streambp_bench.results import ResultRow, ResultsFile
file = ResultsFile(sys.argv[1])
for i in range(1, 1_000_000):
    file.upsert(ResultRow(method="streambp", model="m", seq_len_tokens=i, source="simulated",
                          metric="peak_memory", value=float(i), device_name="d"))
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_mid_append_loses_no_finished_row_and_breaks_no_row(tmp_path: Path, signum: int) -> None:
    path = tmp_path / "sweep.csv"
    writer = subprocess.Popen([sys.executable, "-c", APPENDER, str(path)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not path.exists() or path.stat().st_size < 20_000):
        time.sleep(0.02)
    writer.send_signal(signum)
    writer.wait(timeout=60)
    rows = ResultsFile(path).rows()  # parses: no row cut short
    assert len(rows) >= 20
    assert [row.seq_len_tokens for row in rows] == list(range(1, len(rows) + 1))
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_file_rewritten_in_place_and_grown_is_read_again_whole(tmp_path: Path) -> None:
    """As a file replaced under a reused inode number looks: same inode, larger, other bytes before the
    end the writer knew. Its rows are read again, so a re-run point still replaces its row."""
    path = tmp_path / "r.csv"
    first = ResultsFile(path)
    first.append_many([_row(1), _row(2)])
    other = tmp_path / "other.csv"
    ResultsFile(other).append_many([_row(5), _row(2, value=7.0), _row(1, value=9.0)])
    with path.open("r+b") as handle:  # the same inode, now holding another writer's file
        handle.write(other.read_bytes())
    first.upsert(_row(1, value=10.0))
    rows = ResultsFile(path).rows()
    assert sorted((row.seq_len_tokens, row.value) for row in rows) == [(1, 10.0), (2, 7.0), (5, 5.0)]


def test_a_csv_saved_with_a_byte_order_mark_reads_and_takes_rows(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    ResultsFile(path).append_many([_row(1)])
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # as a spreadsheet saves it
    assert [row.seq_len_tokens for row in ResultsFile(path).rows()] == [1]
    ResultsFile(path).upsert(_row(2))
    assert [row.seq_len_tokens for row in ResultsFile(path).rows()] == [1, 2]


def test_a_file_made_read_only_during_a_sweep_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streambp_core.config import ConfigError

    path = tmp_path / "r.csv"
    file = ResultsFile(path)
    file.upsert(_row(1))

    real_open = os.open

    def read_only(file, flags, *args, **kwargs):  # the CSV opened to append; the lock file as before
        if flags & os.O_APPEND:
            raise PermissionError(13, "Permission denied")
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(csv_io.os, "open", read_only)
    with pytest.raises(ConfigError, match=r"cannot write .*r\.csv.* is read-only"):
        file.upsert(_row(2))


def test_replace_many_drops_the_rows_it_names_stale_and_keeps_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "alst.csv"
    file = ResultsFile(path)
    file.append_many([_row(100), _row(200), _row(300)])
    file.replace_many([_row(250)], stale=lambda row: row.seq_len_tokens in (100, 250, 300))
    assert sorted(row.seq_len_tokens for row in ResultsFile(path).rows()) == [200, 250]
    file.upsert(_row(400))  # its index follows the rewrite: an append after it is seen
    assert sorted(row.seq_len_tokens for row in ResultsFile(path).rows()) == [200, 250, 400]


def test_a_rerun_alst_cell_replaces_its_estimate_at_the_old_length() -> None:
    from streambp_bench.paper.alst import _stale_estimate

    def estimate(seq_len_tokens: int, gpus: int) -> ResultRow:
        return ResultRow(method="mst", model="m", seq_len_tokens=seq_len_tokens, gpus=gpus, sp=gpus,
                         source="estimated", metric="step_time", value=1.0, device_name="H100",
                         timestamp="2025-06-01T12:00:00+00:00")

    stale = _stale_estimate([estimate(500, gpus=8)])
    assert stale(estimate(400, gpus=8))  # the same cell at the length its old search found
    assert not stale(estimate(400, gpus=16))  # another cell, not re-run
    assert not stale(_row(400))  # a max_len or memory row is never an old estimate
