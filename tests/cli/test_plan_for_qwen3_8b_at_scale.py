"""`streambp-bench plan` for Qwen3-8B at training scale, cold: on 8 x H100 at 1M tokens it ranks at least
three recipes, each with a step time, the fastest within the GPU's memory and no slower than ALST's recipe
(mst, checkpoints offloaded, sp 8, FSDP2 zero3); on one H100 its longest length for streambp is max-len's.
Each runs minutes on 2 cores (the whole search, simulated)."""

from __future__ import annotations

import json

import pytest

from streambp_bench.cli import app

MODEL = "Qwen/Qwen3-8B"
H100_GIB = 79.65


def _alst(entry: dict, offload: str = "checkpoints") -> bool:
    return (entry["method"], entry["sp"], entry["shard"], entry["offload"]) == ("mst", 8, "zero3", offload)


@pytest.mark.slow
def test_eight_h100_at_1m_rank_three_recipes_the_fastest_no_slower_than_alsts(runner) -> None:
    result = runner.invoke(app, ["plan", "-m", MODEL, "--gpus", "8", "--gpu-model", "h100", "--seq-len",
                                 "1M", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    ranking = document["ranking"]
    assert len(ranking) >= 3 and all(entry["estimated_step_time_s"] > 0 for entry in ranking[:3])
    assert all(entry["seq_len_tokens"] == 1_000_000 for entry in ranking)
    top = ranking[0]
    assert top["simulated_peak_gib"] <= H100_GIB
    alst = [entry for entry in ranking if _alst(entry)]
    if not alst:  # dominated: the same mst recipe with fewer tiers already runs the largest partitions
        (dominated,) = [entry for entry in document["dominated"] if _alst(entry)]
        alst = [entry for entry in ranking if _alst(entry, offload="none")]
        assert "already runs the largest partitions" in dominated["why"]
    assert top["estimated_step_time_s"] <= alst[0]["estimated_step_time_s"]


@pytest.mark.slow
def test_one_h100_gives_streambps_longest_length_as_max_len_does(runner) -> None:
    result = runner.invoke(app, ["plan", "-m", MODEL, "--gpu-model", "h100", "--method", "streambp",
                                 "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    (entry,) = [entry for entry in document["ranking"]
                if entry["offload"] == "none" and entry["head_mode"] == "recompute"]
    max_len = runner.invoke(app, [
        "max-len", "-m", MODEL, "--method", "streambp", "--head-mode", "recompute", "--optimizer", "adamw",
        "--ps", "auto", "--ps-head", "auto", "--gpu-model", "h100", "--budget-gib", str(H100_GIB),
        "--device", "sim", "--json"])
    assert max_len.exit_code == 0, max_len.output
    assert entry["seq_len_tokens"] == json.loads(max_len.stdout)["results"][0]["max_len_tokens"]
    assert entry["simulated_peak_gib"] <= H100_GIB
