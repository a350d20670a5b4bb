"""`--offload` on max-len, sweep and verify, and `max-len --host-budget-gib`, on tiny presets."""

from __future__ import annotations

import json

import pytest

from streambp_bench.cli import app
from streambp_bench.results import ResultsFile
from tests.cli.errors import one_line_error

TINY = ["--model", "tiny/qwen3", "--ps", "32", "--ps-head", "16"]
MAX_LEN = ["max-len", *TINY, "--budget-gib", "0.003", "--device", "sim"]



@pytest.mark.slow
def test_max_len_offload_both_searches_each_method_with_and_without(runner):
    result = runner.invoke(app, [*MAX_LEN, "--method", "plain,checkpoint,streambp", "--offload", "both",
                                 "--json"])
    assert result.exit_code == 0, result.output
    entries = {r["label"]: r for r in json.loads(result.stdout)["results"]}
    assert list(entries) == ["plain", "checkpoint", "checkpoint + offload", "streambp", "streambp + offload"]
    for method in ("checkpoint", "streambp"):
        kept, moved = entries[method], entries[f"{method} + offload"]
        assert (kept["offload"], moved["offload"]) == ("none", "checkpoints")
        assert kept["host_peak_gib"] == kept["to_host_gib"] == 0
        assert moved["host_peak_gib"] > 0 and moved["to_host_gib"] == moved["to_device_gib"] > 0
        assert moved["max_len_tokens"] >= kept["max_len_tokens"] and moved["peak_gib"] <= 0.003
        assert moved["host_breakdown_gib"] == {"offloaded": moved["host_peak_gib"]}
        assert "offloaded" not in moved["breakdown_gib"]  # the device breakdown holds device bytes only
    offloaded_checkpoint = entries["checkpoint + offload"]["max_len_tokens"]
    streambp = entries["streambp + offload"]
    assert streambp["ratio_to_checkpoint"] == pytest.approx(streambp["max_len_tokens"] / offloaded_checkpoint)


def test_max_len_table_labels_offloaded_rows_and_shows_the_host_pool(runner, stub_probe):
    result = runner.invoke(app, [*MAX_LEN, "--method", "mst", "--offload", "checkpoints"])
    assert result.exit_code == 0, result.output
    for text in ("mst + offload", "host GiB", "copied GiB to host / to device", "ALST",
                 "reported, not bounded", "offloaded (host)"):
        assert text in result.stdout
    (row,) = [line for line in result.stdout.splitlines() if "mst + offload" in line and "simulated" in line]
    assert " / " in row  # the bytes each way: the params and optimizer tiers copy more one way than back
    assert "host GiB" not in runner.invoke(app, [*MAX_LEN, "--method", "plain"]).stdout


def test_host_budget_bounds_the_search_by_the_host_pool(runner, stub_probe):
    args = [*MAX_LEN, "--method", "streambp", "--offload", "checkpoints", "--json"]
    free = json.loads(runner.invoke(app, args).stdout)["results"][0]
    host_budget = free["host_peak_gib"] / 2
    result = runner.invoke(app, [*args, "--host-budget-gib", repr(host_budget)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    bounded = doc["results"][0]
    assert doc["host_budget_gib"] == pytest.approx(host_budget)
    assert bounded["host_peak_gib"] <= host_budget < free["host_peak_gib"]
    assert 0 < bounded["max_len_tokens"] < free["max_len_tokens"]
    assert bounded["probes"] <= 16  # the secant follows the fuller pool
    assert all(spec.offload.checkpoints for spec in stub_probe.specs)


def test_host_budget_below_the_shortest_probe_is_one_line(runner):
    line = one_line_error(runner.invoke(app, [*MAX_LEN, "--offload", "both", "--host-budget-gib", "1e-9"]))
    assert "host budget" in line and "no sequence length fits" in line and "checkpoint + offload" in line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--method", "plain", "--offload", "checkpoints"], "does not apply to plain"),
        (["--offload", "disk"], "--offload"),
        (["--host-budget-gib", "-3"], "--host-budget-gib must be a finite positive number"),
    ],
)
def test_bad_offload_input_is_one_line(runner, args, expected):
    assert expected in one_line_error(runner.invoke(app, [*MAX_LEN, *args]))


