"""Searches on worker processes (`streambp_bench.workers`): results in task order, progress events relayed,
a task's exception raised in the parent, a dead worker named; and the worker count's defaults."""

from __future__ import annotations

import os

import pytest

from streambp_bench.workers import Task, WorkerError, run_tasks, start_server, worker_count
from streambp_core.config import ConfigError


def square(value: int, progress) -> int:
    progress("square", value)
    return value * value


def refuse(value: int, progress) -> int:
    raise ConfigError(f"no {value}")


def die(value: int, progress) -> int:
    os._exit(3)


@pytest.fixture(scope="module")
def context():
    """A fork server importing nothing ahead: these tasks are this module's own functions, and the
    simulator a command's server imports (`PRELOAD`, seconds of imports) is no part of what is checked."""
    started = start_server(2, preload=())
    if started is None:
        pytest.skip("no fork server on this platform")
    return started


@pytest.mark.slow
def test_results_come_back_in_task_order_with_every_progress_event(context) -> None:
    events: list[tuple] = []
    tasks = [Task(f"t{value}", square, (value,)) for value in (3, 1, 2)]
    assert run_tasks(tasks, 2, context, lambda *event: events.append(event)) == [9, 1, 4]
    assert sorted(events) == [("square", 1), ("square", 2), ("square", 3)]


def test_without_a_context_the_tasks_run_here_in_order() -> None:
    events: list[tuple] = []
    tasks = [Task(f"t{value}", square, (value,)) for value in (3, 1)]
    assert run_tasks(tasks, 2, None, lambda *event: events.append(event)) == [9, 1]
    assert events == [("square", 3), ("square", 1)]


def test_tasks_start_costliest_first_and_their_results_keep_the_task_order() -> None:
    events: list[tuple] = []
    tasks = [Task("cheap", square, (3,), cost=1), Task("dear", square, (1,), cost=4),
             Task("tie", square, (2,))]
    assert run_tasks(tasks, 1, None, lambda *event: events.append(event)) == [9, 1, 4]
    assert events == [("square", 1), ("square", 3), ("square", 2)]


def test_a_task_s_exception_is_raised_in_the_parent_with_its_type(context) -> None:
    tasks = [Task("fine", square, (2,)), Task("bad", refuse, (7,))]
    with pytest.raises(ConfigError, match="no 7"):
        run_tasks(tasks, 2, context, lambda *event: None)


def remember(seen: list, value: int, progress) -> tuple[int, int]:
    seen.append(value)
    return os.getpid(), len(seen)


def test_a_worker_keeps_what_its_tasks_share_from_task_to_task(context) -> None:
    """Four tasks sharing one list on two workers: each worker runs at least one of them after another,
    on the same list (as plan's tasks share one resolved model and its memo), not on a fresh copy."""
    seen: list[int] = []
    found = run_tasks([Task(f"t{value}", remember, (seen, value)) for value in range(4)], 2, context,
                      lambda *event: None)
    by_worker: dict[int, list[int]] = {}
    for pid, length in found:
        by_worker.setdefault(pid, []).append(length)
    assert os.getpid() not in by_worker and max(len(lengths) for lengths in by_worker.values()) >= 2
    assert all(sorted(lengths) == list(range(1, len(lengths) + 1)) for lengths in by_worker.values())
    assert seen == []  # the parent's list: the workers had their own copy


def test_a_worker_that_dies_without_a_result_is_named(context) -> None:
    with pytest.raises(WorkerError, match="the worker for doomed stopped .exit code 3."):
        run_tasks([Task("fine", square, (2,)), Task("doomed", die, (0,))], 2, context, lambda *event: None)


@pytest.mark.parametrize(
    ("jobs", "tasks", "device", "expected"),
    [(None, 4, "cuda", 1), (None, 4, "cpu", 1), (None, 1, "sim", 1), (8, 3, "sim", 3), (2, 4, "cuda", 2)],
)
def test_worker_count(jobs, tasks, device, expected) -> None:
    assert worker_count(jobs, tasks, device) == expected


def test_worker_count_defaults_to_the_cores_when_simulated() -> None:
    from streambp_core.config import available_cpus

    assert worker_count(None, 64, "sim") == min(available_cpus(), 64)
    assert start_server(1) is None


@pytest.mark.slow
def test_reproduce_searches_on_workers_give_the_rows_of_one_process(context, tmp_path) -> None:
    """`reproduce`'s max-length searches (`max_len_rows`) on two workers: the same rows, in spec order, as
    one after another here, and every search's progress note reaches the settings' note."""
    from streambp_bench.paper.shared import Settings, max_len_rows
    from streambp_core.config import StepSpec

    specs = [StepSpec.of(model="tiny/llama", method=method, partition_size=32, head_partition_size=16)
             for method in ("checkpoint", "streambp")]
    notes: list[str] = []
    here = max_len_rows(specs, Settings(out_dir=tmp_path, quick=True))
    there = max_len_rows(specs, Settings(out_dir=tmp_path, quick=True, note=notes.append, jobs=2,
                                         context=context))
    same = lambda row: {k: v for k, v in vars(row).items() if k not in ("timestamp",)}  # noqa: E731
    assert [same(row) for row in there] == [same(row) for row in here]
    assert [row.method for row in there] == ["checkpoint", "streambp"] and here[1].value > here[0].value
    searched = sorted(note.split()[2] for note in notes if note.startswith("max length"))
    assert searched == ["checkpoint", "streambp"]
