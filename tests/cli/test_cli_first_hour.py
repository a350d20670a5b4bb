"""A newcomer's first hour: inputs that hung, ate memory, were silently ignored or printed a traceback."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from streambp_bench.cli import app
from tests.cli.errors import one_line_error

TINY_SIM = ["-m", "tiny/qwen3", "--method", "streambp", "--dtype", "float32", "--device", "sim"]


def test_a_huge_packing_count_is_refused_at_once_in_max_len_and_sweep() -> None:
    result = CliRunner().invoke(app, ["max-len", *TINY_SIM, "--budget-gib", "0.02", "--packing", "1000000000"])
    one_line_error(result, "--packing", "1,000,000,000 documents", "100,000,000 tokens")
    result = CliRunner().invoke(app, ["sweep", *TINY_SIM, "--seq-len", "1k", "--packing", "2k"])
    one_line_error(result, "--packing", "2,000 documents", "1,000 tokens")


def test_packing_takes_k_suffixes() -> None:
    result = CliRunner().invoke(app, ["max-len", *TINY_SIM, "--budget-gib", "0.02", "--packing", "0.01k",
                                      "--json"])
    assert result.exit_code == 0, result.output
    (note,) = json.loads(result.stdout)["packing"]
    assert len(note["documents"][0]) == 10
