"""`presets` printed to a pipe or file is the whole table, not one cut to 80 columns."""

from __future__ import annotations

from typer.testing import CliRunner

from streambp_bench.cli import app


def test_presets_table_is_not_cut_when_not_a_terminal():
    result = CliRunner().invoke(app, ["presets"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    assert "…" not in result.output
    header = next(line for line in result.output.splitlines() if "name" in line)
    assert all(column in header for column in ("family", "layers", "hidden", "heads/kv", "vocab", "params"))
    assert "151936" in result.output and "mistral " in result.output
