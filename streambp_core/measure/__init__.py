"""Memory measurement instruments: category tags, the live-tensor tracker, CUDA allocator/NVML helpers.

    from streambp_core.measure import MemoryTracker, memory_category, CHECKPOINTS

    with MemoryTracker(model) as tracker:
        loss = run.loss(input_ids, labels=labels)
        loss.backward()
    tracker.result().peak_breakdown_bytes
"""

from streambp_core.measure.cuda import (
    CudaPeak,
    DeviceInfo,
    cuda_available,
    device_info,
    is_oom,
)
from streambp_core.measure.result import TrackerResult
from streambp_core.measure.tags import (
    CATEGORIES,
    CHECKPOINTS,
    GRADS,
    KV,
    LOGITS,
    OPTIMIZER,
    TEMPORARIES,
    WEIGHTS,
    current_category,
    memory_category,
)
from streambp_core.measure.tracker import MemoryTracker
from streambp_core.measure.units import GIB, bytes_to_gib

__all__ = [
    "CATEGORIES",
    "CHECKPOINTS",
    "GIB",
    "GRADS",
    "KV",
    "LOGITS",
    "OPTIMIZER",
    "TEMPORARIES",
    "WEIGHTS",
    "CudaPeak",
    "DeviceInfo",
    "MemoryTracker",
    "TrackerResult",
    "bytes_to_gib",
    "cuda_available",
    "current_category",
    "device_info",
    "is_oom",
    "memory_category",
]
