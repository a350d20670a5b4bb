"""Predict a training step's peak GPU memory on a CPU: run the real step on meta tensors, tracked.

`simulate(spec)` builds the model on the meta device (weights are never materialised), sets it up as a
GPU run would (`setup.build_setup`: LoRA, optimizer state, resident or fresh gradients, inputs), runs
one `run.tracked_step` and returns the peak bytes and the breakdown by category at the peak. Attention
allocates what flash attention allocates (output and float32 log-sum-exp: the engine's custom op).

Categories at the peak: weights, grads, optimizer, checkpoints (layer inputs kept from forward for
backward: StreamBP's `H_in`, and for the baselines the embedding and decoder-layer outputs, which
transformers' checkpointing keeps), kv (StreamBP's per-layer K/V and their gradients), logits (any tensor
whose last dimension is the vocabulary and that has a token dimension), temporaries (everything else; for
`plain` that includes every activation autograd saves).

Speed, as parameters (nothing is patched):
- `depth="extrapolate"`: the step is simulated at two shallow depths made of whole periods of the
  model's layer pattern (`step.parts.depth.depth_plan`: 2 and 3 layers for a uniform model; 2 and 4 for
  Gemma 2's sliding/full alternation, 4 and 8 for Qwen3.5's and Llama 4's period of 4, 4 and 5 for
  DeepSeek-V3 after its 3 dense layers), every per-layer property at its index, and each phase's figures
  are extrapolated linearly in whole periods, f(L) = f(d1) + (L - d1) / P * (f(d1 + P) - f(d1)); when
  that gives a negative category (the peak moved between sub-phases) every layer is simulated instead.
  Exact to the byte against `depth="full"` in the tests; a max-length search confirms its answer at full depth
  (`probe.max_len`), since the step's peak (a maximum of affine phases) can only be under-estimated;
  one sharded rank's layout of extrapolated categories may also over-estimate it: there the search
  confirms both ends of its bracket.
- `keep_chunks` (default `KEEP_CHUNKS`): every engine chunk loop runs only its first and last 3 chunks
  (`StreamConfig.keep_chunks`): chunks differ only in position, what outlives a chunk is preallocated,
  and a chunk's memory grows with its prefix. 3 because the backward's first chunk may be partial, and a
  chunk can peak while what the previous one left is still held: the third is the first full chunk whose
  predecessor is full too (2 missed such a peak, see the tests). Equal to all chunks to the byte in the
  tests (`keep_chunks=None`), over random shapes, objectives, offload and sharding too.
- `model`: the model resolved once (`step.parts.resolved.ResolvedModel`): its config, its depth variants, and
  the memo of meta kernels' output metadata (`simulation_mode.SimulationMode`) and of the shard layout of
  a sharded step's model, shared by every call on it; the memo also holds each answer (a spec asked
  again is not simulated again), each depth's phases of the step as one GPU runs it (the shard stages of
  one step lay out the same phases) and the meta model and optimizer a step is built on (reused across
  lengths, partitions and stages, its gradients reset).

One rank of `spec.gpus` (`spec.shard` not "none"; ranks are symmetric, each on its own sequences): the
step is simulated as one GPU runs it, then each phase's figures at its peak, at its activation peak (the
most bytes outside the model state: `measure.ledger`) and at its end are laid out as the shard stage
holds the model state (`streambp_core.step.parts.shards`): weights, gradients and optimizer state become
the rank's shards plus what the stage keeps gathered or in flight, activations stay the rank's own. The
highest of those points is the rank's peak. Two points per phase because one GPU and one rank may peak
at different places: one GPU's backward peaks at its end, every gradient held, when its state outweighs
its activations; a rank holding a shard of that state peaks where the activations do (a streamed LM
head's logits, before any layer's gradient). Gradients only grow within a phase, and a phase's start
(the previous one's end) is a point too, so a peak that moves earlier when gradients shrink is still
seen. With its host pool: the rank's share of the optimizer's host state
(`sequence_layout.sharded_host`). Under `deepspeed-zero3` with the optimizer or params tier, DeepSpeed's
own offload holds them: the step runs with the checkpoints tier only and the rank is laid out as
DeepSpeed holds it (`deepspeed_host`).

One rank of a sequence-parallel step (`spec.sp` > 1; the sp ranks among the `gpus` shard ranks, as ALST
runs them): the step runs through the engine's Ulysses code path with a simulated group
(`SequenceGroup.simulated`: its all-to-alls allocate their send and receive buffers and outputs as a
real rank's do, on meta, and move nothing), on the rank's shard of the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from streambp_core.config import ConfigError, StepSpec, require_sized
from streambp_core.measure.cuda import HostMemoryFailure, is_oom
from streambp_core.measure.tags import CATEGORIES
from streambp_core.measure.units import gib_of
from streambp_core.models.adapters import MOE_FAMILIES
from streambp_core.models.catalogue import serving
from streambp_core.models.generic import step_failure
from streambp_core.step.parts.depth import DepthPlan
from streambp_core.step.parts.resolved import ResolvedModel, resolved
from streambp_core.step.parts.shards import ShardLayout, check_sharded_params, rank_breakdown
from streambp_core.step.run.setup import build_setup, build_training_model
from streambp_core.step.run.tracked import tracked_step
from streambp_core.step.simulation.deepspeed_host import check_deepspeed_offload, deepspeed_host, engine_spec
from streambp_core.step.simulation.sequence_layout import (
    SequenceLayout,
    check_sequence_parallel,
    sharded_host,
)

KEEP_CHUNKS = 3
"""Chunks kept at each end of an engine chunk loop when thinning."""
DEPTHS = ("extrapolate", "full")



@dataclass(frozen=True)
class PhaseFigures:
    """One phase of a simulated step: its name, its peak bytes, the bytes by category at the peak, at the
    activation peak (the most bytes outside the model state: `StorageLedger`) and at its end (the points a
    sharded rank's layout is applied to)."""

    name: str
    peak_bytes: int
    at_peak: dict[str, int]
    at_activation_peak: dict[str, int]
    at_end: dict[str, int]

    @property
    def points(self) -> tuple[dict[str, int], ...]:
        """The breakdowns a sharded rank is laid out at, by the phase's own name (the end's may differ)."""
        return self.at_peak, self.at_activation_peak


@dataclass(frozen=True)
class HostFigures:
    """The host pool of a simulated step: its peak and the bytes copied each way (affine in depth)."""

    peak_bytes: int
    to_host_bytes: int
    to_device_bytes: int


@dataclass(frozen=True)
class SteppedFigures:
    """What one simulated step at one depth gives: its phases and its host pool."""

    phases: list[PhaseFigures]
    host: HostFigures


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Peak memory of one simulated training step (GiB = 2**30 bytes)."""

    spec: StepSpec
    num_layers: int
    """Decoder layers of the model the figures are for."""
    layers_simulated: tuple[int, ...]
    """Depths actually simulated: two shallow ones when extrapolated (`step.parts.depth.DepthPlan.depths`),
    (num_layers,) otherwise."""
    peak_bytes: int
    breakdown_bytes: dict[str, int]
    """Bytes per category at the peak; they sum to `peak_bytes`."""
    source: str = "simulated"
    host_peak_bytes: int = 0
    """Peak of the host pool (checkpoints offloaded to host memory); not part of `peak_bytes`."""
    to_host_bytes: int = 0
    """Bytes copied device -> host over the step."""
    to_device_bytes: int = 0
    """Bytes copied host -> device over the step."""
    note: str = ""
    """How the figures go beyond the simulated step, in words (one sequence-parallel rank's account)."""

    host_gib = gib_of("host_peak_bytes")
    peak_gib = gib_of("peak_bytes")

    @property
    def full_depth(self) -> bool:
        """Whether every layer was simulated (no extrapolation)."""
        return self.layers_simulated == (self.num_layers,)

    @property
    def how(self) -> str:
        """How the figures were obtained, in words."""
        rank = "" if self.spec.shard == "none" else f"; one rank of {self.spec.gpus}, {self.spec.shard}"
        rank += f"; {self.note}" if self.note else ""
        if self.full_depth:
            return f"simulated on meta tensors, all {self.num_layers} layers{rank}"
        a, b = self.layers_simulated
        return f"simulated on meta tensors with {a} and {b} layers, extrapolated to {self.num_layers}{rank}"


def simulate(
    spec: StepSpec,
    model: ResolvedModel | PretrainedConfig | str | None = None,
    *,
    depth: str = "extrapolate",
    keep_chunks: int | None = KEEP_CHUNKS,
) -> SimResult:
    """Simulate one step of `spec` on `model` (resolved once by the caller, `ResolvedModel`; None: the
    spec's model, resolved here).

    Steps: simulate at the model's two shallow depths (`ResolvedModel.depth_plan`; at full depth when
    `depth="full"` or no shallower pair of whole periods exists), cutting the step into phases;
    extrapolate each phase's peak and categories linearly in whole periods; the highest phase is the
    step's peak; a negative category falls back to full depth.
    """
    if depth not in DEPTHS:
        raise ConfigError(f"depth must be one of {', '.join(DEPTHS)}, got {depth!r}")
    require_sized(spec.stream)
    model = resolved(spec.model, model)
    key = ("simulate", spec, depth, keep_chunks)
    result = model.memo.get(key) or _simulate(spec, model, depth, keep_chunks)
    model.memo[key] = result
    return result


def _simulate(spec: StepSpec, model: ResolvedModel, depth: str, keep_chunks: int | None) -> SimResult:
    """`simulate`'s figures, computed (its docstring's steps)."""
    config = model.config
    if config.model_type in MOE_FAMILIES and spec.dtype != "bfloat16":
        raise ConfigError(
            f"a mixture-of-experts step is simulated in bfloat16 only ({spec.model} in {spec.dtype}): the "
            "experts' grouped matmul has a bfloat16 meta kernel only, and their per-expert loop picks tokens "
            "by value, which meta tensors have none of; measure it on cpu or cuda"
        )
    check_sequence_parallel(spec, config)
    check_deepspeed_offload(spec)
    check_sharded_params(spec)
    total = config.num_hidden_layers
    plan = model.depth_plan if depth == "extrapolate" else None
    depths = (total,) if plan is None else plan.depths
    stepped = engine_spec(spec)  # DeepSpeed's offload sections hold what they hold instead of the tiers
    measured = [_stepped(stepped, model.at_depth(n), keep_chunks, model.memo) for n in depths]
    figures = measured[0] if plan is None else _extrapolate(*measured, plan)
    if _negative(figures.phases, sharded=spec.shard != "none"):
        depths = (total,)  # the peak moved between sub-phases: simulate every layer
        figures = _stepped(stepped, config, keep_chunks, model.memo)
    peak, by_category = (_largest(figures.phases) if spec.shard == "none"
                         else _rank_peak(spec, config, figures.phases, model.memo))
    host = (figures.host.peak_bytes, figures.host.to_host_bytes, figures.host.to_device_bytes)
    if stepped is not spec:  # DeepSpeed's host buffers and copies, on the checkpoints tier's
        host = deepspeed_host(spec, shard_layout(spec, config, model.memo), host)
    elif spec.shard != "none":  # the rank's share of the optimizer's host state and copies
        fraction = shard_layout(spec, config, model.memo).trainable_fraction
        host = sharded_host(host, spec, config, fraction)
    note = SequenceLayout.of(spec, config).how() if spec.sp > 1 else ""
    return SimResult(spec=spec, num_layers=total, layers_simulated=depths, peak_bytes=peak,
                     breakdown_bytes=by_category, host_peak_bytes=host[0], to_host_bytes=host[1],
                     to_device_bytes=host[2], note=note)


def _stepped(spec: StepSpec, config: PretrainedConfig, keep_chunks: int | None, cache: dict
             ) -> SteppedFigures:
    """The phases (peak bytes, bytes by category at that peak and at the end) and the host pool of one
    simulated step of `config`. Memoised in `cache` per depth under the step as one GPU runs it: the shard
    stage only lays the figures out afterwards (`_rank_peak`), so the stages of one step share its
    simulation."""
    key = ("phases", single_gpu_step(spec), config.num_hidden_layers, keep_chunks)
    figures = cache.get(key) or _tracked(spec, config, keep_chunks, cache)
    cache[key] = figures
    return SteppedFigures(phases=[PhaseFigures(phase.name, phase.peak_bytes, dict(phase.at_peak),
                                               dict(phase.at_activation_peak), dict(phase.at_end))
                                  for phase in figures.phases],
                          host=figures.host)


def single_gpu_step(spec: StepSpec) -> StepSpec:
    """`spec` with every shard stage as one (zero3): the step a rank runs before its layout (the same
    ops and tensors whatever the stage, which only lays them out afterwards)."""
    return spec if spec.shard == "none" else spec.replaced(shard="zero3")


def _tracked(spec: StepSpec, config: PretrainedConfig, keep_chunks: int | None, cache: dict
             ) -> SteppedFigures:
    """`_stepped`'s figures, from one tracked meta step."""
    try:
        record = _baseline_step(spec, config, keep_chunks, cache)
    except Exception as exc:  # a meta step allocates no device memory: running out is the host's failure
        if not is_oom(exc):
            raise
        raise HostMemoryFailure(
            f"the simulation of {spec.model} at {spec.seq_len_tokens:,} tokens ran out of this machine's "
            "memory (a simulated step holds no real tensors, so this is no simulated out-of-memory)"
        ) from None
    host = record.host_figures()
    return SteppedFigures(
        phases=[PhaseFigures(phase.name, phase.result.peak_bytes, dict(phase.result.peak_breakdown_bytes),
                             dict(phase.result.activation_peak_breakdown_bytes),
                             dict(phase.result.end_breakdown_bytes)) for phase in record.phases],
        host=HostFigures(host["host_peak_bytes"], host["to_host_bytes"], host["to_device_bytes"]))


def _baseline_step(spec: StepSpec, config: PretrainedConfig, keep_chunks: int | None, cache: dict):
    """One tracked meta step of `spec`, on a meta model built once per depth and per what the build reads
    (kept in `cache`: a step at another length, partition or shard stage resets its gradients, as a
    measured search reuses its model across lengths); for a family of the baselines tier
    (`models.catalogue`), whose layers are transformers' own code, a step that cannot run on meta is a
    ConfigError naming why (`generic.step_failure`: an op without a meta kernel, a value read from a meta
    tensor)."""
    key = ("training_model", config.num_hidden_layers, spec.method, spec.stream.head_mode, spec.dtype,
           spec.seed, spec.lora_rank, spec.optimizer, spec.offload)
    built = cache.pop(key, None) or (None, None)
    try:
        setup = build_setup(spec, config, "meta", model=built[0], optimizer=built[1])
        record = tracked_step(setup, "meta", keep_chunks=keep_chunks, cache=cache)
        cache[key] = (setup.model, setup.optimizer)  # kept only after a step that closed cleanly
        return record
    except ConfigError:
        raise
    except Exception as exc:
        if is_oom(exc) or serving(config.model_type).path != "baselines":
            raise
        raise ConfigError(step_failure(spec.method, config.model_type, exc)) from None


def _negative(phases: list[PhaseFigures], *, sharded: bool) -> bool:
    """Whether an extrapolated breakdown that is used has a negative category (the peak's; a sharded
    step's uses every phase's peak, activation peak and end)."""
    if not sharded:
        return min(_largest(phases)[1].values()) < 0
    return any(min(at.values()) < 0 for phase in phases for at in (*phase.points, phase.at_end))


def _largest(phases: list[PhaseFigures]) -> tuple[int, dict[str, int]]:
    """The highest phase peak and its breakdown."""
    top = max(phases, key=lambda phase: phase.peak_bytes)
    return top.peak_bytes, top.at_peak


def _extrapolate(shallow: SteppedFigures, deep: SteppedFigures, plan: DepthPlan) -> SteppedFigures:
    """Each phase's peak and breakdowns extrapolated linearly in whole periods from the plan's depths.

    Phases keep the same shape at every depth, so within a phase the peak is affine in depth; across
    phases it is not (a shallow model may peak in the embedding's backward, a deep one while its
    checkpoints are alive), which is why phases are extrapolated separately.
    """
    def grow(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {k: plan.extend(a[k], b[k]) for k in CATEGORIES}

    a, b = shallow.host, deep.host
    return SteppedFigures(
        phases=[PhaseFigures(one.name, plan.extend(one.peak_bytes, two.peak_bytes),
                             *(grow(x, y) for x, y in ((one.at_peak, two.at_peak),
                                                      (one.at_activation_peak, two.at_activation_peak),
                                                      (one.at_end, two.at_end))))
                for one, two in zip(shallow.phases, deep.phases, strict=True)],
        host=HostFigures(plan.extend(a.peak_bytes, b.peak_bytes),
                         plan.extend(a.to_host_bytes, b.to_host_bytes),
                         plan.extend(a.to_device_bytes, b.to_device_bytes)))


def _rank_peak(spec: StepSpec, config: PretrainedConfig, phases: list[PhaseFigures], cache: dict
               ) -> tuple[int, dict[str, int]]:
    """One rank's peak and breakdown: every phase's peak and end laid out as `spec.shard` holds the state
    (module docstring); a phase's end after the last backward phase is the state the optimizer sees."""
    layout = shard_layout(spec, config, cache)
    last_backward = max((i for i, phase in enumerate(phases) if phase.name not in ("forward", "optimizer")),
                        default=-1)
    points = []
    for i, phase in enumerate(phases):
        points.extend(rank_breakdown(spec, layout, at, phase.name) for at in phase.points)
        at_end = "optimizer" if i == last_backward else phase.name
        points.append(rank_breakdown(spec, layout, phase.at_end, at_end))
    best = max(points, key=lambda point: sum(point.values()))
    return sum(best.values()), best


def shard_layout(spec: StepSpec, config: PretrainedConfig, cache: dict | None = None) -> ShardLayout:
    """The layout of `spec`'s model (full depth, LoRA included) over `spec.gpus` ranks, built on the meta
    device; memoised in `cache` (a simulation's memo) under a key of its own."""
    key = ("shard_layout", spec.model, spec.dtype, spec.lora_rank, spec.gpus, config.num_hidden_layers)
    if cache is not None and key in cache:
        return cache[key]
    model, _ = build_training_model(spec.at(max(2, spec.sp)), config, "meta")
    layout = ShardLayout.from_model(model, spec.gpus)
    if cache is not None:
        cache[key] = layout
    return layout

