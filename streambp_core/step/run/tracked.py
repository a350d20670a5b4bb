"""One tracked step: forward, backward and optimizer step under a `MemoryTracker`, cut into phases.

The same function runs a simulated step (meta tensors, memoised meta kernels, thinned chunk loops) and
a measured one (CPU tensors by the tracker, CUDA by the caching allocator). Phases, each with its own
peak: `forward`; `backward` down to the embedding's output gradient; `embedding backward` (its dense
vocab x hidden gradient does not grow with depth; absent when the embedding's output needs no gradient,
e.g. LoRA); `optimizer` (when the step has one). Per phase the peak is affine in the model's depth, which
is what lets the simulator extrapolate each one from two shallow depths.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from streambp_core.config import ConfigError
from streambp_core.engine.sequence.group import SequenceGroup
from streambp_core.measure.cuda import is_oom
from streambp_core.measure.result import TrackerResult
from streambp_core.measure.tags import OFFLOADED, WEIGHTS
from streambp_core.measure.tracker import MemoryTracker
from streambp_core.methods import prepare
from streambp_core.models.adapters import decoder_parts
from streambp_core.step.parts.host_pool import host_pool_tensors
from streambp_core.step.run.protocol import step_protocol
from streambp_core.step.run.setup import Setup
from streambp_core.step.run.simulation_mode import SimulationMode, checkpoint_tags


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One phase of a tracked step: its name and the tracker's figures over it."""

    name: str
    result: TrackerResult
    device: str
    """Where the step ran: 'meta', 'cpu' or 'cuda'."""

    @property
    def peak_bytes(self) -> int:
        """The tracker's peak, or on CUDA the caching allocator's."""
        cuda = self.result.cuda_peak_allocated_bytes
        return cuda if self.device == "cuda" and cuda is not None else self.result.peak_bytes


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """The phases of one tracked step (see the module docstring)."""

    phases: tuple[Phase, ...]

    @property
    def peak(self) -> Phase:
        """The phase with the highest peak."""
        return max(self.phases, key=lambda phase: phase.peak_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak.peak_bytes

    @property
    def breakdown_bytes(self) -> dict[str, int]:
        """Bytes by category at the step's peak (the tracker's)."""
        return dict(self.peak.result.peak_breakdown_bytes)

    def host_figures(self) -> dict[str, int]:
        """The host pool over the step, as `ProbeResult` fields: its peak over the phases (on CUDA at
        least the pinned-host allocator's peak, where reported), and the bytes copied each way (the
        tracker counts them from the step's start)."""
        results = [phase.result for phase in self.phases]
        pinned = max((r.cuda_peak_pinned_bytes or 0 for r in results), default=0)
        last = results[-1] if results else None
        return {
            "host_peak_bytes": max([pinned, *(r.host_peak_bytes for r in results)]),
            "to_host_bytes": last.to_host_bytes if last else 0,
            "to_device_bytes": last.to_device_bytes if last else 0,
        }

    def cuda_figures(self) -> dict[str, int | None]:
        """The allocator's reserved peak, and its alloc retries and OOMs summed over the phases (None
        off CUDA), as `ProbeResult` fields."""
        results = [phase.result for phase in self.phases]
        if not results or results[0].cuda_peak_reserved_bytes is None:
            return {"peak_reserved_bytes": None, "alloc_retries": None, "num_ooms": None}
        return {
            "peak_reserved_bytes": max(r.cuda_peak_reserved_bytes or 0 for r in results),
            "alloc_retries": sum(r.cuda_num_alloc_retries or 0 for r in results),
            "num_ooms": sum(r.cuda_num_ooms or 0 for r in results),
        }


class StepOutOfMemory(MemoryError):
    """A tracked step ran out of memory; `record` holds the phases up to the failure (the last one,
    `oom`, with the tracker's and allocator's figures at that point)."""

    def __init__(self, message: str, record: StepRecord) -> None:
        super().__init__(message)
        self.record = record


class _Phases:
    """Consecutive phases of a tracked step: `cut(name)` closes one and starts the next."""

    def __init__(self, tracker: MemoryTracker, device: str) -> None:
        self.tracker, self.device = tracker, device
        self.phases: list[Phase] = []

    def cut(self, name: str) -> None:
        self.phases.append(Phase(name=name, result=self.tracker.result(), device=self.device))
        self.tracker.reset_peak()


@contextmanager
def _embedding_cut(model, phases: _Phases) -> Iterator[list[bool]]:
    """Cut the backward when the gradient of the embedding's output arrives; yields [whether it did]."""
    fired = [False]

    def on_gradient(_grad) -> None:
        fired[0] = True
        phases.cut("backward")

    def on_embedding(module, inputs, output) -> None:
        if output.requires_grad:
            output.register_hook(on_gradient)

    handle = decoder_parts(model).embed.register_forward_hook(on_embedding)
    try:
        yield fired
    finally:
        handle.remove()


def tracked_step(
    setup: Setup, device: str, *, keep_chunks: int | None = None, cache: dict | None = None,
    gathered: Iterable[torch.Tensor] = (),
) -> StepRecord:
    """Run one step of `setup` on `device` ('meta', 'cpu' or 'cuda') under the tracker, phase by phase.

    Steps: prepare the model for the spec's method (`keep_chunks` thins its chunk loops: meta only);
    under the spec's protocol, the tracker and `SimulationMode` (memoised meta kernels, `cache` shared
    between steps; the logits category), tag the forward's checkpoints, then `run.loss(...)`,
    `loss.backward()` and the optimizer step, cutting a phase after each (and at the embedding's output
    gradient); close the run whatever happens. `gathered`: a sharded model's unsharded parameters
    (`parallel.fsdp.gathered_parameters`), counted as weights while FSDP2 holds them allocated.
    """
    spec, model, optimizer = setup.spec, setup.model, setup.optimizer
    run = prepare(model, spec.method, spec.stream, keep_chunks=keep_chunks,
                  sequence_group=sequence_group(spec, device))
    try:
        with step_protocol(run, spec.protocol), MemoryTracker(model, optimizer, device=device) as tracker:
            tracker.track_resizable(gathered, WEIGHTS)
            host = host_pool_tensors(run, optimizer)
            if host:  # host copies were counted as device weights until filed as host
                tracker.track(host, OFFLOADED)
                tracker.reset_peak()
            phases = _Phases(tracker, device)
            with (
                SimulationMode(setup.config.vocab_size, cache, tracker),
                checkpoint_tags(model, tracker) as forward,
                _embedding_cut(model, phases) as embedding_cut,
            ):
                try:
                    _step(run, setup, forward, phases, embedding_cut, cache if device == "meta" else None)
                except Exception as exc:
                    if not is_oom(exc):
                        raise
                    phases.cut("oom")
                    message = str(exc).split("\n")[0]
                    raise StepOutOfMemory(message, StepRecord(phases=tuple(phases.phases))) from exc
    except BaseException:
        _close_failed(run)
        raise
    run.close()
    return StepRecord(phases=tuple(phases.phases))


def _close_failed(run) -> None:
    """Close the run of a step that failed: running out of memory while closing (the params tier putting
    every weight back on a device the failed step left full) must not hide why the step failed (e.g. pinned
    host memory), so such an error is dropped; any other propagates."""
    try:
        run.close()
    except Exception as exc:
        if not is_oom(exc):
            raise


def sequence_group(spec, device: str) -> SequenceGroup | None:
    """The step's sequence group: rank 0 of `spec.sp`, simulated (its all-to-alls allocate on meta what a
    real one returns and move nothing); None without sequence parallelism. Real ranks are `verify`'s."""
    if spec.sp == 1:
        return None
    if device != "meta":
        raise ConfigError(f"a sequence-parallel step (sp {spec.sp}) is simulated here: one rank on meta "
                          "tensors; real ranks run under verify sp")
    return SequenceGroup.simulated(spec.sp)


def _step(run, setup: Setup, forward, phases: _Phases, embedding_cut: list[bool], memo: dict | None) -> None:
    """Loss, backward and optimizer step, cutting a phase after each (the optimizer's through `memo`, a
    simulation's: `_optimizer_phase`)."""
    loss = run.loss(**setup.inputs)
    forward.done = True
    phases.cut("forward")
    loss.backward()
    phases.cut("embedding backward" if embedding_cut[0] else "backward")
    if setup.optimizer is not None:
        _optimizer_phase(setup.optimizer, phases, memo)


def _optimizer_phase(optimizer: torch.optim.Optimizer, phases: _Phases, memo: dict | None) -> None:
    """The optimizer step and `zero_grad(set_to_none=True)`, cut as a phase.

    A simulated step (`memo`, meta tensors) of torch's AdamW runs its step once per `_optimizer_key`
    (the parameters' shapes and dtypes, which of them hold a gradient and of what, the optimizer's state
    and options): what the step allocates and frees on top of what is live at its start is all the key's,
    so another step with the same key takes the phase's peak and activation peak as those increments on
    its own start, and runs only `zero_grad` (the end is tracked as it happens). The same figures to the
    byte (tests/unit/test_simulate.py), without the per-parameter ops of a step whose values a meta tensor
    has none of: a fifth of a simulated training step of a 36-layer model."""
    key = _optimizer_key(optimizer) if memo is not None and type(optimizer) is torch.optim.AdamW else None
    tracker = phases.tracker
    start = tracker.result()
    known = memo.get(key) if key is not None else None
    if known is None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        phases.cut("optimizer")
        if key is not None:
            result = phases.phases[-1].result
            memo[key] = (result.peak_bytes - start.end_bytes,
                         _minus(result.peak_breakdown_bytes, start.end_breakdown_bytes),
                         _minus(result.activation_peak_breakdown_bytes, start.end_breakdown_bytes))
        return
    rise, at_peak, at_activation_peak = known
    optimizer.zero_grad(set_to_none=True)
    end = tracker.result()
    phases.phases.append(Phase(name="optimizer", device=phases.device, result=replace(
        end, peak_bytes=start.end_bytes + rise,
        peak_breakdown_bytes=_plus(start.end_breakdown_bytes, at_peak),
        activation_peak_breakdown_bytes=_plus(start.end_breakdown_bytes, at_activation_peak))))
    tracker.reset_peak()


def _optimizer_key(optimizer: torch.optim.Optimizer) -> tuple | None:
    """What an AdamW step's allocations depend on: per parameter its layout and its gradient's, per group
    its options, and its state's tensors (`_optimizer_phase`); None where an option is unhashable."""
    def tensor(t: torch.Tensor | None) -> tuple | None:
        return None if t is None else (tuple(t.shape), t.stride(), t.dtype)

    groups = []
    for group in optimizer.param_groups:
        params = tuple((tensor(p), tensor(p.grad),
                        tuple(sorted((name, tensor(value) if isinstance(value, torch.Tensor) else value)
                                     for name, value in optimizer.state.get(p, {}).items())))
                       for p in group["params"])
        options = tuple(sorted((name, tensor(value) if isinstance(value, torch.Tensor) else value)
                               for name, value in group.items() if name != "params"))
        groups.append((params, options))
    key = ("optimizer phase", tuple(groups))
    try:
        hash(key)
    except TypeError:  # an option the key cannot hold: the step runs
        return None
    return key


def _minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {name: a[name] - b[name] for name in a}


def _plus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {name: a[name] + b[name] for name in a}
