"""`streambp-bench sweep` through the real app: rows, resume after an interruption, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import streambp_core.methods
from streambp_bench.cli import app
from streambp_bench.results import ResultsFile
from streambp_bench.sweep import grid
from streambp_core.step.run import tracked as run_module

TINY = ["-m", "tiny/llama", "--seq-len", "64,128", "--ps", "16,32", "--ps-head", "16", "--device", "sim"]


def _sweep(out: Path, *extra: str):
    return CliRunner().invoke(
        app, ["sweep", *TINY, "--method", "checkpoint,streambp", "--out", str(out), *extra]
    )


def test_sweep_writes_one_row_per_point(tmp_path: Path) -> None:
    out = tmp_path / "sweep.csv"
    result = _sweep(out)
    assert result.exit_code == 0, result.output
    rows = ResultsFile(out).rows()
    assert len(rows) == 2 + 4  # checkpoint: one per length; streambp: lengths x partition sizes
    assert {(r.method, r.seq_len_tokens, r.partition_size) for r in rows} >= {
        ("streambp", 128, 32),
        ("checkpoint", 64, None),
    }
    assert all(r.source == "simulated" and r.status == "ok" and r.metric == "peak_memory" for r in rows)


def test_rerun_skips_done_points_and_force_replaces_them(tmp_path: Path, stub_simulation) -> None:
    out = tmp_path / "sweep.csv"
    _sweep(out)
    stamps = {row.key(): row.timestamp for row in ResultsFile(out).rows()}
    again = _sweep(out)
    assert "6 already done" in again.output and len(stub_simulation.specs) == 6
    forced = _sweep(out, "--force")
    assert forced.exit_code == 0 and "6 points run" in forced.output and len(stub_simulation.specs) == 12
    assert {row.key() for row in ResultsFile(out).rows()} == set(stamps)


def test_interrupted_sweep_resumes_without_lost_or_duplicated_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stub_simulation
) -> None:
    out = tmp_path / "sweep.csv"
    real = grid.run_point
    calls: list = []

    def interrupted_after_three(point, target, config=None):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(point)
        return real(point, target, config)

    monkeypatch.setattr(grid, "run_point", interrupted_after_three)
    first = _sweep(out)
    assert first.exit_code == 130 and "interrupted" in first.output
    assert len(ResultsFile(out).rows()) == 3
    monkeypatch.setattr(grid, "run_point", real)
    second = _sweep(out)
    assert second.exit_code == 0 and "3 points run, 3 already done" in second.output
    keys = [row.key() for row in ResultsFile(out).rows()]
    assert len(keys) == len(set(keys)) == 6


def test_attn_is_recorded_and_a_resume_with_another_kernel_runs_its_own_points(tmp_path: Path) -> None:
    out = tmp_path / "sweep.csv"
    assert _sweep(out).exit_code == 0
    flash = _sweep(out, "--attn", "flash")
    assert flash.exit_code == 0 and "6 points run, 0 already done" in flash.output
    again = _sweep(out, "--attn", "flash")
    assert "0 points run, 6 already done" in again.output
    rows = ResultsFile(out).rows()
    assert len(rows) == 12 and sorted(r.attn for r in rows) == ["auto"] * 6 + ["flash"] * 6
    assert {(r.protocol, r.grads) for r in rows} == {("default", "resident")}
    values = {kernel: sorted(r.value for r in rows if r.attn == kernel) for kernel in ("auto", "flash")}
    assert values["auto"] == values["flash"]  # the simulator's fake kernel is the same for both


def test_attn_reaches_the_measured_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_prepare = streambp_core.methods.prepare
    kernels: list[str] = []

    def recording_prepare(model, method, config=None, **options):
        if next(model.parameters()).device.type != "meta":  # not the RAM check's simulated step
            kernels.append(options.get("attn", getattr(config, "attn", None)))
        return real_prepare(model, method, config, **options)

    monkeypatch.setattr(run_module, "prepare", recording_prepare)  # the tracked step
    monkeypatch.setattr(streambp_core.methods, "prepare", recording_prepare)  # the timed steps
    out = tmp_path / "cpu.csv"
    args = ["sweep", "-m", "tiny/llama", "--device", "cpu", "--dtype", "float32", "--seq-len", "64", "--ps",
            "32", "--ps-head", "16", "--method", "streambp", "--attn", "sdpa", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert len(kernels) == 2 and set(kernels) == {"sdpa"}  # the tracked step and the timed steps
    rows = ResultsFile(out).rows()
    assert [(r.metric, r.attn, r.alloc_retries) for r in rows] == [
        ("peak_memory", "sdpa", None),  # no CUDA allocator on a CPU
        ("step_time", "sdpa", None),
    ]


def test_help_names_attn_with_an_example() -> None:
    result = CliRunner().invoke(app, ["sweep", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.output.replace("│", " ").split())  # the option panel wraps its help
    assert "--attn <auto|sdpa|flash>" in text and "flash-like fake kernel" in text and "--attn sdpa" in text


def test_csv_of_another_schema_is_a_one_line_error(tmp_path: Path) -> None:
    out = tmp_path / "other.csv"
    out.write_text("a,b\n1,2\n")
    result = _sweep(out)
    assert result.exit_code == 2
    assert "not a streambp-bench results CSV" in result.output and "Traceback" not in result.output
    assert out.read_text() == "a,b\n1,2\n"


def test_sweep_gpus_and_shard_write_one_ranks_rows(tmp_path):
    out = tmp_path / "z.csv"
    base = ["sweep", "-m", "tiny/llama", "--method", "checkpoint", "--seq-len", "64", "--optimizer", "adamw",
            "--out", str(out)]
    assert CliRunner().invoke(app, base).exit_code == 0
    result = CliRunner().invoke(app, [*base, "--gpus", "4", "--shard", "zero3"])
    assert result.exit_code == 0, result.output
    rows = {(r.gpus, r.shard): r for r in ResultsFile(out).rows()}
    assert set(rows) == {(1, "none"), (4, "zero3")}
    assert rows[4, "zero3"].optimizer_gib < rows[1, "none"].optimizer_gib
    bad = CliRunner().invoke(app, [*base, "--gpus", "4", "--shard", "zero3", "--device", "cpu"])
    assert bad.exit_code == 2 and "does not apply to --device cpu" in bad.output
