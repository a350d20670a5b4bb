"""`verify --packing`: packed rows through every method on the real app; bad document lengths are one
`error:` line."""

from __future__ import annotations

import json

import pytest

from streambp_bench.cli import app
from streambp_core.step.parts.batch import document_lengths
from tests.cli.errors import one_line_error

PACKED = ["verify", "--model", "tiny/mistral", "--dtype", "float64", "--seq-len", "24", "--ps", "5",
          "--ps-head", "4", "-b", "2"]



def test_verify_packing_passes_and_names_the_documents(runner):
    """Documents [5, 7, 1, 10] and one trailing padding token: a document ends at a chunk boundary, a
    one-token one, a chunk spanning three."""
    result = runner.invoke(app, [*PACKED, "--packing", "5,7,1,10", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] and report["spec"]["packing"] == "5,7,1,10"
    assert {r["method"] for r in report["results"]} == {"checkpoint", "mst", "streambp"}
    assert all(r["max_rel_err"] <= 1e-10 for r in report["results"])


def test_random_document_lengths_fill_each_row():
    rows = document_lengths("3", 50, 2, seed=0)
    assert [len(row) for row in rows] == [3, 3] and [sum(row) for row in rows] == [50, 50]
    assert rows[0] != rows[1] and rows == document_lengths("3", 50, 2, seed=0)


@pytest.mark.parametrize(("packing", "extra", "words"), [
    ("0,3", [], "document count or lengths"),
    ("20,20", [], "sum to 40 > seq_len 24"),
    ("30", [], "30 documents do not fit"),
    ("3", ["--padding", "right"], "--packing with --padding"),
    ("3", ["--objective", "dpo"], "not dpo"),
])
def test_bad_packing_is_one_error_line(runner, packing, extra, words):
    one_line_error(runner.invoke(app, [*PACKED, "--packing", packing, *extra]), words)
