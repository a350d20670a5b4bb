"""`streambp-bench reproduce alst --quick`: the ladder's rows (one GPU, then a sequence-parallel pair),
its figure and its README section, on a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.paper.shared import frame_of


@pytest.mark.slow
def test_reproduce_alst_quick_writes_rows_figure_and_section(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["reproduce", "alst", "--quick", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    frame = frame_of(tmp_path / "alst.csv")
    lengths = frame[frame["metric"] == "max_len"]
    cells = sorted(zip(lengths["method"], lengths["gpus"], lengths["sp"], lengths["offload"], strict=True))
    assert cells == [("mst", 1, 1, "checkpoints,optimizer,params"), ("mst", 2, 2, "checkpoints,optimizer"),
                     ("streambp", 1, 1, "checkpoints,optimizer,params"),
                     ("streambp", 2, 2, "checkpoints,optimizer")]
    assert (lengths["value"] > 0).all() and (lengths["host_peak_gib"] > 0).all()
    assert (tmp_path / "alst-maxlen.png").stat().st_size > 0
    readme = (tmp_path / "README.md").read_text()
    assert "## ALST's ladder" in readme and "| 2 | tiny | streambp + offload |" in readme
