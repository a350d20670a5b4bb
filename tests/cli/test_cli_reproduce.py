"""`streambp-bench reproduce` through the real app, on tiny settings (--quick)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.results import ResultsFile


def test_reproduce_fig5_quick_writes_csv_png_and_readme(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["reproduce", "fig5", "--quick", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = ResultsFile(tmp_path / "fig5.csv").rows()
    assert {row.partition_size for row in rows} == {16, 32} and all(r.source == "simulated" for r in rows)
    assert (tmp_path / "fig5-memory.png").stat().st_size > 10_000
    readme = (tmp_path / "README.md").read_text()
    assert "## Fig. 5" in readme and "ps 16" in readme and "(simulated)" in readme
    assert "## Table 4" not in readme  # no table4.csv here


@pytest.mark.slow
def test_reproduce_fig3_quick_puts_max_len_next_to_slopes(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["reproduce", "fig3", "--quick", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = ResultsFile(tmp_path / "fig3.csv").rows()
    max_len = {row.method: row.value for row in rows if row.metric == "max_len"}
    assert set(max_len) == {"plain", "checkpoint", "streambp"}
    assert max_len["streambp"] > max_len["checkpoint"] > 0
    readme = (tmp_path / "README.md").read_text()
    assert "## Fig. 3" in readme and "| tiny/llama | streambp |" in readme
    assert (tmp_path / "fig3-memory.png").exists() and (tmp_path / "fig3-maxlen.png").exists()


@pytest.mark.slow
def test_reproduce_table4_quick_writes_each_engine_and_the_zero3_rows(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["reproduce", "table4", "--quick", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = {(r.method, r.shard, r.gpus, r.offload): r for r in ResultsFile(tmp_path / "table4.csv").rows()}
    engines = ("deepspeed-zero2", "zero2", "zero3", "deepspeed-zero3")
    for method in ("checkpoint", "streambp"):
        assert {(method, shard, 2, "none") for shard in engines} <= set(rows)
        assert rows[method, "zero3", 2, "checkpoints"].source == "simulated"
        assert rows[method, "zero2", 2, "none"].value > 0
        for shard in ("deepspeed-zero2", "deepspeed-zero3"):  # DeepSpeed's 5e8-element bucket alone is 1 GB:
            assert rows[method, shard, 2, "none"].value == 0  # over the quick 5 MiB budget at any length
    assert rows["streambp", "zero3", 2, "none"].value > rows["checkpoint", "zero3", 2, "none"].value
    readme = (tmp_path / "README.md").read_text()
    assert "## Table 4" in readme and "| tiny/llama |" in readme
    assert (tmp_path / "table4-maxlen.png").exists()


def test_reproduce_into_a_foreign_csv_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "fig5.csv").write_text("a,b\n1,2\n")
    result = CliRunner().invoke(app, ["reproduce", "fig5", "--quick", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "not a streambp-bench results CSV" in result.output


def test_unknown_item_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["reproduce", "fig9", "--out", str(tmp_path)])
    assert result.exit_code == 2


@pytest.mark.parametrize("spelling", ["results", "./results/", "link"])
def test_reproduce_quick_never_writes_into_results_however_spelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    """`--quick` refuses results/ however --out names it: by name, with a trailing slash, through a link."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "results")
    result = CliRunner().invoke(app, ["reproduce", "fig5", "--quick", "--out", spelling])
    assert result.exit_code == 2, result.output
    assert "--quick" in result.output and "results/" in result.output
    assert list((tmp_path / "results").iterdir()) == []
