"""Real ranks on the CPU: results come back in rank order; a failing or dying rank is named in one line
and takes the others down instead of leaving them waiting."""

from __future__ import annotations

import os
import sys
import time

import pytest

from streambp_core.config import ConfigError
from streambp_core.parallel.launch import RankError, available_cpus, check_nproc, run_ranks
from tests.unit import parallel_ranks

pytestmark = pytest.mark.skipif(available_cpus() < 2, reason="needs two CPU cores for two ranks")


@pytest.fixture(scope="module")
def printing_ranks(tmp_path_factory) -> tuple[list, str, str]:
    """One launch of two ranks that print and all-reduce (`rank_prints_and_sums`): their results, and what
    reached this process's stdout and stderr (file descriptors 1 and 2, which the ranks inherit)."""
    folder = tmp_path_factory.mktemp("printing_ranks")
    sys.stdout.flush(), sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    try:
        for fd in (1, 2):
            target = os.open(folder / f"fd{fd}", os.O_WRONLY | os.O_CREAT)
            os.dup2(target, fd)
            os.close(target)
        results = run_ranks(parallel_ranks.rank_prints_and_sums, 2)
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
    return results, (folder / "fd1").read_text(), (folder / "fd2").read_text()


def test_ranks_return_in_rank_order_after_a_collective(printing_ranks):
    assert printing_ranks[0] == [(0, 1.0), (1, 1.0)]


def test_what_a_rank_prints_goes_to_stderr_leaving_stdout_to_the_parent(printing_ranks):
    """A DeepSpeed rank prints its own lines; a `--json` on the parent's stdout must stay parseable."""
    _, out, err = printing_ranks
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
