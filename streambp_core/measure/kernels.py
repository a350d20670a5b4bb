"""GPU kernel time of a profiled step, by kind of kernel: where a method's step time goes.

`kernel_time_by_class(profiler.key_averages())` keeps the device-side events (the kernels themselves, not
the CPU ops that launched them, whose device time would count the same kernels twice) and sums their
time per class. A kernel's class comes from its name, first match wins (`KERNEL_CLASSES`):
attention backward, attention forward, GEMM, copy, then everything else as elementwise/other.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

KERNEL_CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention_bwd", re.compile(r"(flash|fmha|attn|attention|sdpa).*(bwd|backward|bprop)|"
                                 r"(bwd|backward).*(flash|fmha|attn|attention)|fmha_cutlassB", re.I)),
    ("attention_fwd", re.compile(r"flash|fmha|attn|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|xmma|cutlass|cublas|nvjet|wgmma|matmul|splitk", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset|cat_|catarray", re.I)),
)
"""(class, kernel-name pattern), tried in order."""
OTHER = "elementwise_other"


def kernel_class(name: str) -> str:
    """The class of a kernel called `name` (OTHER when no pattern matches)."""
    return next((label for label, pattern in KERNEL_CLASSES if pattern.search(name)), OTHER)


@dataclass(frozen=True, kw_only=True)
class KernelTime:
    """Device time and launch count of one class of kernels."""

    kernel_class: str
    device_time_ms: float
    launches: int


def kernel_time_by_class(events: Iterable) -> list[KernelTime]:
    """Per class, the summed device time (ms) and count of the device events among profiler averages
    (objects with `key`, `device_type`, `self_device_time_total` in microseconds and `count`)."""
    totals: dict[str, list[float]] = {}
    for event in events:
        if "CPU" in str(getattr(event, "device_type", "CPU")):
            continue
        total = totals.setdefault(kernel_class(event.key), [0.0, 0])
        total[0] += event.self_device_time_total / 1e3
        total[1] += event.count
    order = [label for label, _ in KERNEL_CLASSES] + [OTHER]
    return [KernelTime(kernel_class=label, device_time_ms=totals[label][0], launches=int(totals[label][1]))
            for label in order if label in totals]
