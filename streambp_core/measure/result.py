"""The figures a `MemoryTracker` reports (GiB = 2**30 bytes)."""

from __future__ import annotations

from dataclasses import dataclass

from streambp_core.measure.units import bytes_to_gib, gib_of


@dataclass(frozen=True, kw_only=True)
class TrackerResult:
    """Live-tensor bytes over a tracked region (GiB = 2**30 bytes)."""

    peak_bytes: int
    """Most bytes live at once since entry or the last `reset_peak()`."""
    peak_breakdown_bytes: dict[str, int]
    """Bytes per category at that peak (every category present; they sum to `peak_bytes`)."""
    activation_peak_breakdown_bytes: dict[str, int]
    """Bytes per category where the most bytes outside the model state (weights, gradients, optimizer
    state) were live at once, the latest such point (`StorageLedger`'s activation peak)."""
    end_bytes: int
    """Bytes live at exit (or now, for a result taken inside the region)."""
    end_breakdown_bytes: dict[str, int]
    """Bytes per category at exit."""
    device: str
    """The device filter, else the devices whose storages were counted, comma-separated."""
    cuda_peak_allocated_bytes: int | None = None
    """The CUDA caching allocator's `max_memory_allocated` over the region; None without CUDA."""
    cuda_peak_reserved_bytes: int | None = None
    """The CUDA caching allocator's `max_memory_reserved` over the region; None without CUDA."""
    cuda_num_alloc_retries: int | None = None
    """Times over the region the allocator's cudaMalloc failed and it freed its cache to retry (its
    `num_alloc_retries`: a sign of fragmentation near the limit); None without CUDA."""
    cuda_num_ooms: int | None = None
    """Out-of-memory errors the allocator raised over the region (its `num_ooms`); None without CUDA."""
    cuda_peak_pinned_bytes: int | None = None
    """The pinned-host allocator's peak of active bytes over the region; None off CUDA or unreported."""
    host_peak_bytes: int = 0
    """Most bytes live at once in the host pool (offloaded copies; not part of `peak_bytes`)."""
    host_end_bytes: int = 0
    """Bytes live in the host pool at exit."""
    to_host_bytes: int = 0
    """Bytes copied from device memory into the host pool over the region."""
    to_device_bytes: int = 0
    """Bytes copied from the host pool back into device memory over the region."""

    peak_gib = gib_of("peak_bytes")
    cuda_peak_allocated_gib = gib_of("cuda_peak_allocated_bytes")
    cuda_peak_reserved_gib = gib_of("cuda_peak_reserved_bytes")

    @property
    def peak_breakdown_gib(self) -> dict[str, float]:
        return {name: bytes_to_gib(n) for name, n in self.peak_breakdown_bytes.items()}
