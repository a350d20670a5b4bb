"""max-len never prints a non-answer as an answer: the search cap is a lower bound (≥, capped), a model
the CPU cannot hold is an error, `--at` takes lengths only (checked before the search), `--at` rows keep
the '+ offload' label, and an offloaded row that reaches less says why."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.maxlen.plan import MethodResult
from streambp_bench.maxlen.report import offload_notes
from streambp_core.config import StepSpec
from streambp_core.search import SEARCH_CAP_TOKENS, ProbeResult, SearchResult
from tests.cli.errors import one_line_error

TINY = ["max-len", "-m", "tiny/llama"]


def test_the_search_cap_is_printed_as_a_lower_bound_not_a_max_length(stub_probe) -> None:
    args = [*TINY, "--method", "checkpoint", "--budget-gib", "1048576"]
    shown = CliRunner().invoke(app, args)
    assert shown.exit_code == 0, shown.output
    assert f"≥ {SEARCH_CAP_TOKENS:,}" in shown.stdout and "No maximum found" in shown.stdout
    assert "Train at" not in shown.stdout
    document = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    (row,) = document["results"]
    assert row["capped"] is True and row["ratio_to_checkpoint"] is None


def test_a_found_maximum_is_not_capped(stub_probe) -> None:
    result = CliRunner().invoke(app, [*TINY, "--method", "checkpoint", "--budget-gib", "0.05", "--json"])
    (row,) = json.loads(result.stdout)["results"]
    assert row["capped"] is False and 2 <= row["max_len_tokens"] < SEARCH_CAP_TOKENS


@pytest.mark.parametrize("length", ["auto", "1e30", "1e18", "1", "200000k"])
def test_at_takes_lengths_from_2_to_the_cap_before_the_search(length: str) -> None:
    result = CliRunner().invoke(app, [*TINY, "--budget-gib", "1", "--at", length])
    one_line_error(result, "--at", repr(length))


@pytest.mark.slow
def test_at_rows_keep_the_offload_label() -> None:
    args = [*TINY, "--method", "streambp", "--offload", "both", "--budget-gib", "0.05", "--at", "4k"]
    document = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    labels = [step["label"] for step in document["steps"] if step["seq_len_tokens"] == 4000]  # k = 1000
    assert labels == ["streambp", "streambp + offload"]
    table = CliRunner().invoke(app, args).stdout
    assert "streambp + offload" in table.split("partitions that fit")[1]


def test_a_model_the_cpu_cannot_hold_is_an_error_not_length_0(monkeypatch) -> None:
    monkeypatch.setattr("streambp_core.measure.host_ram.available_ram_bytes", lambda: 1024)
    args = [*TINY, "--device", "cpu", "--budget-gib", "1", "--method", "checkpoint"]
    result = CliRunner().invoke(app, args)
    one_line_error(result, "RAM", "checkpoint")


def _result(offload: str, max_len: int, grads_bytes: int) -> MethodResult:
    spec = StepSpec.of(model="tiny/llama", method="streambp", offload=offload, lora_rank=8, optimizer="adamw")
    peak = ProbeResult(seq_len_tokens=max_len, status="ok", peak_bytes=2**30,
                       breakdown_bytes={"checkpoints": 2**29, "grads": grads_bytes})
    search = SearchResult(max_len_tokens=max_len, peak_at_max=peak, bracket=(max_len, max_len + 128),
                          probes=[peak], budget_bytes=2**30)
    return MethodResult(spec=spec, search=search, how="simulated")


def test_an_offloaded_row_that_reaches_less_says_why() -> None:
    notes = offload_notes([_result("none", 9000, 0), _result("checkpoints", 8000, 2**28)])
    (note,) = notes
    assert "streambp + offload reaches fewer tokens than streambp" in note and "grads +0.25 GiB" in note
    assert offload_notes([_result("none", 8000, 0), _result("checkpoints", 9000, 2**28)]) == []
