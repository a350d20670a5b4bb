"""Ctrl-C (`streambp_bench.interrupts`): a KeyboardInterrupt for the command outside an import, an immediate
one-line exit 130 inside one, and SIGINT held back from the fork server and its workers, never lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from streambp_bench import interrupts

LINUX = sys.platform.startswith("linux")


@pytest.fixture(autouse=True)
def sigint_answered() -> Iterator[None]:
    """SIGINT answered as in a terminal's foreground job, whatever this process inherited: a background job
    (`pytest ... &`, `nohup`, some CI runners) starts with SIGINT ignored, and there `interrupts.handled()`
    rightly installs nothing. The disposition the test found is put back after it."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_importing_is_true_only_inside_an_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "probe_importing.py").write_text(
        "import sys\nfrom streambp_bench.interrupts import importing\nSEEN = importing(sys._getframe())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import probe_importing  # noqa: PLC0415

    assert probe_importing.SEEN is True
    assert interrupts.importing(sys._getframe()) is False
    assert interrupts.importing(None) is False


def test_outside_an_import_the_handler_raises_keyboard_interrupt_for_the_command() -> None:
    with pytest.raises(KeyboardInterrupt):
        interrupts.on_sigint(signal.SIGINT, sys._getframe())


def test_inside_an_import_ctrl_c_exits_at_once_with_one_line(tmp_path: Path) -> None:
    """transformers' lazy modules turn a KeyboardInterrupt inside an import into a ModuleNotFoundError and
    a pybind11 module aborts on one, so a Ctrl-C there must never become an exception."""
    (tmp_path / "slow_module.py").write_text(
        "import os, signal\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    for _ in range(10**7): pass\n"
        "except BaseException as error:\n"
        "    raise ModuleNotFoundError('mangled, as transformers does') from error\n")
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from streambp_bench import interrupts\n"
            "with interrupts.handled():\n"
            "    import slow_module\n"
            "print('not reached')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    assert (done.returncode, done.stderr, done.stdout) == (130, "error: interrupted\n", "")


def test_handled_restores_the_previous_handler() -> None:
    before = signal.getsignal(signal.SIGINT)
    with interrupts.handled():
        assert signal.getsignal(signal.SIGINT) is interrupts.on_sigint
    assert signal.getsignal(signal.SIGINT) is before


def test_handled_installs_nothing_where_sigint_is_ignored() -> None:
    """A background job's SIGINT stays ignored: the command must not start answering a Ctrl-C meant for the
    foreground job."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with interrupts.handled():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no signal masks on this platform")
def test_a_sigint_while_deferred_is_delivered_after_the_block_not_lost() -> None:
    with pytest.raises(KeyboardInterrupt):  # pytest's handler is the default: a KeyboardInterrupt
        with interrupts.deferred():
            # to this thread: one sent to the process may go to another thread, where it is not blocked
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
            assert signal.SIGINT in signal.sigpending()
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


def _blocked_and_ignored(pid: int) -> tuple[bool, bool]:
    """Whether SIGINT is blocked, and whether it is ignored, in process `pid` (Linux /proc)."""
    fields = dict(line.split(":\t") for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.startswith(("SigBlk", "SigIgn")))
    bit = 1 << (signal.SIGINT - 1)
    return bool(int(fields["SigBlk"], 16) & bit), bool(int(fields["SigIgn"], 16) & bit)


def worker_sigint(value: int, progress) -> tuple[bool, bool]:
    return _blocked_and_ignored(os.getpid())


FORK_SERVER_CHECK = """
import os, signal
from multiprocessing import forkserver
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's foreground job has it
from streambp_bench import workers
from streambp_bench.workers import Task, run_tasks
from tests.unit.test_interrupts import _blocked_and_ignored, worker_sigint
started, calls = forkserver.ensure_running, []

def interrupted_while_starting():
    started()
    calls.append(1)
    if len(calls) == 1:
        os.kill(os.getpid(), signal.SIGINT)

forkserver.ensure_running = interrupted_while_starting
context = None
try:
    try:
        workers.start_server(2, preload=())
    except KeyboardInterrupt:
        print("interrupted")
    context = workers.start_server(2, preload=())  # running already: this returns its context
    print("server", _blocked_and_ignored(forkserver._forkserver._forkserver_pid))
    tasks = [Task(f"t{value}", worker_sigint, (value,)) for value in (1, 2)]
    print("workers", run_tasks(tasks, 2, context, lambda *event: None))
finally:
    workers.stop_server(context)
"""
"""The fork-server check, run in a process of its own: no fork server, resource tracker, thread or signal
state another test left in the test process can reach it."""


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_the_fork_server_and_its_workers_never_see_sigint_and_the_parent_loses_none() -> None:
    """A Ctrl-C reaches every process of the group: the fork server (importing torch) and its workers must
    not answer it (a traceback each), and the parent must not miss one sent while it starts the server (it
    once ignored SIGINT then, and a Ctrl-C in that window was lost: the run went on and exited 0)."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", FORK_SERVER_CHECK], capture_output=True, text=True,
                          timeout=300, cwd=root,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])})
    assert done.stdout.splitlines() == [
        "interrupted", "server (True, False)", "workers [(True, False), (True, False)]"], done.stderr


STOPPED_SERVER_CHECK = """
import os, time, typer
from multiprocessing import forkserver
from streambp_bench import workers
from streambp_bench.errors import user_errors
workers.start_server(2, preload=("slow_preload",))
pid = forkserver._forkserver._forkserver_pid

@user_errors
def command():
    raise KeyboardInterrupt

try:
    command()
except typer.Exit as stopped:
    print("exit", stopped.exit_code)
deadline = time.monotonic() + 10
while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
    time.sleep(0.05)
print("server ended", time.monotonic() < deadline)
"""
"""An interrupted command whose fork server still imports its preload (one that takes 30 s), run in a
process of its own (the server is that process's child)."""


def test_an_interrupted_command_ends_its_fork_server_at_once(tmp_path: Path) -> None:
    """Ctrl-C early in a command: its fork server, still importing the simulator, ends with it instead of
    seconds later (holding the stderr it shares with the command until then)."""
    (tmp_path / "slow_preload.py").write_text("import time\ntime.sleep(30)\n")
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(root), str(tmp_path), *sys.path])
    done = subprocess.run([sys.executable, "-c", STOPPED_SERVER_CHECK], capture_output=True, text=True,
                          timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": path})
    assert done.stdout.splitlines() == ["exit 130", "server ended True"], done.stderr
