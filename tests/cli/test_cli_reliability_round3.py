"""Round three of the hostile cases: variants of the classes fixed before, found on the code that fixed
them (each failed before its fix)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app


@pytest.mark.parametrize("spelling", ["results", "./results/", "link"])
def test_reproduce_quick_never_writes_into_results_however_spelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    """`--quick` without --out was refused; the same folder named explicitly (or through a link) was not."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "results")
    result = CliRunner().invoke(app, ["reproduce", "fig5", "--quick", "--out", spelling])
    assert result.exit_code == 2, result.output
    assert "is results/" in result.output and list((tmp_path / "results").iterdir()) == []
