"""Results CSVs: the row schema (`row`), files of rows (`file`, over `csv_io`), older schemas
(`schema_history`) and where a row came from (`versions`: provenance).

What the commands and benchmarks use is importable from here: `ResultRow`, `ResultsFile`, `provenance`
the helpers that fill a row's columns, and the
SchemaError a file of another schema raises.
"""

from streambp_bench.errors import SchemaError
from streambp_bench.results.file import ResultsFile, check_header
from streambp_bench.results.row import (
    CATEGORY_COLUMNS,
    COLUMNS,
    KEY_COLUMNS,
    METRICS,
    RESOLVED_HEAD_MODES,
    SOURCES,
    STATUSES,
    ResultRow,
    allocator_columns,
    host_columns,
    memory_columns,
    row_head_mode,
    rows_to_frame,
    spec_fields,
)
from streambp_bench.results.versions import provenance

__all__ = [
    "CATEGORY_COLUMNS", "COLUMNS", "KEY_COLUMNS", "METRICS", "RESOLVED_HEAD_MODES", "SOURCES", "STATUSES",
    "ResultRow", "ResultsFile", "SchemaError", "allocator_columns", "check_header", "host_columns",
    "memory_columns", "provenance", "row_head_mode", "rows_to_frame", "spec_fields",
]  # fmt: skip
