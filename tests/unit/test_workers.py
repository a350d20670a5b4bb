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
    started = start_server(2)
    if started is None:
        pytest.skip("no fork server on this platform")
    return started


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


def test_a_task_s_exception_is_raised_in_the_parent_with_its_type(context) -> None:
    tasks = [Task("fine", square, (2,)), Task("bad", refuse, (7,))]
    with pytest.raises(ConfigError, match="no 7"):
        run_tasks(tasks, 2, context, lambda *event: None)


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
