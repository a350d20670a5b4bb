"""`max-len --gpus N --shard S --gpu-model G` without `--sp`: a data-parallel (ZeRO / FSDP2) rank's step is
estimated, with the links its collectives were timed at, instead of being refused."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app

TINY = ["max-len", "-m", "tiny/llama", "--ps", "256", "--ps-head", "256", "--budget-gib", "0.01"]
"""Chunks of 256: the estimate records each reference step op by op, and its cost is its chunk count."""


@pytest.mark.slow
def test_a_data_parallel_rank_gets_an_estimated_step_time():
    result = CliRunner().invoke(app, [*TINY, "--method", "streambp", "--gpus", "2", "--shard", "zero2",
                                      "--gpu-model", "h100", "--json"])
    assert result.exit_code == 0, result.output
    step = json.loads(result.stdout)["steps"][0]
    assert step["estimated_step_time_ms"] > 0
    assert "NVLink" in step["interconnect"]
