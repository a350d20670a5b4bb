"""Step time: warm-up steps, then timed repeats, summarised as p20 / p50 / p80 (ms).

On CUDA each repeat is timed with CUDA events inside a `CudaPeak` (so the allocator's alloc retries and
OOMs over the timed steps come with it); elsewhere with the wall clock. A timed step of a `StepSpec` is
`timed_step(setup, device)`: the one definition of what is timed (`spec_step`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from streambp_core.config import ConfigError
from streambp_core.measure.cuda import CudaPeak
from streambp_core.step.run.setup import Setup, reset_grads


@dataclass(frozen=True, kw_only=True)
class Timing:
    """Timed repeats (ms) and the CUDA allocator's retries and OOMs over them (None off CUDA)."""

    times_ms: tuple[float, ...]
    alloc_retries: int | None = None
    num_ooms: int | None = None

    def percentile_ms(self, q: int) -> float:
        """The q-th percentile of the repeats (linear interpolation; one repeat is every percentile)."""
        if len(self.times_ms) == 1:
            return self.times_ms[0]
        return statistics.quantiles(self.times_ms, n=100, method="inclusive")[q - 1]

    @property
    def p20_ms(self) -> float:
        return self.percentile_ms(20)

    @property
    def p50_ms(self) -> float:
        """The median: the figure to quote."""
        return statistics.median(self.times_ms)

    @property
    def p80_ms(self) -> float:
        return self.percentile_ms(80)

    def columns(self, *, counters: bool = True) -> dict[str, float | int | None]:
        """As result-row fields: p50 (step_time_ms), p20, p80 and, with `counters`, the allocator's
        retries and OOMs over the timed steps."""
        times = {"step_time_ms": self.p50_ms, "step_time_p20_ms": self.p20_ms,
                 "step_time_p80_ms": self.p80_ms}
        counted = {"alloc_retries": self.alloc_retries, "num_ooms": self.num_ooms} if counters else {}
        return {**times, **counted}


def time_step(step: Callable[[], object], device: str, *, warmup: int = 1, repeats: int = 5) -> Timing:
    """Call `step()` `warmup` times untimed, then `repeats` times timed (see the module docstring)."""
    if warmup < 0 or repeats < 1:
        raise ConfigError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    for _ in range(warmup):
        step()
    if device == "cuda":
        with CudaPeak() as peak:
            times = [_cuda_event_ms(step) for _ in range(repeats)]
        return Timing(times_ms=tuple(times), alloc_retries=peak.num_alloc_retries, num_ooms=peak.num_ooms)
    return Timing(times_ms=tuple(_wall_ms(step) for _ in range(repeats)))


@contextmanager
def spec_step(setup: Setup) -> Iterator[Callable[[], None]]:
    """`step()`: one step of `setup.spec` on its model, prepared for the spec's method with its stream
    (closed on exit): gradients as the step starts (`setup.reset_grads`), the loss, its backward, then
    the optimizer's step (gradients set to None) when the spec has one."""
    from streambp_core.methods import prepare

    spec, model, optimizer = setup.spec, setup.model, setup.optimizer

    def step() -> None:
        reset_grads(model, spec)
        run.loss(**setup.inputs).backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    with prepare(model, spec.method, spec.stream) as run:
        yield step


def timed_step(setup: Setup, device: str, *, warmup: int = 1, repeats: int = 5) -> Timing:
    """`time_step` of one step of `setup.spec` (`spec_step`) on `device`."""
    with spec_step(setup) as step:
        return time_step(step, device, warmup=warmup, repeats=repeats)


def _wall_ms(step: Callable[[], object]) -> float:
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


def _cuda_event_ms(step: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))
