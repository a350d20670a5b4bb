"""`max-len --sp N`: one Ulysses rank simulated, the host budget per node, and bad input (one `error:` line,
exit 2, before any search)."""

from __future__ import annotations

import json

import pytest

from streambp_bench.cli import app
from tests.cli.errors import one_line_error

TINY = ["max-len", "-m", "tiny/llama", "--ps", "32", "--ps-head", "16", "--budget-gib", "0.01"]
"""tiny/llama: 4 query heads, 2 KV heads."""



def _rows(result) -> dict:
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    return document, {row["label"]: row for row in document["results"]}


def test_a_sequence_parallel_rank_reaches_further_than_one_gpu_and_says_how(runner):
    one = _rows(runner.invoke(app, [*TINY, "--method", "streambp", "--json"]))[1]["streambp"]
    document, rows = _rows(runner.invoke(app, [*TINY, "--method", "streambp", "--gpus", "4", "--sp", "4",
                                               "--shard", "zero3", "--json"]))
    rank = rows["streambp"]
    assert (document["gpus"], document["sp"], document["shard"]) == (4, 4, "zero3")
    assert "Ulysses" in rank["how"] and "KV head replicated x2" in rank["how"]
    # a rank holds 1/4 of the tokens, but its head-sharded K/V over all of them (2 KV heads, each x2)
    assert rank["max_len_tokens"] > 1.5 * one["max_len_tokens"]


@pytest.mark.slow
def test_the_host_budget_is_per_node_and_shared_by_its_ranks(runner):
    args = [*TINY, "--method", "streambp", "--optimizer", "adamw", "--offload", "checkpoints,optimizer",
            "--gpus", "4", "--sp", "4", "--shard", "zero3", "--host-budget-gib", "0.004", "--json"]
    shared, _ = _rows(runner.invoke(app, [*args, "--gpus-per-node", "2"]))
    assert shared["ranks_per_node"] == 2 and shared["host_budget_per_node_gib"] == pytest.approx(0.004)
    assert shared["host_budget_gib"] == pytest.approx(0.002)
    alone, _ = _rows(runner.invoke(app, [*args, "--gpus-per-node", "1"]))
    assert alone["host_budget_gib"] == pytest.approx(0.004)
    assert alone["results"][0]["max_len_tokens"] > shared["results"][0]["max_len_tokens"]


@pytest.mark.parametrize(("extra", "words"), [
    (["--gpus", "8", "--sp", "3", "--shard", "zero3"], ("--sp 3", "--gpus 8")),
    (["--sp", "2"], ("--sp 2", "--gpus")),
    (["--gpus", "8", "--sp", "8", "--shard", "zero3"], ("4 attention heads", "8 sequence-parallel")),
    (["--sp", "2", "--device", "cuda"], ("--sp", "simulated")),
])
def test_bad_sequence_parallel_input_is_one_line(runner, extra, words):
    one_line_error(runner.invoke(app, [*TINY, *extra]), *words)


def test_sp_on_cpu_beyond_the_cores_names_them(runner, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    one_line_error(runner.invoke(app, [*TINY, "--sp", "4", "--device", "cpu"]), "--sp 4", "2 cores")
    one_line_error(runner.invoke(app, [*TINY, "--sp", "2", "--device", "cpu"]), "--device sim")


def test_a_node_budget_below_the_ranks_optimizer_states_is_refused(runner):
    args = [*TINY, "--method", "streambp", "--optimizer", "adamw", "--offload", "checkpoints,optimizer",
            "--gpus", "2", "--sp", "2", "--shard", "zero3", "--host-budget-gib", "1e-6"]
    one_line_error(runner.invoke(app, args), "per node", "optimizer's states", "one rank's shard of 2")


@pytest.mark.slow
def test_a_sequence_parallel_rank_gets_a_step_time_with_its_collectives_and_copies(runner):
    """`--gpu-model` with `--sp`: the rank's estimated step time, its all-to-alls and the offload copies
    read from the same fields as one GPU's step."""
    # chunks of 256: the estimate records each reference step op by op, and its cost is its chunk count
    document, rows = _rows(runner.invoke(app, [
        *TINY, "--ps", "256", "--ps-head", "256", "--method", "streambp", "--gpus", "2", "--sp", "2",
        "--offload", "checkpoints", "--gpu-model", "h100", "--json"]))
    step = document["steps"][0]
    assert step["estimated_step_time_ms"] > 0 and step["estimated_all_to_all_gib"] > 0
    assert "NVLink" in step["interconnect"]
    assert step["estimated_pcie"]["pcie_gb_per_s"] == pytest.approx(64)
    assert step["estimated_pcie"]["to_host_bytes"] > 0
