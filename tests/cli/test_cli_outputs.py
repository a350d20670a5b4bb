"""Where commands write, what they do with an existing or unusable --out, and their progress on stderr."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.commands.plot import paper_reference
from streambp_bench.results import ResultRow, ResultsFile, provenance
from streambp_bench.selfcheck import check
from tests.cli.errors import one_line_error

FIXTURES = Path(__file__).parents[1] / "fixtures"
FIG3_CSV = str(FIXTURES / "sample_results.csv")
TTY = {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": "200"}
"""A terminal for rich, so progress is drawn on stderr as a user would see it."""


COMMANDS = {
    "plot": ["plot", FIG3_CSV],
    "reproduce": ["reproduce", "table6", "--quick"],
    "selfcheck": ["selfcheck", "--skip-verify", "--skip-memory", "--skip-time", "--skip-profile",
                  "--skip-workspace"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_an_out_that_is_a_file_is_refused_before_any_work(tmp_path: Path, command: str) -> None:
    afile = tmp_path / "notes.txt"
    afile.write_text("mine\n")
    result = CliRunner().invoke(app, [*COMMANDS[command], "--out", str(afile)])
    one_line_error(result, "is a file, not a folder")
    assert afile.read_text() == "mine\n" and sorted(tmp_path.iterdir()) == [afile]


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unwritable_out_is_one_line(tmp_path: Path, command: str, monkeypatch) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and Path(path) != folder)
    result = CliRunner().invoke(app, [*COMMANDS[command], "--out", str(folder / "sub")])
    one_line_error(result, "no permission to write in", str(folder))


def test_reproduce_refuses_a_damaged_item_csv_before_running(tmp_path: Path) -> None:
    (tmp_path / "table6.csv").write_bytes(b"\x89PNG\x00\xff")
    result = CliRunner().invoke(app, ["reproduce", "table6", "--quick", "--out", str(tmp_path)])
    one_line_error(result, "table6.csv", "not a text CSV")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table6.csv"]


def test_selfcheck_on_a_cpu_writes_nothing_without_out(tmp_path: Path, monkeypatch) -> None:
    row = ResultRow(method="streambp", model="tiny/qwen3", seq_len_tokens=32, metric="grad_rel_err",
                    value=1e-7, **provenance("measured-cpu", "cpu"))
    monkeypatch.setattr(check, "verify_rows", lambda plan, where: iter([row]))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["selfcheck", "--skip-memory", "--skip-time", "--skip-profile",
                                      "--skip-workspace", "--skip", "families"])
    assert result.exit_code == 0, result.output
    assert list(tmp_path.iterdir()) == []  # no results/gpu/selfcheck-cpu-dry-run.csv
    assert "rows not saved" in result.stdout and "1.000e-07" in result.stdout
    kept = CliRunner().invoke(app, ["selfcheck", "--skip-memory", "--skip-time", "--skip-profile",
                                    "--skip-workspace", "--skip", "families", "--out", "kept"])
    assert kept.exit_code == 0 and len(ResultsFile(tmp_path / "kept/selfcheck-cpu-dry-run.csv").rows()) == 1


def test_plot_out_may_name_the_png_of_one_figure(tmp_path: Path) -> None:
    png = tmp_path / "figs" / "memory.png"
    result = CliRunner().invoke(app, ["plot", FIG3_CSV, "--kind", "memory", "--out", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes().startswith(b"\x89PNG") and sorted(png.parent.iterdir()) == [png]
    both = CliRunner().invoke(app, ["plot", str(FIXTURES / "cpu_measured.csv"), "--out", str(png)])
    one_line_error(both, "pick one with --kind")


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--budget-gib", "nan"], ["--budget-gib", "finite positive"]),
        (["--budget-gib", "-1"], ["--budget-gib", "finite positive"]),
        (["--name", "a/b"], ["--name", "not a path"]),
    ],
)
def test_plot_bad_numbers_and_names_are_one_line(tmp_path: Path, extra: list[str], words: list[str]) -> None:
    result = CliRunner().invoke(app, ["plot", FIG3_CSV, *extra, "--out", str(tmp_path / "o")])
    one_line_error(result, *words)
    assert not (tmp_path / "o").exists()


def test_plot_of_the_papers_cells_draws_the_papers_bars_as_reproduce_does() -> None:
    rows = ResultsFile(FIXTURES / "max_len.csv").load()
    reference = paper_reference(rows)
    assert reference is not None
    ours = reference[(reference["model"] == "Qwen/Qwen3-8B") & (reference["optimizer"] == "none")]
    assert dict(zip(ours["method"], ours["value"], strict=True)) == {
        "plain": 4700, "checkpoint": 20000, "streambp": 110000}
    assert paper_reference(rows.assign(budget_gib=40.0)) is None  # another budget is not the paper's cell
    assert paper_reference(rows.assign(offload="checkpoints")) is None
    assert paper_reference(rows.assign(model="tiny/llama")) is None


def test_verify_prints_both_tolerances_and_progress_on_stderr_only() -> None:
    args = ["verify", "-m", "tiny/llama", "--dtype", "float64", "-T", "16", "--ps", "8", "--ps-head", "8",
            "--method", "streambp"]
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0, table.output
    assert "grad tolerance" in table.stdout and "loss tolerance" in table.stdout
    report = CliRunner().invoke(app, [*args, "--json"], env=TTY)
    assert report.exit_code == 0, report.output
    result = json.loads(report.stdout)["results"][0]  # stdout is the JSON alone
    assert result["tolerance"] == 1e-10 and result["loss_tolerance"] >= 1e-10
    assert f"{result['loss_tolerance']:.2e}" in table.stdout
    for stage in ("plain (reference)", "streambp"):
        assert f"verify tiny/llama: {stage}" in report.stderr


def test_reproduce_shows_what_it_runs_on_stderr(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["reproduce", "fig5", "--quick", "--out", str(tmp_path), "--json"],
                                env=TTY)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["items"] == ["fig5"]
    assert "fig5: streambp tiny/llama T=" in result.stderr and "fig5: done in" in result.stderr
