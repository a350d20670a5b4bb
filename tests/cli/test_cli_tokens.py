"""Every length option reads k as 1000 tokens and ki as 1024, on every command (`streambp_bench.tokens`)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.results import ResultsFile

TINY_SIM = ["-m", "tiny/qwen3", "--method", "streambp", "--dtype", "float32", "--device", "sim"]


def test_sweep_reads_2k_as_2000_in_every_length_option(tmp_path: Path, stub_simulation) -> None:
    out = tmp_path / "sweep.csv"
    args = ["sweep", *TINY_SIM, "--seq-len", "4k", "--ps", "1ki", "--ps-head", "2k", "--budget-gib", "1"]
    result = CliRunner().invoke(app, [*args, "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    (row,) = ResultsFile(out).rows()
    assert (row.seq_len_tokens, row.partition_size, row.head_partition_size) == (4000, 1024, 2000)


def test_max_len_reads_2k_as_2000_in_ps_ps_head_and_at(stub_probe, stub_simulation) -> None:
    args = ["max-len", *TINY_SIM, "--ps", "2k", "--ps-head", "2ki", "--at", "2k", "--budget-gib", "0.02"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    settings = document["settings"]
    assert (settings["partition_size"], settings["head_partition_size"]) == (2000, 2048)
    assert [step["seq_len_tokens"] for step in document["steps"]][1:] == [2000]


def test_verify_takes_suffixed_lengths() -> None:
    args = ["verify", "-m", "tiny/llama", "--method", "streambp", "--dtype", "float64", "-T", "0.1k",
            "--ps", "0.04k", "--ps-head", "0.032k"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    spec = json.loads(result.stdout)["spec"]
    assert (spec["seq_len_tokens"], spec["partition_size"], spec["head_partition_size"]) == (100, 40, 32)


def test_length_help_says_what_k_is() -> None:
    for command in ("sweep", "max-len", "verify"):
        help_text = CliRunner().invoke(app, [command, "--help"]).stdout
        text = " ".join(help_text.replace("│", " ").split())  # the words, across the panels' wrapped lines
        assert "k = 1000, ki = 1024" in text and "k = 1024" not in text.replace("ki = 1024", "")
