"""Real ranks on the CPU: results come back in rank order; a failing or dying rank is named in one line
and takes the others down instead of leaving them waiting."""

from __future__ import annotations

import time

import pytest

from streambp_core.config import ConfigError
from streambp_core.parallel.launch import RankError, available_cpus, check_nproc, run_ranks
from tests.unit import parallel_ranks

pytestmark = pytest.mark.skipif(available_cpus() < 2, reason="needs two CPU cores for two ranks")


def test_ranks_return_in_rank_order_after_a_collective():
    assert run_ranks(parallel_ranks.rank_and_sum, 2) == [(0, 1.0), (1, 1.0)]


def test_what_a_rank_prints_goes_to_stderr_leaving_stdout_to_the_parent(capfd):
    """A DeepSpeed rank prints its own lines; a `--json` on the parent's stdout must stay parseable."""
    assert run_ranks(parallel_ranks.rank_prints, 2) == [0, 1]
    out, err = capfd.readouterr()
    assert "says hello" not in out
    for rank in (0, 1):
        assert f"rank {rank} says hello through print" in err
        assert f"rank {rank} says hello through fd 1" in err


def test_a_rank_that_raises_is_named_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"^rank 1 failed: ValueError: boom on purpose$"):
        run_ranks(parallel_ranks.rank_one_raises, 2, timeout_s=60)
    assert time.monotonic() - start < 50  # not the process-group timeout


def test_a_rank_that_dies_is_named_not_waited_for():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"^rank 1 failed: died \(exit code 3\)$"):
        run_ranks(parallel_ranks.rank_one_dies, 2, timeout_s=60)
    assert time.monotonic() - start < 50


@pytest.mark.parametrize("nproc", [0, -1, 10_000])
def test_nproc_outside_one_to_the_cores_is_refused(nproc):
    with pytest.raises(ConfigError, match="nproc"):
        check_nproc(nproc, "cpu")