def test_sweep_offload_both_writes_host_columns_and_skips_plain_offload(runner, tmp_path):
    path = tmp_path / "sweep.csv"
    args = ["sweep", *TINY, "--method", "plain,streambp", "--seq-len", "64", "--offload", "both",
            "--device", "sim", "--out", str(path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = {(r.method, r.offload): r for r in ResultsFile(path).rows()}
    assert sorted(rows) == [("plain", "none"), ("streambp", "checkpoints"), ("streambp", "none")]
    moved, kept = rows["streambp", "checkpoints"], rows["streambp", "none"]
    assert moved.host_peak_gib > 0 and moved.to_host_gib == moved.to_device_gib > 0
    assert kept.host_peak_gib == 0 and moved.peak_allocated_gib < kept.peak_allocated_gib
    refused = runner.invoke(app, [*args[:-4], "--offload", "checkpoints", "--out", str(path)])
    assert "does not apply to plain" in one_line_error(refused)


def test_verify_offload_runs_the_offloaded_step_and_matches_plain_bitwise(runner):
    args = ["verify", "-m", "tiny/llama", "--dtype", "float64", "--seq-len", "40", "--ps", "16",
            "--ps-head", "8", "--offload", "checkpoints", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["spec"]["offload"] == "checkpoints" and doc["ok"]
    assert [r["method"] for r in doc["results"]] == ["checkpoint", "mst", "streambp"]
    assert all(r["max_rel_err"] <= 1e-12 for r in doc["results"])
    refused = runner.invoke(app, [*args[:-1], "--method", "plain"])
    assert "does not apply to plain" in one_line_error(refused)


@pytest.mark.slow
def test_reproduce_offload_quick_writes_every_method_with_and_without(runner, tmp_path):
    result = runner.invoke(app, ["reproduce", "offload", "--quick", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = ResultsFile(tmp_path / "offload.csv").rows()
    lengths = {(r.method, r.offload): r.value for r in rows if r.metric == "max_len"}
    assert len(lengths) == 7 and ("plain", "checkpoints") not in lengths
    assert max(lengths, key=lengths.get) == ("streambp", "checkpoints")
    curve = [r for r in rows if r.metric == "peak_memory" and r.offload == "checkpoints" and r.status == "ok"]
    assert curve and all(r.host_peak_gib > 0 for r in curve)
    readme = (tmp_path / "README.md").read_text()
    assert "## Host-memory tier" in readme and "| tiny/llama | streambp + offload |" in readme
    assert "ALST" in readme and "| 1.000 |" in readme
    assert (tmp_path / "offload-memory.png").stat().st_size > 10_000


def test_every_offload_answer_says_whether_its_host_memory_was_bounded(runner, tmp_path, stub_probe):
    """Without --host-budget-gib the host pool is unbounded, and each answer says so beside its host GiB
    (table header, JSON `host_bound`, the CSV row's empty host_budget_gib), not only in a footnote; with
    it, the bound is named."""
    args = [*MAX_LEN, "--method", "streambp", "--offload", "checkpoints"]
    unbounded = runner.invoke(app, [*args, "--json", "--out", str(tmp_path / "free.csv")])
    assert unbounded.exit_code == 0, unbounded.output
    entry = json.loads(unbounded.stdout)["results"][0]
    assert entry["host_bound"] == "unbounded" and entry["host_peak_gib"] > 0
    table = runner.invoke(app, args, terminal_width=250)
    assert "host GiB (unbounded)" in table.stdout
    one_csv = str(tmp_path / "1.csv")
    bounded = runner.invoke(app, [*args, "--host-budget-gib", "1", "--json", "--out", one_csv])
    assert json.loads(bounded.stdout)["results"][0]["host_bound"] == "<= 1 GiB per rank"
    (free,), (one,) = ResultsFile(tmp_path / "free.csv").rows(), ResultsFile(tmp_path / "1.csv").rows()
    assert free.host_budget_gib is None and free.host_peak_gib > 0
    assert one.host_budget_gib == pytest.approx(1) and one.host_peak_gib == free.host_peak_gib
