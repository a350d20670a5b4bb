"""`streambp-bench presets`: every preset with its sizes, as JSON and as a table with the full names, whole
when printed to a pipe or file (not cut to 80 columns). The rows are built once per run
(`presets_built_once`): building every preset on meta is the slow part, and one run checks it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_core.models import list_presets


def test_presets_json_lists_every_preset_with_sizes(presets_built_once):
    result = CliRunner().invoke(app, ["presets", "--json"])
    assert result.exit_code == 0
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert set(rows) == set(list_presets())
    assert rows["Qwen/Qwen3-8B"]["layers"] == 36
    assert rows["Qwen/Qwen3-8B"]["params"] == pytest.approx(8.19e9, rel=0.01)


def test_presets_table_shows_full_names(presets_built_once):
    result = CliRunner().invoke(app, ["presets"])
    assert result.exit_code == 0
    assert "mistralai/Mistral-7B-v0.3" in result.output


def test_presets_table_is_not_cut_when_not_a_terminal(presets_built_once):
    result = CliRunner().invoke(app, ["presets"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    assert "…" not in result.output
    header = next(line for line in result.output.splitlines() if "name" in line)
    assert all(column in header for column in ("family", "layers", "hidden", "heads/kv", "vocab", "params"))
    assert "151936" in result.output and "mistral " in result.output
