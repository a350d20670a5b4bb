"""Kernel time of a profiled step, by kind of kernel: where a method's step time goes.

`kernel_time_by_class(profiler.key_averages())` keeps the device-side events (the kernels themselves, not
the CPU ops that launched them, whose device time would count the same kernels twice) and sums their
self time per class; `device="cpu"` takes the CPU ops' self time instead (a CPU run has no kernels).
A kernel's class comes from its name, first match wins (`KERNEL_CLASSES`): attention backward, attention
forward, GEMM, copy, then everything else as elementwise/other. `profile_kernel_time(step)` profiles one
call of `step` and returns that breakdown.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

KERNEL_CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention_bwd", re.compile(r"(flash|fmha|attn|attention|sdpa).*(bwd|backward|bprop)|"
                                 r"(bwd|backward).*(flash|fmha|attn|attention)|fmha_cutlassB", re.I)),
    ("attention_fwd", re.compile(r"flash|fmha|attn|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|xmma|cutlass|cublas|nvjet|wgmma|matmul|splitk|^aten::(mm|bmm|addmm)$", re.I)),
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
    self_time_ms: float
    launches: int


def kernel_time_by_class(events: Iterable, device: str = "cuda") -> list[KernelTime]:
    """Per class, the summed self time (ms) and count of the profiler averages that ran on `device`
    (objects with `key`, `device_type`, `count` and self times in microseconds)."""
    totals: dict[str, list[float]] = {}
    for event in events:
        on_cpu = "CPU" in str(getattr(event, "device_type", "CPU"))
        if on_cpu != (device == "cpu"):
            continue
        self_us = event.self_cpu_time_total if on_cpu else event.self_device_time_total
        total = totals.setdefault(kernel_class(event.key), [0.0, 0])
        total[0] += self_us / 1e3
        total[1] += event.count
    order = [label for label, _ in KERNEL_CLASSES] + [OTHER]
    return [KernelTime(kernel_class=label, self_time_ms=totals[label][0], launches=int(totals[label][1]))
            for label in order if label in totals]


def profile_kernel_time(step: Callable[[], object], device: str) -> list[KernelTime]:
    """Profile one call of `step` on `device` (cuda or cpu) and sum its kernels by class."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    return kernel_time_by_class(prof.key_averages(), device)
