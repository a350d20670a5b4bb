"""Results that cannot lie on resume: a simulated point is re-decided under another budget, and an ok row
without a value (NaN) is re-run, not kept."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.results import ResultsFile
from tests.cli.errors import one_line_error

SWEEP = ["sweep", "-m", "tiny/llama", "--method", "checkpoint", "--seq-len", "256", "--device", "sim",
         "--json"]


def _sweep(out: Path, budget: str) -> dict:
    result = CliRunner().invoke(app, [*SWEEP, "--budget-gib", budget, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_point_is_not_resumed_across_budgets(tmp_path: Path) -> None:
    out = tmp_path / "s.csv"
    assert _sweep(out, "1")["ran"] == 1
    assert _sweep(out, "1")["skipped"] == 1  # same budget: resumed
    assert _sweep(out, "0.0001")["ran"] == 1  # another budget decides ok/oom again
    (row,) = ResultsFile(out).rows()
    assert row.status == "oom" and row.budget_gib == 0.0001


def test_an_ok_row_without_a_value_is_run_again(tmp_path: Path) -> None:
    out = tmp_path / "s.csv"
    _sweep(out, "1")
    with out.open(newline="") as handle:
        records = list(csv.DictReader(handle))
    records[0]["value"] = "nan"
    with out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    assert _sweep(out, "1")["ran"] == 1
    (row,) = ResultsFile(out).rows()
    assert row.status == "ok" and row.value is not None and row.value > 0


def test_plot_says_which_ok_rows_it_could_not_draw(tmp_path: Path) -> None:
    source = Path(__file__).parents[1] / "fixtures" / "sample_results.csv"
    with source.open(newline="") as handle:
        records = list(csv.DictReader(handle))
    records[0]["value"], records[1]["value"] = "inf", "nan"
    data = tmp_path / "r.csv"
    with data.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    result = CliRunner().invoke(app, ["plot", str(data), "--kind", "memory", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "not drawn: 2 ok rows without a finite value" in result.stdout and "value inf" in result.stdout


def test_reproduce_quick_never_writes_into_results_by_default(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["reproduce", "fig5", "--quick"])
    one_line_error(result, "--quick", "--out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_sharded_verify_judges_by_the_single_process_criterion() -> None:
    """At 2 tokens a query sees one key, so some gradients are zero up to rounding: pure relative error
    would call that a failure, the documented criterion does not."""
    args = ["verify", "fsdp", "-m", "tiny/qwen3", "-T", "2", "--dtype", "float64", "--nproc", "2", "--shard",
            "zero2", "--method", "streambp", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["results"]
    assert row["ok"] and row["max_rel_err"] < 1e-10


def test_a_read_only_out_file_is_refused_before_any_work(tmp_path: Path, monkeypatch) -> None:
    import os

    out = tmp_path / "s.csv"
    _sweep(out, "1")
    out.chmod(0o444)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == out and mode & os.W_OK
                        else real_access(p, mode))
    result = CliRunner().invoke(app, [*SWEEP, "--budget-gib", "2", "--out", str(out)])
    one_line_error(result, "read-only", str(out))
    assert "sweep (" not in result.stderr  # no progress: refused before the first point
