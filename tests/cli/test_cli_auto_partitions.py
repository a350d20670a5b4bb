"""`--ps auto --ps-head auto` and `--gpu-model` on sweep and max-len, through the real app."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.maxlen import auto
from streambp_bench.results import ResultsFile
from streambp_core.step.estimate.roofline import gpu_model

STEP = ["-m", "tiny/qwen3", "--method", "streambp", "--dtype", "float32", "--budget-gib", "0.00466",
        "--ps", "auto", "--ps-head", "auto", "--gpu-model", "h100", "--device", "sim"]
"""At 1024 tokens in 5,003,706 bytes the largest partitions that fit are (171, 256)."""
REGIMES = {f"{part}-bound" for part in ("GEMM", "attention", "memory", "PCIe", "interconnect", "host")}


@pytest.mark.slow
def test_sweep_records_the_partitions_chosen_and_an_estimated_step_time(tmp_path: Path) -> None:
    out = tmp_path / "sweep.csv"
    result = CliRunner().invoke(app, ["sweep", *STEP, "--seq-len", "1024", "--out", str(out)])
    assert result.exit_code == 0, result.output
    peak, estimate = sorted(ResultsFile(out).rows(), key=lambda row: row.source == "estimated")
    assert (peak.partition_size, peak.head_partition_size, peak.status) == (171, 256, "ok")
    assert (estimate.source, estimate.metric, estimate.device_name) == (
        "estimated", "step_time", "NVIDIA H100 SXM5 80GB")
    assert (estimate.partition_size, estimate.head_partition_size) == (171, 256) and estimate.value > 0
    again = CliRunner().invoke(app, ["sweep", *STEP, "--seq-len", "1024", "--out", str(out), "--json"])
    assert json.loads(again.stdout)["skipped"] == 1


@pytest.mark.slow
def test_max_len_reports_the_partitions_that_reach_a_length_and_its_step_time(tmp_path: Path) -> None:
    out = tmp_path / "max_len.csv"
    result = CliRunner().invoke(app, ["max-len", *STEP, "--at", "1024", "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    settings = document["settings"]  # auto says so, beside the size the search ran it at
    assert (settings["partition_size"], settings["head_partition_size"]) == ("auto", "auto")
    assert settings["searched_partitions"] == [64, 64]
    at_max, at_1024 = document["steps"]
    estimated_ms = at_1024.pop("estimated_step_time_ms")
    band_ms, regime = at_1024.pop("estimated_step_time_band_ms"), at_1024.pop("estimated_regime")
    assert at_1024 == {"method": "streambp", "label": "streambp", "seq_len_tokens": 1024, "fits": True,
                       "partition_size": 171, "head_partition_size": 256}
    assert estimated_ms > 0 and band_ms == pytest.approx([estimated_ms / 1.25, estimated_ms / 0.75])
    assert regime in REGIMES
    assert at_max["seq_len_tokens"] == document["results"][0]["max_len_tokens"] > 1024
    rows = {row.metric: row for row in ResultsFile(out).rows() if row.seq_len_tokens in (0, 1024)}
    assert (rows["max_len"].partition_size, rows["max_len"].head_partition_size) == (
        at_max["partition_size"], at_max["head_partition_size"])


def test_auto_partitions_without_a_budget_are_refused_in_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["sweep", "-m", "tiny/qwen3", "--ps", "auto", "--device", "cpu",
                                      "--seq-len", "64", "--out", str(tmp_path / "r.csv")])
    assert result.exit_code == 2 and "need a budget" in result.output


@pytest.mark.slow
def test_the_step_line_names_the_partitions_of_the_rows_not_the_search_s() -> None:
    """Under --ps auto the search runs at 64 tokens; the table's rows carry the partitions that fit at
    each maximum, and the provenance line says those, per method where they differ."""
    step = [arg for arg in STEP if arg not in ("--gpu-model", "h100")]
    both = ["max-len", *step[:2], "--method", "mst,streambp", *step[4:]]
    result = CliRunner().invoke(app, [*both, "--json"])
    assert result.exit_code == 0, result.output
    steps = json.loads(result.stdout)["steps"]
    sizes = {step["method"]: (step["partition_size"], step["head_partition_size"]) for step in steps}
    assert sorted(sizes) == ["mst", "streambp"]
    table = CliRunner().invoke(app, both)
    line = next(text for text in table.stdout.splitlines() if text.startswith("Step:"))
    assert "ps 64 " not in line
    for method, (layer, head) in sizes.items():
        assert f"{method} ps {layer} ps-head {head}" in line


@pytest.mark.slow
def test_max_len_with_offload_shows_the_copies_pcie_time_at_the_gpus_bandwidth() -> None:
    """--gpu-model with offload: bytes each way, their time at 64 GB/s one way (H100) and the part
    compute does not hide, in the JSON and the table."""
    args = ["max-len", *STEP, "--offload", "checkpoints", "--at", "1024"]
    document = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    pcie = document["steps"][1]["estimated_pcie"]
    assert pcie["pcie_gb_per_s"] == 64 and pcie["to_host_bytes"] > 0 and pcie["to_device_bytes"] > 0
    assert pcie["copy_ms"] == pytest.approx(1e3 * (pcie["to_host_bytes"] + pcie["to_device_bytes"]) / 64e9)
    assert 0 <= pcie["not_hidden_ms"] <= pcie["copy_ms"]
    steps = [auto.StepAt(method="streambp", seq_len_tokens=1024, spec=None, pcie=pcie)]
    table = auto.render_table(steps, auto.Extras(gpu=gpu_model("h100")))
    assert "PCIe at 64 GB/s one way" in table.title
    assert [column.header for column in table.columns][-3:] == [
        "GiB to host / to device", "PCIe s", "not hidden s"]


def test_the_max_len_table_gives_each_estimated_step_its_band_and_regime() -> None:
    """With --gpu-model every estimated step time is labelled estimated and shown with its band (the
    estimate / 1.25 to / 0.75, `StepEstimate.band_s`) and regime; a step that does not fit shows none."""
    fits = auto.StepAt(method="streambp", seq_len_tokens=1024, spec=None, estimated_ms=2_000.0,
                       band_ms=(1_600.0, 2_666.7), regime="attention-bound")
    misses = auto.StepAt(method="checkpoint", seq_len_tokens=1024, spec=None)
    table = auto.render_table([fits, misses], auto.Extras(gpu=gpu_model("h100")))
    assert "step time estimated for NVIDIA H100 SXM5 80GB" in table.title
    headers = [column.header for column in table.columns]
    cells = {header: list(column.cells) for header, column in zip(headers, table.columns, strict=True)}
    assert cells["est. step s"] == ["2.00", "-"]
    assert cells["band s"] == ["1.60-2.67", "-"] and cells["regime"] == ["attention-bound", "-"]
