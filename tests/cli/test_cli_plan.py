"""`streambp-bench plan` on a tiny preset through the real app: the ranking, its equality with max-len's
answer for the same recipe, the misses, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streambp_bench.cli import app
from tests.cli.errors import one_line_error

TINY = ["plan", "-m", "tiny/qwen3", "--gpu-model", "h100", "--seq-len", "2k", "--method", "streambp",
        "--budget-gib", "0.02", "-j", "1"]
"""One GPU, streambp with both heads: at 2,000 tokens in 0.02 GiB the whole sequence fits as one chunk."""


@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("emitted")


@pytest.fixture(scope="module")
def ranking(emitted) -> dict:
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, [*TINY, "--json", "--emit", str(emitted)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_plan_ranks_the_fitting_recipes_fastest_first_with_their_figures(ranking) -> None:
    entries = ranking["ranking"]
    assert {entry["head_mode"] for entry in entries} == {"fused", "recompute"}
    times = [entry["estimated_step_time_s"] for entry in entries]
    assert times == sorted(times) and all(time > 0 for time in times)
    for entry in entries:
        low, high = entry["estimated_band_s"]
        assert low < entry["estimated_step_time_s"] < high
        assert 0 < entry["simulated_peak_gib"] <= 0.02
        assert entry["estimated_regime"].endswith("-bound")
        assert 0 < entry["estimated_mfu"] < 1 and entry["estimated_tokens_per_s_per_gpu"] > 0
        assert entry["partition_size"] == entry["head_partition_size"] == 2000
    assert ranking["settings"]["sources"] == {"times": "estimated", "memory": "simulated"}


def test_recipes_above_a_rung_at_the_largest_partitions_are_dominated_not_evaluated(ranking) -> None:
    assert {entry["offload"] for entry in ranking["ranking"]} == {"none"}
    dominated = ranking["dominated"]
    assert len(dominated) == 6  # 3 rungs above none, for each head
    assert all("estimated_step_time_s" not in entry for entry in dominated)  # not evaluated
    assert all("already runs the largest partitions" in entry["why"] for entry in dominated)


@pytest.mark.slow
def test_plans_answer_for_a_recipe_is_max_lens_at_the_same_length(runner, ranking) -> None:
    top = ranking["ranking"][0]
    result = runner.invoke(app, [
        "max-len", "-m", "tiny/qwen3", "--method", "streambp", "--head-mode", top["head_mode"],
        "--optimizer", "adamw", "--ps", "auto", "--ps-head", "auto", "--at", "2k", "--gpu-model", "h100",
        "--budget-gib", "0.02", "--device", "sim", "-j", "1", "--json"])
    assert result.exit_code == 0, result.output
    at = next(step for step in json.loads(result.stdout)["steps"] if step["seq_len_tokens"] == 2000)
    assert (at["partition_size"], at["head_partition_size"]) == (top["partition_size"],
                                                                  top["head_partition_size"])
    assert at["estimated_step_time_ms"] / 1e3 == pytest.approx(top["estimated_step_time_s"], rel=1e-12)


def test_emit_writes_the_fastest_recipes_launch_files(ranking, emitted) -> None:
    top = ranking["ranking"][0]
    assert ranking["emitted"] == {"recipe": top["recipe"], "pick": 1, "folder": str(emitted),
                                  "files": ["accelerate_config.yaml", "launch.sh", "train.py"]}
    script = (emitted / "train.py").read_text()
    assert f'"partition_size": {top["partition_size"]}' in script and "MAX_LENGTH = 2000" in script
    assert "distributed_type: 'NO'" in (emitted / "accelerate_config.yaml").read_text()  # one GPU


def test_a_plan_where_nothing_fits_names_the_nearest_miss(runner) -> None:
    result = runner.invoke(app, [*TINY[:-4], "--budget-gib", "0.001", "-j", "1", "--method",
                                     "checkpoint"])
    one_line_error(result, "no recipe fits 0.001 GiB", "GPU OOM by")


@pytest.mark.parametrize(("args", "words"), [
    (["--seq-len", "1"], ("--seq-len",)),
    (["--seq-len", "lots"], ("--seq-len",)),
    (["--budget-gib", "0"], ("--budget-gib",)),
    (["--host-gib", "-1"], ("--host-gib",)),
    (["--method", "fast"], ("unknown method 'fast'",)),
    (["-m", "no/such-model"], ("unknown model",)),
])
def test_bad_input_is_one_error_line_before_any_search(runner, args, words) -> None:
    one_line_error(runner.invoke(app, ["plan", "-m", "tiny/qwen3", *args]), *words)


def test_an_unknown_gpu_model_is_one_error_line(runner) -> None:
    result = runner.invoke(app, ["plan", "-m", "tiny/qwen3", "--gpu-model", "v100"])
    one_line_error(result, "--gpu-model")


def test_the_frontier_gives_each_recipe_max_lens_longest_length(runner) -> None:
    common = ["-m", "tiny/qwen3", "--method", "plain", "--optimizer", "none", "--budget-gib", "0.02",
              "-j", "1"]
    result = runner.invoke(app, ["plan", "--gpu-model", "h100", *common, "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["settings"]["seq_len_tokens"] == "max"
    (entry,) = document["ranking"]  # plain without an optimizer: one rung, no offload
    max_len = runner.invoke(app, ["max-len", *common, "--device", "sim", "--json"])
    assert max_len.exit_code == 0, max_len.output
    assert entry["seq_len_tokens"] == json.loads(max_len.stdout)["results"][0]["max_len_tokens"] > 2
    assert entry["simulated_peak_gib"] <= 0.02 and entry["estimated_step_time_s"] > 0
    assert document["frontier"]["longest"] == {"recipe": entry["recipe"],
                                               "seq_len_tokens": entry["seq_len_tokens"]}
    assert document["frontier"]["fastest_at_longest"]["recipe"] == entry["recipe"]
