"""Start N ranks on this machine and collect what each returns: gloo on CPU, nccl on CUDA.

Every rank runs `fn(rank, world_size, *args)` inside an initialized process group with a timeout, so a
collective waiting on a dead peer fails instead of hanging. When a rank fails, the others are stopped
and one `RankError` line names it and says why.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from streambp_core.config import ConfigError, available_cpus

DEFAULT_TIMEOUT_S = 120.0
"""Process-group timeout: the longest a collective waits for a peer."""

FAILURE_GRACE_S = 3.0
"""After a rank fails, how long its peers get to fail on their own before they are stopped."""


class RankError(RuntimeError):
    """A rank failed (raised, was killed or timed out); the message names the rank, on one line."""


def backend_for(device: str) -> str:
    """The collective backend of a device type: nccl for cuda, gloo for cpu; ConfigError if missing."""
    kind = torch.device(device).type
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed; multi-process runs need it")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device cuda requested but torch sees no CUDA device")
        if not dist.is_nccl_available():
            raise ConfigError("backend nccl is not available in this torch build; it is needed on cuda")
        return "nccl"
    if kind != "cpu":
        raise ConfigError(f"device must be cpu or cuda, got {device!r}")
    if not dist.is_gloo_available():
        raise ConfigError("backend gloo is not available in this torch build; it is needed on cpu")
    return "gloo"


def check_nproc(nproc: int, device: str) -> None:
    """ConfigError unless 1 <= nproc <= the CPU cores (cpu) or the visible GPUs (cuda)."""
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ConfigError(f"nproc must be a positive integer, got {nproc!r}")
    if torch.device(device).type == "cuda":
        limit, what = torch.cuda.device_count(), "visible GPUs"
    else:
        limit, what = available_cpus(), "CPU cores"
    if nproc > limit:
        raise ConfigError(f"nproc {nproc} is more than the {limit} {what} of this machine")


def run_ranks(
    fn: Callable[..., Any], nproc: int, *, device: str = "cpu", args: tuple = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run `fn(rank, nproc, *args)` in `nproc` spawned processes; return their results in rank order.

    `fn` and `args` must be picklable (a module-level function). Steps:
    1. check the backend and nproc; make a temporary directory for the rendezvous file and results;
    2. spawn the ranks; each joins the process group (timeout `timeout_s`), runs `fn`, saves its result;
    3. wait; on a failure stop the others and raise RankError naming the first rank that failed and why
       (ConfigError if that rank refused its input); past twice the timeout, stop all and raise.
    """
    backend = backend_for(device)
    check_nproc(nproc, device)
    with tempfile.TemporaryDirectory(prefix="streambp-ranks-") as workdir:
        context = _spawn_ignoring_interrupts(_rank_main, (fn, nproc, backend, workdir, timeout_s, args),
                                             nproc)
        try:
            _wait(context, Path(workdir), 2 * timeout_s)
        except KeyboardInterrupt:  # Ctrl-C reaches this process only: stop the ranks, then propagate
            _stop(context.processes)
            raise
        return [torch.load(Path(workdir) / f"rank{rank}.pt", weights_only=False) for rank in range(nproc)]


def _spawn_ignoring_interrupts(main: Callable[..., Any], args: tuple, nproc: int):
    """Start the ranks with SIGINT ignored, which a spawned interpreter inherits, so a Ctrl-C during
    their start-up prints no traceback from each of them: the launcher stops them itself."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return mp.start_processes(main, args=args, nprocs=nproc, join=False, start_method="spawn")
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait(context, workdir: Path, limit_s: float) -> None:
    """Wait for every rank; on a failure (or past `limit_s`) stop the others and raise one error."""
    processes = context.processes
    deadline = time.monotonic() + limit_s
    while any(p.exitcode is None for p in processes):
        if any(p.exitcode not in (None, 0) for p in processes):
            _settle(processes, FAILURE_GRACE_S)
            codes = [p.exitcode for p in processes]  # None: still running, stopped next
            _stop(processes)
            _raise_rank_error(codes, workdir)
        if time.monotonic() > deadline:
            _stop(processes)
            raise RankError(f"ranks did not finish within {limit_s:.0f} s; stopped them all")
        multiprocessing.connection.wait([p.sentinel for p in processes], timeout=0.1)
    if any(p.exitcode != 0 for p in processes):
        _raise_rank_error([p.exitcode for p in processes], workdir)


def _settle(processes, grace_s: float) -> None:
    """Give the peers of a failed rank `grace_s` to fail on their own (a broken collective)."""
    deadline = time.monotonic() + grace_s
    while any(p.exitcode is None for p in processes) and time.monotonic() < deadline:
        multiprocessing.connection.wait([p.sentinel for p in processes], timeout=0.1)


def _stop(processes) -> None:
    for process in processes:
        if process.exitcode is None:
            process.kill()
            process.join()


def _raise_rank_error(exit_codes: list[int | None], workdir: Path) -> None:
    """Raise the first cause: a rank that died without an error record, else the earliest error record
    (its peers fail after it, in the collective it left)."""
    records = {rank: workdir / f"rank{rank}.error" for rank in range(len(exit_codes))}
    died = [rank for rank, code in enumerate(exit_codes)
            if code not in (0, None) and not records[rank].exists()]
    if died:
        rank = died[0]
        code = exit_codes[rank]
        why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        raise RankError(f"rank {rank} failed: died ({why})")
    written = [rank for rank, record in records.items() if record.exists()]
    if not written:
        raise RankError("a rank was stopped before it could report why")
    rank = min(written, key=lambda r: records[r].stat().st_mtime_ns)
    kind, message = records[rank].read_text().split("\n", 1)
    if kind == "ConfigError":
        raise ConfigError(message)
    raise RankError(f"rank {rank} failed: {kind}: {' '.join(message.split())}")


def _rank_main(rank, fn, nproc, backend, workdir, timeout_s, args) -> None:
    """One rank: join the group, run `fn`, save its result (or its error, then exit non-zero). What the
    rank prints goes to stderr: stdout is the parent's (its `--json`), and engines print on their own."""
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    torch.set_num_threads(max(1, available_cpus() // nproc))
    for name in ("RANK", "LOCAL_RANK"):
        os.environ[name] = str(rank)  # what torchrun sets, for engines that read it
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ[name] = str(nproc)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:  # joining is inside: a rank whose peer failed while it joined records why too (after the peer)
        dist.init_process_group(backend, init_method=f"file://{workdir}/rendezvous", rank=rank,
                                world_size=nproc, timeout=timedelta(seconds=timeout_s))
        torch.save(fn(rank, nproc, *args), Path(workdir) / f"rank{rank}.pt")
    except Exception as error:
        message = str(error) or traceback.format_exc(limit=1)
        (Path(workdir) / f"rank{rank}.error").write_text(f"{type(error).__name__}\n{message}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is on disk; skip interpreter teardown (seconds with torch and transformers)
