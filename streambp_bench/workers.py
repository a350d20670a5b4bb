"""Independent searches side by side, one worker process per core.

Each method's max-length search is independent of the others, and a simulated search is CPU-bound Python,
so `max-len` on N cores runs up to N of them at once. Workers are forks of a fork server that
`start_server` launches before the command imports torch: the server imports the simulator once, while
the command does its own imports on another core, and every worker is a fork of that process, in which no
training step ever ran (so no thread of torch or peft is forked mid-flight, and no worker imports torch
again). A worker runs one task and sends its progress and its result (or its exception) back on a queue;
a worker that dies without a result fails the run with one line naming its task.

Nothing here imports torch: `start_server` must run before the heavy imports to overlap with them.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from streambp_bench import interrupts
from streambp_core.config import available_cpus

PRELOAD = ("streambp_core.step.search.probe", "streambp_bench.maxlen.plan")
"""Modules the fork server imports once for all its workers."""

POLL_S = 0.1
"""How often the parent checks its workers while no message arrives."""


def worker_count(jobs: int | None, tasks: int, device: str) -> int:
    """Workers to use: `jobs` when given (at most one per task), else one per core and task for a simulated
    device ('sim' or 'auto', which is sim without a GPU) and 1 for a measured one, whose probes need the
    machine to themselves."""
    if jobs is not None:
        return max(1, min(jobs, tasks))
    return max(1, min(available_cpus(), tasks)) if device in ("sim", "auto") else 1


def start_server(workers: int, preload: Sequence[str] = PRELOAD) -> Any | None:
    """The fork-server context for `workers` > 1, its server started now and importing `preload` (None
    where there is no fork server, e.g. on Windows, or for one worker: then everything runs in this
    process)."""
    if workers <= 1 or "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    from multiprocessing import forkserver, resource_tracker

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    resource_tracker.ensure_running()  # first: it guards itself, then unblocks SIGINT here
    with interrupts.deferred():  # the server and its workers never see SIGINT; run_tasks stops them
        forkserver.ensure_running()  # starts the resource tracker too
    return context


def stop_server(context: Any | None) -> None:
    """End the fork server `start_server` started for `context` (None: there is none), so a command
    leaves no process running after it returns (multiprocessing would keep it for the process's life)."""
    if context is None:
        return
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is not None and hasattr(server, "_stop"):
        server._stop()


class WorkerError(RuntimeError):
    """A worker process died without sending a result (killed, out of memory)."""


@dataclass(frozen=True)
class Task:
    """One unit of work: `fn(*args, progress)` in a worker; `progress(*event)` reaches `on_event`."""

    name: str
    fn: Callable[..., Any]
    args: tuple
    cost: float = 0.0
    """Relative cost: tasks start costliest first (ties in the order given)."""


def run_tasks(tasks: Sequence[Task], workers: int, context: Any | None,
              on_event: Callable[..., None]) -> list[Any]:
    """Each task's result, in the order of `tasks`, the tasks started costliest first (`Task.cost`): in
    this process when `context` is None, else on up to `workers` worker processes. A task's exception is
    raised here, after the other workers are stopped; `on_event(*event)` is called here for every
    progress event, in the order each worker sent them."""
    waiting = sorted(range(len(tasks)), key=lambda index: -tasks[index].cost)
    if context is None or workers <= 1 or len(tasks) <= 1:
        results = {index: tasks[index].fn(*tasks[index].args, on_event) for index in waiting}
        return [results[index] for index in range(len(tasks))]
    messages = context.Queue()
    results: dict[int, Any] = {}
    running: dict[int, Any] = {}
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                index = waiting.pop(0)
                running[index] = context.Process(target=_work, args=(index, tasks[index], messages),
                                                 name=f"streambp-bench {tasks[index].name}", daemon=True)
                running[index].start()
            try:
                kind, index, payload = messages.get(timeout=POLL_S)
            except queue.Empty:
                _check_alive(tasks, running, messages)
                continue
            if kind == "event":
                on_event(*payload)
                continue
            running.pop(index).join()
            if kind == "error":
                raise payload
            results[index] = payload
    finally:
        for process in running.values():
            process.terminate()
        for process in running.values():
            process.join()
        messages.close()
    return [results[index] for index in range(len(tasks))]


def _check_alive(tasks: Sequence[Task], running: dict[int, Any], messages: Any) -> None:
    """WorkerError when a worker exited without a result (its last message would be on the queue)."""
    for index, process in running.items():
        if process.exitcode is not None and messages.empty():
            raise WorkerError(f"the worker for {tasks[index].name} stopped (exit code {process.exitcode}) "
                              "without a result")


def _work(index: int, task: Task, messages: Any) -> None:
    """A worker's body: run the task, send its events, then its result or its exception."""

    def progress(*event: Any) -> None:
        messages.put(("event", index, event))

    try:
        messages.put(("done", index, task.fn(*task.args, progress)))
    except Exception as error:  # handed to the parent, which raises it
        messages.put(("error", index, _picklable(error)))


def _picklable(error: Exception) -> Exception:
    """`error` itself when it survives pickling, else a RuntimeError with its type and message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
