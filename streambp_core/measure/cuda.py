"""CUDA measurement helpers: device info (NVML), allocator peaks, event timing, OOM recognition.

Nothing here touches `torch.cuda` at import time; `pynvml` (package nvidia-ml-py, extra `cuda`) is
imported only inside `device_info` and its absence falls back to torch with a note saying so.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from streambp_core.measure.units import bytes_to_gib, gib_of
from streambp_core.search import HOST_PINNED_POOL

NVML_MISSING_NOTE = (
    "pynvml not installed (pip install 'streambp-bench[cuda]'): name and total memory from torch, "
    "used memory unknown"
)

_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
    "CUDA error: out of memory",
)
_HOST_OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "CUDA error: out of memory")
"""Out-of-memory messages of host allocations: the CPU allocator's, and the pinned-host allocator's
(`cudaHostAlloc` failing surfaces as a CUDA error, not as the device allocator's OutOfMemoryError)."""


def cuda_available() -> bool:
    """True when torch can use a CUDA device."""
    return torch.cuda.is_available()


@dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """Name and memory of one GPU."""

    name: str
    """Device name, e.g. 'NVIDIA H100 80GB HBM3'."""
    total_gib: float
    """Total device memory in GiB."""
    used_gib: float | None
    """Memory in use on the device by all processes (NVML only; None from torch)."""
    source: str
    """Where the figures came from: 'nvml' or 'torch'."""
    note: str = ""
    """Why the source is 'torch' when NVML was wanted; empty otherwise."""


def device_info(index: int = 0) -> DeviceInfo:
    """Describe CUDA device `index` (torch numbering), from NVML when possible, else from torch.

    Raises RuntimeError when neither NVML nor torch sees a CUDA device.
    """
    try:
        import pynvml
    except ImportError:
        return _torch_device_info(index, NVML_MISSING_NOTE)
    try:
        return _nvml_device_info(pynvml, index)
    except pynvml.NVMLError as exc:
        return _torch_device_info(index, f"NVML failed ({exc}): name and total memory from torch")


def _nvml_device_info(pynvml: Any, index: int) -> DeviceInfo:
    """Query NVML for the physical device behind torch's device `index`."""
    pynvml.nvmlInit()
    try:
        handle = _nvml_handle(pynvml, index)
        name = pynvml.nvmlDeviceGetName(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    finally:
        pynvml.nvmlShutdown()
    if isinstance(name, bytes):  # older nvidia-ml-py returns bytes
        name = name.decode()
    return DeviceInfo(
        name=name, total_gib=bytes_to_gib(memory.total), used_gib=bytes_to_gib(memory.used), source="nvml"
    )


def _nvml_handle(pynvml: Any, index: int) -> Any:
    """Map torch's device index through CUDA_VISIBLE_DEVICES (indices or GPU UUIDs) to an NVML handle."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible):
        entry = visible[index]
        if entry.isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
        if entry.startswith(("GPU-", "MIG-")):
            return pynvml.nvmlDeviceGetHandleByUUID(entry)
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def _torch_device_info(index: int, note: str) -> DeviceInfo:
    """Describe device `index` from torch's device properties (no used-memory figure)."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device available ({note})")
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo(
        name=props.name, total_gib=bytes_to_gib(props.total_memory), used_gib=None, source="torch", note=note
    )


class CudaPeak:
    """Context manager measuring the caching allocator's peak over a region.

    Steps: on entry synchronize and `reset_peak_memory_stats`; on exit synchronize and read
    `max_memory_allocated`, `max_memory_reserved`, and `num_alloc_retries` / `num_ooms` from
    `memory_stats` (those two are cumulative counters; they are reported as the change over the region).
    Pinned host memory (checkpoint offload): the pinned-host allocator's peak of active bytes
    (`torch.cuda.host_memory_stats`), None where this torch does not report it.
    """

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        self.device = device
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.peak_pinned_bytes: int | None = None
        self._start_retries = 0
        self._start_ooms = 0

    def __enter__(self) -> CudaPeak:
        self.reset()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.read()

    def reset(self) -> None:
        """Start a new peak from now (the allocator's current usage)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        _reset_pinned_peak()
        stats = torch.cuda.memory_stats(self.device)
        self._start_retries = stats.get("num_alloc_retries", 0)
        self._start_ooms = stats.get("num_ooms", 0)

    def read(self) -> CudaPeak:
        """Update the peak figures from the allocator (also callable inside the region)."""
        torch.cuda.synchronize(self.device)
        self.peak_allocated_bytes = torch.cuda.max_memory_allocated(self.device)
        self.peak_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
        stats = torch.cuda.memory_stats(self.device)
        self.num_alloc_retries = stats.get("num_alloc_retries", 0) - self._start_retries
        self.num_ooms = stats.get("num_ooms", 0) - self._start_ooms
        self.peak_pinned_bytes = _pinned_peak_bytes()
        return self

    def figures(self) -> dict[str, int | None]:
        """The figures by `TrackerResult`'s field names (cuda_...)."""
        names = ("peak_allocated_bytes", "peak_reserved_bytes", "num_alloc_retries", "num_ooms",
                 "peak_pinned_bytes")
        return {f"cuda_{name}": getattr(self, name) for name in names}

    peak_allocated_gib = gib_of("peak_allocated_bytes")
    peak_reserved_gib = gib_of("peak_reserved_bytes")


def _reset_pinned_peak() -> None:
    reset = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
    try:
        if reset is not None:
            reset()
    except (AttributeError, RuntimeError):  # a torch without the pinned-host allocator's statistics
        pass


def _pinned_peak_bytes() -> int | None:
    """Peak bytes of pinned host blocks handed out since the last reset; None when not reported."""
    stats_fn = getattr(torch.cuda, "host_memory_stats", None)
    try:
        stats = stats_fn() if stats_fn is not None else {}
    except (AttributeError, RuntimeError):
        return None
    peak = stats.get("active_bytes.peak")
    return None if peak is None else int(peak)


class HostMemoryFailure(RuntimeError):
    """The host ran out of memory where no device memory was at stake (a simulation on meta tensors): an
    error of the machine running it, never an out-of-memory data point (`is_oom` is False for it)."""


class PinnedHostOutOfMemory(MemoryError):
    """Page-locked (pinned) host memory ran out: torch's pinned-host allocator could not `cudaHostAlloc`
    a host copy of an offload tier. An out-of-memory data point whose pool is `HOST_PINNED_POOL`."""


@contextmanager
def pinned_host_allocation(nbytes: int, what: str = "a host copy") -> Iterator[None]:
    """Around a pinned host allocation of `nbytes`: an out-of-memory failure inside (which torch raises as
    a CUDA error, not as the device allocator's OutOfMemoryError) becomes `PinnedHostOutOfMemory`, its
    one-line message naming the pool, `what` was allocated and its size."""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:
        if isinstance(exc, torch.cuda.OutOfMemoryError) or not is_oom(exc):
            raise
        first = str(exc).split("\n")[0]
        raise PinnedHostOutOfMemory(f"out of memory in pool '{HOST_PINNED_POOL}' (page-locked host memory): "
                                    f"{what} of {nbytes:,} B ({nbytes / 2**30:.2f} GiB) could not be pinned "
                                    f"({first})") from exc


def is_oom(exc: BaseException) -> bool:
    """True when `exc` is an out-of-memory failure.

    Recognises torch.OutOfMemoryError (CUDA's), Python's MemoryError, and RuntimeErrors whose message
    says CUDA out of memory, cuBLAS could not allocate, or the CPU allocator could not allocate.
    """
    if isinstance(exc, HostMemoryFailure):
        return False
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)


def oom_pool(exc: BaseException) -> str | None:
    """Which memory an out-of-memory `exc` ran out of: 'device' (the CUDA allocator, cuBLAS), 'host pinned'
    (`PinnedHostOutOfMemory`: an offload tier's page-locked host copy), 'host' (RAM, or pinned memory that
    failed where the project did not allocate it, e.g. inside torch's `save_on_cpu`); None when `exc` is
    no OOM."""
    if not is_oom(exc):
        return None
    if isinstance(exc, PinnedHostOutOfMemory):
        return HOST_PINNED_POOL
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "device"
    host = isinstance(exc, MemoryError) or any(m in str(exc) for m in _HOST_OOM_MESSAGES)
    return "host" if host else "device"
