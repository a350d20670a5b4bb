"""Results files survive concurrent writers, keep their mode and symlinks, and refuse what is not a
complete text CSV of the schema with one line naming the problem."""

from __future__ import annotations

import multiprocessing
import os
import stat
from pathlib import Path

import pytest

from streambp_bench.results import ResultRow, ResultsFile, SchemaError
from streambp_core.config import ConfigError

WRITERS = 4
ROWS_PER_WRITER = 25


def _row(seq_len_tokens: int, method: str = "streambp") -> ResultRow:
    return ResultRow(method=method, model="m", seq_len_tokens=seq_len_tokens, source="simulated",
                     metric="peak_memory", value=float(seq_len_tokens), device_name="d",
                     timestamp="2025-06-01T12:00:00+00:00")


def _write_rows(path: str, writer: int, barrier) -> None:
    """One sweep: upsert its own rows one at a time, starting with the other writers."""
    barrier.wait()
    file = ResultsFile(path)
    for index in range(ROWS_PER_WRITER):
        file.upsert(_row(writer * 1000 + index))


def test_concurrent_writers_lose_no_rows(tmp_path: Path) -> None:
    path = tmp_path / "sweep.csv"
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(WRITERS)
    workers = [context.Process(target=_write_rows, args=(str(path), w, barrier)) for w in range(WRITERS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=240)
    assert [worker.exitcode for worker in workers] == [0] * WRITERS
    lengths = sorted(row.seq_len_tokens for row in ResultsFile(path).rows())
    assert lengths == sorted(w * 1000 + i for w in range(WRITERS) for i in range(ROWS_PER_WRITER))


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o664])
def test_a_rewrite_keeps_the_files_mode(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "r.csv"
    ResultsFile(path).upsert(_row(1))
    path.chmod(mode)
    ResultsFile(path).upsert(_row(2))
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_a_new_file_gets_the_umasks_mode(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        ResultsFile(tmp_path / "new.csv").upsert(_row(1))
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "new.csv").stat().st_mode) == 0o640


def test_a_rewrite_through_a_symlink_keeps_the_link(tmp_path: Path) -> None:
    real = tmp_path / "data" / "real.csv"
    ResultsFile(real).upsert(_row(1))
    link = tmp_path / "link.csv"
    link.symlink_to(real)
    ResultsFile(link).upsert(_row(2))
    assert link.is_symlink() and link.resolve() == real
    assert [row.seq_len_tokens for row in ResultsFile(real).rows()] == [1, 2]


def _three_rows(path: Path) -> bytes:
    ResultsFile(path).append_many([_row(1), _row(2), _row(3)])
    return path.read_bytes()


def test_a_last_row_cut_mid_row_is_refused_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "cut.csv"
    data = _three_rows(path)
    path.write_bytes(data[:-5])  # inside the last row's timestamp cell: every column still present
    with pytest.raises(SchemaError, match=r"cut\.csv, line 4: the file ends mid-row"):
        ResultsFile(path).rows()
    last_row_start = data.rstrip(b"\r\n").rindex(b"\n") + 1
    path.write_bytes(data[: last_row_start + 30])  # a few cells of the last row
    with pytest.raises(SchemaError, match=r"cut\.csv, line 4: \d+ cells where the header has"):
        ResultsFile(path).rows()


def test_a_row_with_missing_cells_is_refused_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "short.csv"
    lines = _three_rows(path).decode().splitlines(keepends=True)
    lines[2] = ",".join(lines[2].split(",")[:10]) + "\r\n"
    path.write_text("".join(lines), newline="")
    with pytest.raises(SchemaError, match=r"short\.csv, line 3: 10 cells where the header has \d+"):
        ResultsFile(path).load()


BINARY = [b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xd8", b"method,model\nx,\x00y\n"]


@pytest.mark.parametrize("content", BINARY)
def test_a_binary_file_is_a_schema_error_on_one_line(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "figure.png"
    path.write_bytes(content)
    with pytest.raises(SchemaError) as caught:
        ResultsFile(path).load()
    assert "\n" not in str(caught.value) and "figure.png" in str(caught.value)
    with pytest.raises(SchemaError):
        ResultsFile(path).upsert(_row(1))  # never overwritten


def test_check_target_refuses_a_directory_another_schema_and_a_file_as_folder(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="is a directory"):
        ResultsFile(tmp_path).check_target()
    other = tmp_path / "other.csv"
    other.write_text("kernel,speed\nrms,1\n")
    with pytest.raises(SchemaError, match="not a streambp-bench results CSV"):
        ResultsFile(other).check_target()
    with pytest.raises(ConfigError, match="is not a directory"):
        ResultsFile(other / "sub" / "r.csv").check_target()
    ResultsFile(tmp_path / "new" / "r.csv").check_target()  # a folder that does not exist yet is fine


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_check_target_refuses_a_read_only_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="no permission to write"):
            ResultsFile(folder / "r.csv").check_target()
    finally:
        folder.chmod(0o755)
