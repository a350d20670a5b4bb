"""Ctrl-C: one `error: interrupted` line and exit 130, wherever in a run it lands.

Python turns SIGINT into a KeyboardInterrupt at the next bytecode, and a command's handling
(`errors.user_errors`, `workers.run_tasks`' stopping of its workers, a results file's truncation back to its
old size) turns that into the line. Raised inside an import, though, the KeyboardInterrupt reaches code that
cannot take it: transformers' lazy modules turn it into a ModuleNotFoundError (or a RecursionError on the
next try), and a pybind11 module initialising (torch's) aborts the process. So `on_sigint` raises the
KeyboardInterrupt only outside an import; inside one, where nothing is being written (an import writes no
results), it stops the worker processes and exits at once with the same line and code.

Light on purpose (os, signal, sys): the CLI installs it before it imports anything else.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NoReturn

INTERRUPTED_EXIT_CODE = 130
"""Exit code of a command stopped by Ctrl-C (128 + SIGINT), with one `error: interrupted` line."""

_IMPORT_MACHINERY = "<frozen importlib."
"""How the frames of Python's import system name their file (`_bootstrap`, `_bootstrap_external`)."""


def on_sigint(signum: int, frame: FrameType | None) -> None:
    """The SIGINT handler of a CLI run: a KeyboardInterrupt for the command to handle, or, inside an import,
    `exit_interrupted` now."""
    if importing(frame):
        exit_interrupted()
    raise KeyboardInterrupt


def importing(frame: FrameType | None) -> bool:
    """Whether `frame`, or a frame that called it, is running an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_IMPORT_MACHINERY):
            return True
        frame = frame.f_back
    return False


def exit_interrupted() -> NoReturn:
    """Terminate this process's worker processes, print `error: interrupted` and exit 130, skipping the
    interpreter's teardown (which would run the interrupted import's callers)."""
    multiprocessing = sys.modules.get("multiprocessing")  # not loaded: no worker was started
    if multiprocessing is not None:
        for child in multiprocessing.active_children():
            child.terminate()
    stop_fork_server()
    os.write(2, b"error: interrupted\n")
    os._exit(INTERRUPTED_EXIT_CODE)


def stop_fork_server() -> None:
    """Terminate this process's fork server, if one runs (`workers.start_server`): still importing its
    preload, it would outlive an interrupted command by seconds, holding the stderr it shares with it."""
    forkserver = sys.modules.get("multiprocessing.forkserver")  # not loaded: no server was started
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """`on_sigint` as the SIGINT handler for the block, the previous one back after it; a no-op off the
    main thread (where no handler can be set) and where SIGINT is ignored (a background job's)."""
    previous = _install(on_sigint)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _install(handler: Callable[[int, FrameType | None], Any]) -> Any | None:
    """Set `handler` for SIGINT and return the previous handler, or None (nothing set) where this is not
    the main thread or SIGINT is ignored."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        return None
    return signal.signal(signal.SIGINT, handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT back from this thread for the block (it is delivered when the block ends), and from the
    processes started in it for their whole life: they inherit the blocked mask across fork and exec, so a
    Ctrl-C sent to the whole process group reaches this process alone, which stops them."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no masks
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
