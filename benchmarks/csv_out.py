"""The benchmark scripts' CSV output: each writes its rows to stdout and, with --out, to a file, replaced
atomically under the writers' lock (`streambp_bench.results.csv_io`): an interrupted or concurrent run
leaves the old file or the new one, never a cut one."""

from __future__ import annotations

import csv
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from streambp_bench.errors import USER_ERRORS, print_error
from streambp_bench.results.csv_io import atomic_rewrite, check_writable, locked


def check_out(path: Path | None) -> None:
    """ConfigError (one line) before any work when --out could not be written; nothing for None."""
    if path is not None:
        if path.is_dir():
            from streambp_core.config import ConfigError

            raise ConfigError(f"--out {path} is a directory; give a CSV file")
        check_writable(path)


def write_csv(path: Path | None, columns: Sequence[str], rows: Sequence[dict]) -> None:
    """Replace `path` with `rows` (header `columns`); nothing when `path` is None."""
    if path is None:
        return
    records = [{column: "" if row.get(column) is None else str(row[column]) for column in columns}
               for row in rows]
    with locked(path) as real:
        atomic_rewrite(real, columns, records)


def emit_rows(rows_of: Callable[[], Iterable[dict]], out: Path | None, columns: Sequence[str]) -> int:
    """A script's exit code: check `out`, call `rows_of`, print each row as CSV as it comes, then write them
    all to `out`. Bad input (`USER_ERRORS` from the check or from `rows_of` itself; a lazy iterable's rows
    come after it) is one `error:` line and exit code 2, with nothing written."""
    try:
        check_out(out)
        found = rows_of()
    except USER_ERRORS as error:
        print_error(error)
        return 2
    writer = csv.DictWriter(sys.stdout, columns)
    writer.writeheader()
    rows = []
    for row in found:
        rows.append(row)
        writer.writerow(row)
        sys.stdout.flush()
    write_csv(out, columns, rows)
    return 0


def script_main(parse_args: Callable, rows: Callable, columns: Sequence[str]) -> Callable[..., int]:
    """A script's `main(argv=None) -> exit code`: `parse_args(argv)`, then `rows(args)` emitted to stdout
    and `args.out` (`emit_rows`)."""

    def main(argv: list[str] | None = None) -> int:
        """Print the rows (and write them with --out); bad input is one `error:` line and exit code 2."""
        args = parse_args(argv)
        return emit_rows(lambda: rows(args), args.out, columns)

    return main
