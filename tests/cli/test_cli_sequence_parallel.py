"""`verify sp --nproc N --sp S`: bad input is one `error:` line and exit 2 before any rank starts; two gloo
ranks sharing each sequence, their weights sharded with FSDP2 zero3 across them, print every method's error
against single-process plain."""

from __future__ import annotations

import json

import pytest

from streambp_bench.cli import app
from streambp_core.config import PRESET_DIR
from streambp_core.engine.sequence.attention import KV_PIECES
from tests.cli.errors import one_line_error

TINY = ["verify", "sp", "--model", "tiny/llama", "--dtype", "float64", "--seq-len", "23", "--ps", "5",
        "--ps-head", "4"]



@pytest.fixture
def three_heads(tmp_path) -> str:
    """tiny/qwen3 with three query heads (and one KV head): they cannot split over two ranks."""
    config = json.loads((PRESET_DIR / "tiny--qwen3.json").read_text())
    config.update(num_attention_heads=3, num_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(("args", "expected"), [
    (["--nproc", "2", "--sp", "3"], "--sp 3 does not divide --nproc 2"),
    (["--sp", "2"], "Missing option '--nproc'"),
    (["--nproc", "2"], "Missing option '--sp'"),
    (["--nproc", "4096", "--sp", "2"], "more than the"),
    (["--nproc", "2", "--sp", "0"], "--sp must be at least 1"),
    (["--nproc", "2", "--sp", "2", "--engine", "deepspeed"], "No such option: --engine"),
    (["--nproc", "2", "--sp", "2", "--shard", "zero1"], "'zero1' is not one of 'zero2', 'zero3'"),
    (["--nproc", "2", "--sp", "2", "--packing", "3"], "No such option: --packing"),
    (["--nproc", "2", "--sp", "2", "--dtype", "bfloat16"], "exact dtypes"),
    (["--nproc", "2", "--sp", "2", "--shard", "zero3", "--lora-rank", "4"], "lora_rank must be 0"),
])
def test_sequence_parallel_bad_input_is_one_line_before_any_rank_starts(runner, args, expected):
    result = runner.invoke(app, [*TINY, *args])
    assert expected in one_line_error(result)


def test_heads_that_cannot_split_over_the_ranks_are_refused_before_any_rank_starts(runner, three_heads):
    from streambp_core.parallel.launch import available_cpus

    if available_cpus() < 2:
        pytest.skip("needs two CPU cores for two ranks")
    result = runner.invoke(app, [*TINY, "--model", three_heads, "--nproc", "2", "--sp", "2"])
    assert "3 attention heads do not split over 2" in one_line_error(result)


@pytest.mark.slow
def test_two_ranks_sharing_each_sequence_and_sharding_the_weights_match_plain(runner):
    from streambp_core.parallel.launch import available_cpus

    if available_cpus() < 2:
        pytest.skip("needs two CPU cores for two ranks")
    result = runner.invoke(app, [*TINY, "--nproc", "2", "--sp", "2", "--shard", "zero3", "--method",
                                 "streambp", "--padding", "left", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    (row,) = document["results"]
    assert document["source"] == "measured-cpu" and (document["sp"], document["shard"]) == (2, "zero3")
    assert row["ok"] and row["max_rel_err"] <= 1e-10 and row["chunks"] == 3  # 12-token shard, ps 5
    pieces = min(KV_PIECES, 11)  # a K/V swap's pieces: at most as many as the shorter shard's 11 tokens
    assert row["all_to_alls"] == row["layers"] * (3 * pieces + 6 * row["chunks"])
