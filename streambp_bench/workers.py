"""Independent searches side by side, one worker process per core.

Each method's max-length search is independent of the others, and a simulated search is CPU-bound Python,
so `max-len` on N cores runs up to N of them at once. Workers are forks of a fork server that
`start_server` launches before the command imports torch: the server imports the simulator once, while
the command does its own imports on another core, and every worker is a fork of that process, in which no
training step ever ran (so no thread of torch or peft is forked mid-flight, and no worker imports torch
again). Each worker gets every task at its start, pickled once, so what the tasks share (one resolved model
and its simulation memo) is one object in that worker; it then runs the tasks the parent hands it, one at a
time, costliest first to whichever worker is free, keeping that memo from task to task (a model's meta
kernels, meta models and simulations are built once per worker, not once per task). It sends each task's
progress and its result (or its exception) back on a queue; a worker that dies without a result fails the
run with one line naming its task.

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
    this process when `context` is None, else on up to `workers` worker processes (module docstring),
    each handed its next task when it is free. A task's exception is raised here, after the workers are
    stopped; `on_event(*event)` is called here for every progress event, in the order each worker sent
    them."""
    waiting = sorted(range(len(tasks)), key=lambda index: -tasks[index].cost)
    if context is None or workers <= 1 or len(tasks) <= 1:
        results = {index: tasks[index].fn(*tasks[index].args, on_event) for index in waiting}
        return [results[index] for index in range(len(tasks))]
    messages = context.Queue()
    inboxes = [context.Queue() for _ in range(min(workers, len(tasks)))]
    pool = [context.Process(target=_serve, args=(tuple(tasks), inbox, messages, number),
                            name=f"streambp-bench worker {number + 1}", daemon=True)
            for number, inbox in enumerate(inboxes)]
    results: dict[int, Any] = {}
    holding: dict[int, int] = {}  # worker number -> the task it runs
    finished = False  # every worker handed None: each returns on its own
    try:
        for process in pool:
            process.start()
        for number in range(len(pool)):
            holding[number] = waiting.pop(0)
            inboxes[number].put(holding[number])
        while holding:
            try:
                kind, number, payload = messages.get(timeout=POLL_S)
            except queue.Empty:
                _check_alive(tasks, pool, holding, messages)
                continue
            if kind == "event":
                on_event(*payload)
                continue
            if kind == "error":
                raise payload
            results[holding.pop(number)] = payload
            if waiting:
                holding[number] = waiting.pop(0)
            inboxes[number].put(holding.get(number))  # None: no task left, the worker returns
        finished = True
    finally:
        for process in pool:
            if not finished and process.is_alive():  # an error or an interrupt: stop them all
                process.terminate()
        for process in pool:
            process.join()
        for channel in (messages, *inboxes):
            channel.close()
    return [results[index] for index in range(len(tasks))]


def _check_alive(tasks: Sequence[Task], pool: Sequence[Any], holding: dict[int, int], messages: Any) -> None:
    """WorkerError when a worker holding a task exited without its result (it would be on the queue)."""
    for number, index in holding.items():
        exitcode = pool[number].exitcode
        if exitcode is not None and messages.empty():
            raise WorkerError(f"the worker for {tasks[index].name} stopped (exit code {exitcode}) "
                              "without a result")


def _serve(tasks: Sequence[Task], inbox: Any, messages: Any, number: int) -> None:
    """A worker's body: run each task index `inbox` hands it until None, sending the task's events, then
    its result or its exception."""

    def progress(*event: Any) -> None:
        messages.put(("event", number, event))

    while (index := inbox.get()) is not None:
        try:
            messages.put(("done", number, tasks[index].fn(*tasks[index].args, progress)))
        except Exception as error:  # handed to the parent, which raises it
            messages.put(("error", number, _picklable(error)))


def _picklable(error: Exception) -> Exception:
    """`error` itself when it survives pickling, else a RuntimeError with its type and message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
