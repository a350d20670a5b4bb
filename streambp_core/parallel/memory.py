"""One rank's memory under torch FSDP2, measured: the sharded step run for real on CPU ranks (gloo) under
the memory tracker, the counterpart of the sharded simulation (`StepSpec.gpus`/`shard`, `step.parts.shards`).

`measure_ranks(specs)` starts `gpus` ranks (`launch.run_ranks`). For each spec in turn, each rank builds
the spec's model with seeded weights, shards it (`fsdp.shard_model`: one unit per decoder layer, and the
root), makes its optimizer over the shards with its moments in place (`setup.build_training_model`), has
FSDP2 allocate its unsharded parameters once (`fsdp.gathered_parameters`, so the tracker can follow
their in-place frees and re-allocations) and runs the spec's step under the tracker (`run.tracked_step`).
Ranks are symmetric (each runs the same sequences here); rank 0's figures come back.

What the tracker sees of a rank: its parameter, gradient and optimizer shards (a `DTensor`'s local
shard), the unsharded parameters while FSDP2 holds them allocated, FSDP2's flat all-gather and
reduce-scatter buffers (op outputs), activations. Not seen: what gloo allocates inside a collective (its
own buffers, outside any op the tracker watches; nccl's are outside CUDA's caching allocator too).

Against the simulation (tests/unit/test_parallel_memory.py): the simulated rank is an upper bound, over by
at most what it assumes in flight beyond what FSDP2 holds at the peak (it allows the root's and two
layers' unsharded gradients throughout the backward and, zero3, two gathered layers), and under only by
CPU artefacts: AdamW's step counters (host tensors on CUDA) and the CPU attention kernel's extra copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from transformers import PretrainedConfig

from streambp_core.config import FSDP_STAGES, ConfigError, StepSpec
from streambp_core.parallel.launch import DEFAULT_TIMEOUT_S, check_nproc, run_ranks
from streambp_core.step.parts.resolved import ResolvedModel, resolved

SOURCE = "measured-cpu"


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """One rank's tracked peak over a sharded step on CPU ranks (FSDP2 or DeepSpeed ZeRO), by category and
    by phase."""

    spec: StepSpec
    peak_bytes: int
    breakdown_bytes: dict[str, int]
    """Bytes per category at the peak; they sum to `peak_bytes`."""
    phase_peaks_bytes: dict[str, int]
    """Each phase's peak (forward, backward, embedding backward, optimizer)."""
    source: str = SOURCE

    @property
    def how(self) -> str:
        """How the figures were obtained, in words."""
        engine = (f"DeepSpeed ZeRO-{self.spec.shard[-1]}" if self.spec.shard.startswith("deepspeed-")
                  else f"torch FSDP2 {self.spec.shard}")
        return f"measured by the tracker on rank 0 of {self.spec.gpus} CPU ranks (gloo), {engine}"


def measure_ranks(specs: Sequence[StepSpec], model: ResolvedModel | PretrainedConfig | None = None, *,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> list[RankMemory]:
    """Rank 0's tracked step of each spec, in order, on one set of `gpus` CPU ranks (module docstring).

    The specs share a model and a rank count; shard is zero2 or zero3. ConfigError for anything else,
    more ranks than cores, or a step the RAM cannot hold.
    """
    if not specs:
        raise ConfigError("give at least one spec")
    if len({(spec.model, spec.gpus) for spec in specs}) != 1:
        raise ConfigError("measured ranks run one model on one rank count; the specs differ")
    for spec in specs:
        if spec.shard not in FSDP_STAGES:
            raise ConfigError(f"a rank is measured under torch FSDP2 ({', '.join(FSDP_STAGES)}), "
                              f"got shard {spec.shard}")
    check_nproc(specs[0].gpus, "cpu")
    model = resolved(specs[0].model, model)
    for spec in specs:
        _check_ram(spec, model)
    steps = run_ranks(_rank_steps, specs[0].gpus, args=(tuple(specs), model.config), timeout_s=timeout_s)[0]
    return [_rank_memory(spec, phases) for spec, phases in zip(specs, steps, strict=True)]


def _rank_memory(spec: StepSpec, phases: list[tuple[str, int, dict[str, int]]]) -> RankMemory:
    _, peak, breakdown = max(phases, key=lambda phase: phase[1])
    return RankMemory(spec=spec, peak_bytes=peak, breakdown_bytes=breakdown,
                      phase_peaks_bytes={name: bytes_ for name, bytes_, _ in phases})


def _check_ram(spec: StepSpec, model: ResolvedModel) -> None:
    """ConfigError when the ranks together would need more RAM than a CPU step may use."""
    from streambp_core.measure import host_ram
    from streambp_core.step.search.probe import cpu_ram_refusal

    refusal = cpu_ram_refusal(spec, model, host_ram.available_ram_bytes() // spec.gpus)
    if refusal is not None:
        raise ConfigError(f"each of {spec.gpus} ranks {refusal}")


def _rank_steps(rank: int, world: int, specs: tuple[StepSpec, ...], config: PretrainedConfig
                ) -> list[list[tuple[str, int, dict[str, int]]]]:
    """Body of each rank: per spec, a freshly built and sharded setup and one tracked step; per phase
    (name, peak, breakdown)."""
    from streambp_core.parallel.fsdp import gathered_parameters, shard_model
    from streambp_core.step.run.setup import build_setup, build_training_model
    from streambp_core.step.run.tracked import tracked_step

    steps = []
    for spec in specs:
        wrap = partial(shard_model, stage=spec.shard)
        model, optimizer = build_training_model(spec, config, "cpu", wrap=wrap)
        gathered = gathered_parameters(model)
        setup = build_setup(spec, config, "cpu", model=model, optimizer=optimizer)
        record = tracked_step(setup, "cpu", gathered=gathered)
        steps.append([(phase.name, phase.result.peak_bytes, dict(phase.result.peak_breakdown_bytes))
                      for phase in record.phases])
        del setup, model, optimizer, gathered
    return steps
