"""The answer README.md shows for `streambp-bench max-len` with its defaults is what the command answers:
each method's max length and bracket, from the README's own table (slow: four searches of Qwen3-8B)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app

README = Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^│ (\w+) +│ +([\d,]+) │ +([\d,]+), ([\d,]+) │")


def _readme_rows() -> dict[str, tuple[int, int, int]]:
    """method -> (max length, fits, fails) of the first table after the Quick start's default command."""
    text = README.read_text(encoding="utf-8")
    block = text[text.index("`streambp-bench max-len` with its defaults"):]
    rows = {}
    for line in block.splitlines():
        if (found := ROW.match(line)) and found.group(1) not in rows:
            rows[found.group(1)] = tuple(int(group.replace(",", "")) for group in found.groups()[1:])
        if line.startswith("└") and rows:
            break
    return rows


@pytest.mark.slow
def test_the_readme_answer_is_the_commands() -> None:
    claimed = _readme_rows()
    assert sorted(claimed) == ["checkpoint", "mst", "plain", "streambp"]
    result = CliRunner().invoke(app, ["max-len", "--json"])
    assert result.exit_code == 0, result.output
    answers = {row["method"]: (row["max_len_tokens"], *row["bracket_tokens"])
               for row in json.loads(result.stdout)["results"]}
    assert answers == claimed
