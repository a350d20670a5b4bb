"""A command ends what it started and stops cleanly: no fork server left running, Ctrl-C is one line and
exit 130, a failed rank is one line naming it."""

from __future__ import annotations

import os
from multiprocessing import forkserver

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_core.parallel.launch import RankError


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_max_len_leaves_no_fork_server_running() -> None:
    args = ["max-len", "-m", "tiny/llama", "--method", "checkpoint,streambp", "--budget-gib", "0.05",
            "--jobs", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert not _alive(forkserver._forkserver._forkserver_pid)


def test_ctrl_c_during_start_up_is_one_line_and_exit_130(monkeypatch) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("streambp_bench.commands.max_len.start_server", interrupted)
    result = CliRunner().invoke(app, ["max-len", "-m", "tiny/llama", "--budget-gib", "1"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 130 and lines == ["error: interrupted"], result.output


@pytest.mark.parametrize(("target", "command"), [
    ("streambp_bench.verify.sharded.verify_sharded", ["fsdp"]),
    ("streambp_core.verify.deepspeed.verify_deepspeed", ["deepspeed", "--shard", "zero2"]),
    ("streambp_bench.verify.trainer_ranks.run_sharded_parity", ["trainer", "sft", "--shard", "zero2"]),
])
def test_a_failed_rank_is_one_line_naming_it(monkeypatch, target: str, command: list[str]) -> None:
    """A rank that dies or times out (`RankError`) is one line and exit 1 under every multi-rank verify."""
    def failed(*args, **kwargs):
        raise RankError("rank 1 failed: died (signal SIGKILL)")

    monkeypatch.setattr(target, failed)
    if command[0] == "deepspeed":
        monkeypatch.setattr("streambp_core.parallel.deepspeed.check_installed", lambda: None)  # CI has none
    result = CliRunner().invoke(app, ["verify", *command, "-m", "tiny/qwen3", "-T", "8", "--nproc", "2",
                                      "--dtype", "float64"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and lines == ["error: rank 1 failed: died (signal SIGKILL)"], result.output
