"""Figures from fixture CSVs (what is drawn, how it is labelled), and the `plot` command via CliRunner."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import typer
from matplotlib.collections import PathCollection
from matplotlib.figure import Figure
from typer.testing import CliRunner

from streambp_bench.commands.plot import plot
from streambp_bench.paper import plots
from streambp_bench.results import ResultsFile

FIXTURES = Path(__file__).parents[1] / "fixtures"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load(name: str) -> pd.DataFrame:
    return ResultsFile(FIXTURES / name).load()


@pytest.fixture(scope="module")
def memory_df() -> pd.DataFrame:
    """Qwen3-8B, simulated, 80 GiB: plain/checkpoint/streambp x 4096..65536 tokens (plain, ckpt OOM late)."""
    return load("sample_results.csv")


def lines_by_label(fig: Figure, panel: int = 0) -> dict[str, object]:
    return {line.get_label(): line for line in fig.axes[panel].get_lines()}


def oom_markers(fig: Figure, panel: int = 0) -> list[tuple[float, float]]:
    points = [c.get_offsets() for c in fig.axes[panel].collections if isinstance(c, PathCollection)]
    return sorted((float(x), float(y)) for offsets in points for x, y in offsets)


# --- figures ------------------------------------------------------------------------------------------


def test_length_axes_say_their_unit(memory_df: pd.DataFrame) -> None:
    fig = plots.memory_vs_length(memory_df)
    assert fig.axes[0].get_xlabel() == "sequence length (k tokens, k = 1000)"
    assert list(lines_by_label(fig)["streambp"].get_xdata())[0] == 4096 / 1000


def test_memory_below_one_gib_is_drawn_in_mib(memory_df: pd.DataFrame) -> None:
    small = memory_df.assign(value=memory_df["value"] / 200, budget_gib=0.5, weights_gib=0.01, grads_gib=0.01)
    fig = plots.memory_vs_length(small)
    lines = lines_by_label(fig)
    assert fig.axes[0].get_ylabel() == "peak memory (MiB)"
    assert list(lines["budget 512 MiB"].get_ydata()) == [512.0, 512.0]
    assert "weights + grads 20.5 MiB" in lines
    assert lines["streambp"].get_ydata()[0] == pytest.approx(memory_df.query("method == 'streambp'")[
        "value"].iloc[0] / 200 * 1024)


def test_memory_figure_has_a_line_per_method_budget_floor_and_oom_marks(
    memory_df: pd.DataFrame, tmp_path: Path
) -> None:
    fig = plots.memory_vs_length(memory_df)
    lines = lines_by_label(fig)
    assert list(lines)[:3] == ["plain", "checkpoint", "streambp"]
    assert len(lines) == 5  # three methods, the budget line, the weights + grads line
    assert list(lines["streambp"].get_xdata()) == [4.096, 16.384, 32.768, 65.536]
    assert list(lines["checkpoint"].get_ydata()) == [37.852, 59.849]  # only the ok points
    assert list(lines["budget 80 GiB"].get_ydata()) == [80.0, 80.0]
    assert list(lines["weights + grads 30.5 GiB"].get_ydata()) == pytest.approx([30.52, 30.52])
    assert oom_markers(fig) == [(16.384, 80.0), (32.768, 80.0)]  # first OOM of plain, of checkpoint
    assert "simulated" in fig.get_suptitle()
    assert fig.axes[0].get_title() == "Qwen/Qwen3-8B"
    path = plots.save(fig, tmp_path / "deep" / "memory.png")
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 20_000


def test_memory_budget_and_floor_can_be_given(memory_df: pd.DataFrame) -> None:
    fig = plots.memory_vs_length(memory_df, budget_gib=40.0, weights_grads_gib=20.0)
    lines = lines_by_label(fig)
    assert "budget 40 GiB" in lines and "weights + grads 20.0 GiB" in lines
    assert {y for _, y in oom_markers(fig)} == {40.0}


def test_error_rows_are_left_out_and_mixed_sources_are_told_apart(memory_df: pd.DataFrame) -> None:
    failed = memory_df.iloc[[0]].assign(status="error", value=float("nan"), method="mst", error="boom")
    assert "mst" not in lines_by_label(plots.memory_vs_length(pd.concat([memory_df, failed])))
    measured = memory_df.assign(source="measured-cuda", device_name="NVIDIA A800-SXM4-80GB")
    fig = plots.memory_vs_length(pd.concat([memory_df, measured]))
    labels = set(lines_by_label(fig))
    assert {
        "streambp measured-cuda NVIDIA A800-SXM4-80GB",
        "streambp simulated simulated A800-SXM4-80GB",
    } <= labels
    assert fig.get_suptitle() == "Peak memory vs sequence length (measured-cuda + simulated)"


def test_rows_of_another_protocol_or_kernel_are_other_lines(memory_df: pd.DataFrame) -> None:
    paper = memory_df.assign(protocol="paper", value=memory_df["value"] + 1.0)
    labels = list(lines_by_label(plots.memory_vs_length(pd.concat([memory_df, paper]))))
    assert labels[:2] == ["plain protocol default", "plain protocol paper"]
    sdpa = memory_df[memory_df["method"] == "streambp"].assign(attn="sdpa")
    labels = set(lines_by_label(plots.memory_vs_length(pd.concat([memory_df, sdpa]))))
    assert {"streambp attn auto", "streambp attn sdpa", "checkpoint attn auto"} <= labels


def test_streambp_rows_of_another_head_are_other_lines_and_bar_groups(memory_df: pd.DataFrame) -> None:
    assert set(memory_df.loc[memory_df["method"] == "streambp", "head_mode"]) == {"recompute"}
    fused = memory_df[memory_df["method"] == "streambp"].assign(head_mode="fused", value=1.0)
    labels = set(lines_by_label(plots.memory_vs_length(pd.concat([memory_df, fused]))))
    assert {"streambp head fused", "streambp head recompute", "checkpoint"} <= labels
    assert set(lines_by_label(plots.memory_vs_length(memory_df))) >= {"streambp", "checkpoint"}
    bars = load("max_len.csv")
    fused = bars[bars["method"] == "streambp"].assign(head_mode="fused")
    ticks = plots.max_length_bars(pd.concat([bars, fused])).axes[0].get_xticklabels()
    assert "Qwen/Qwen3-8B\nfull\nhead fused" in [tick.get_text() for tick in ticks]


def test_time_figure_is_in_seconds_per_partition_size() -> None:
    fig = plots.time_vs_length(load("cpu_measured.csv"))
    lines = lines_by_label(fig)
    assert list(lines) == ["checkpoint", "streambp ps 256", "streambp ps 512", "streambp ps 1024"]
    assert list(lines["checkpoint"].get_ydata()) == pytest.approx([0.41, 0.905, 2.15])
    assert "measured-cpu" in fig.get_suptitle() and fig.axes[0].get_ylabel() == "step time (s)"


def test_partition_ablation_has_memory_and_time_panels() -> None:
    fig = plots.partition_ablation(load("cpu_measured.csv"))
    assert [ax.get_ylabel() for ax in fig.axes] == ["peak memory (GiB)", "step time (s)"]
    for panel in (0, 1):
        assert list(lines_by_label(fig, panel)) == ["streambp ps 256", "streambp ps 512", "streambp ps 1024"]
    assert "measured-cpu" in fig.get_suptitle()


def test_max_length_bars_with_paper_values_hatched(tmp_path: Path) -> None:
    df = load("max_len.csv")
    assert len(plots.max_length_bars(df).axes[0].patches) == 9
    paper = pd.DataFrame(
        {"model": ["Qwen/Qwen3-8B"] * 3 + ["Qwen/Qwen3-32B"], "lora_rank": [None, None, None, 32],
         "method": ["plain", "checkpoint", "streambp", "streambp"], "value": [4700, 20000, 110000, 16000]}
    )  # fmt: skip
    fig = plots.max_length_bars(df, paper=paper)
    ax = fig.axes[0]
    hatched = [bar for bar in ax.patches if bar.get_hatch()]
    assert len(ax.patches) == 13 and len(hatched) == 4
    assert sorted(bar.get_height() for bar in hatched) == [4.7, 16.0, 20.0, 110.0]
    assert [tick.get_text() for tick in ax.get_xticklabels()] == [
        "Qwen/Qwen3-8B\nfull", "Qwen/Qwen3-14B\nfull", "Qwen/Qwen3-32B\nLoRA r32"
    ]  # fmt: skip
    assert "simulated" in fig.get_suptitle() and "paper" in fig.get_suptitle()
    assert plots.save(fig, tmp_path / "bars.png").stat().st_size > 20_000


def test_available_kinds_follow_the_metric_column(memory_df: pd.DataFrame) -> None:
    assert plots.available_kinds(memory_df) == ["memory"]
    assert plots.available_kinds(load("cpu_measured.csv")) == ["memory", "time", "ablation"]
    assert plots.available_kinds(load("max_len.csv")) == ["maxlen"]
    with pytest.raises(ValueError, match="no rows with metric step_time"):
        plots.time_vs_length(memory_df)


# --- the command --------------------------------------------------------------------------------------

app = typer.Typer()
app.command("plot")(plot)
runner = CliRunner()


def test_plot_command_writes_every_figure_the_data_supports(tmp_path: Path) -> None:
    csvs = [str(FIXTURES / name) for name in ("sample_results.csv", "cpu_measured.csv", "max_len.csv")]
    result = runner.invoke(app, [*csvs, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    names = ["combined-memory.png", "combined-time.png", "combined-ablation.png", "combined-maxlen.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    assert "wrote 4 figures" in result.stdout and all(name in result.stdout for name in names)


def test_plot_command_one_kind_named_after_the_csv_in_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results, work = tmp_path / "results", tmp_path / "work"
    results.mkdir(), work.mkdir()
    csv = results / "fig3.csv"
    csv.write_bytes((FIXTURES / "sample_results.csv").read_bytes())
    monkeypatch.chdir(work)
    result = runner.invoke(app, [str(csv), "--kind", "memory", "--budget-gib", "60"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in work.iterdir()) == ["fig3-memory.png"]
    assert sorted(p.name for p in results.iterdir()) == ["fig3.csv"]  # nothing written next to the CSV


def _header_only(path: Path) -> Path:
    path.write_text((FIXTURES / "sample_results.csv").read_text().splitlines()[0] + "\n")
    return path


@pytest.mark.parametrize(
    ("make_input", "extra", "message"),
    [
        (lambda d: d / "missing.csv", [], "no such results file"),
        (lambda d: d, [], "is a directory, not a CSV file"),
        (lambda d: (d / "b.csv", (d / "b.csv").write_bytes(b"\x89PNG\x00\xff"))[0], [], "not a text CSV"),
        (lambda d: (d / "zero.csv", (d / "zero.csv").write_text(""))[0], [], "empty: no CSV header"),
        (lambda d: _header_only(d / "head.csv"), [], "has a header but no rows"),
        (lambda d: (d / "o.csv", (d / "o.csv").write_text("a,b\n1,2\n"))[0], [], "missing columns: method"),
        (lambda d: FIXTURES / "max_len.csv", ["--kind", "time"], "no data for --kind time"),
        (lambda d: FIXTURES / "sample_results.csv", ["--kind", "ablation"], "several partition sizes"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, make_input, extra: list[str], message: str) -> None:
    result = runner.invoke(app, [str(make_input(tmp_path)), *extra, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()
