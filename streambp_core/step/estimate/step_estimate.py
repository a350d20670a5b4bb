"""Estimated time of one step of a `StepSpec` on a GPU model: one GPU's step (`estimate.estimate_by_depth`
plus the offload copies compute does not hide) or one rank's of a step over several GPUs, data parallel
(ZeRO, FSDP2) or sequence parallel (`sequence_time`); with the optimizer tier, plus the host's optimizer
step (`estimate.host_optimizer_s`)."""

from __future__ import annotations

from dataclasses import replace

from streambp_core.step.estimate.roofline import GpuModel, StepEstimate
from streambp_core.step.estimate.sequence_time import estimate_sequence_step, host_step_s, rank_compute


def estimate_step(spec, gpu: GpuModel, model=None) -> StepEstimate:
    """Estimated time of one step of `spec` (a `StepSpec`) on `gpu`: the ops of its step on meta tensors
    at two depths whole periods of its layer pattern apart, scaled to the full depth (`estimate_by_depth`),
    attention at the speed of the kernel `spec.stream.attn` runs on `gpu`
    (`attention_kernels.attention_kernel`), plus offload copies not hidden by compute (bytes each way from
    `simulate`, at `gpu.pcie_bytes_per_s` per direction) and the host optimizer step. `model`: the spec's
    model resolved once (`step.parts.resolved.ResolvedModel`, whose memo of meta kernels the calls share;
    None: resolved here). A step over several GPUs (`spec.gpus` > 1, sequence parallel or not) is one rank's
    (`sequence_time`): the same `StepEstimate`, its collectives in `all_to_all_bytes`, `all_to_all_s`,
    `zero_s` and `interconnect`."""
    from streambp_core.step.parts.resolved import resolved

    if spec.sp > 1 or spec.gpus > 1:  # one rank: its shard's step, plus the collectives
        return estimate_sequence_step(spec, gpu, model)
    model = resolved(spec.model, model)
    estimate = rank_compute(spec, gpu, model)
    if not spec.stream.offload:
        return estimate
    from streambp_core.step.simulation.simulate import simulate

    sim = simulate(spec, model)
    copies = replace(estimate, to_host_bytes=sim.to_host_bytes, to_device_bytes=sim.to_device_bytes,
                     pcie_bytes_per_s=gpu.pcie_bytes_per_s)
    compute_s = estimate.step_time_ms / 1e3
    return replace(copies, transfer_s=max(0.0, copies.copy_s - compute_s),
                   host_optimizer_s=host_step_s(spec, model, gpu))
