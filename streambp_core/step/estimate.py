"""A roofline estimate of one training step's time on a named GPU, from the ops the step dispatches on
meta tensors (`streambp_core.step.ops`). Every figure it gives is labelled `estimated`.

Per op: max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x efficiency)), plus a fixed cost per
launched kernel (views launch none). Peaks and bandwidths are the vendors' datasheet figures (dense
bf16 tensor-core FLOP/s, HBM and PCIe bandwidth per direction of the SXM parts); the efficiencies are
what tuned kernels reach on them, not fitted to this project's measurements:

- matmuls: 70 % of peak (cuBLAS bf16 GEMMs of transformer sizes);
- attention: 35 % of peak (FlashAttention-2 on Hopper, as its successor's paper reports; the same
  fraction is assumed on Ampere, where FlashAttention-2 reports 50-70 % in its forward only);
- everything else: 80 % of HBM bandwidth;
- 10 us per kernel: launch plus eager PyTorch's host-side dispatch of the op (Python, autograd,
  dispatcher), which a GPU waiting on small kernels cannot hide. This is the one constant set with the
  committed H200 step times in view (5, 10, 15, 20 us were tried; 10 us puts all six within 15 %); the
  others are the datasheets' and the kernels' published figures.

Offload transfers (PCIe) are not in the op record of a meta step: `step_estimate.estimate_step` takes the
bytes each way from the simulation, times them at one direction's PCIe bandwidth (transfer = (bytes to
host + bytes to device) / bandwidth: the two directions are not assumed to overlap each other) and adds
the part that the step's compute cannot hide, max(0, transfer - compute), as if every copy overlapped
compute (it runs on a side stream). With the optimizer and params offload tiers those bytes include each
gradient sent to the host, the updated weights returned and every weight gathered for forward and
backward. PCIe assumed per direction: 64 GB/s on H100 and H200 (Gen5 x16), 32 GB/s on A100 and A800 (Gen4
x16), the links' nominal rates; the host optimizer step's CPU time is not estimated. Depth: the ops of a
1-layer and a 2-layer model are recorded and the difference is scaled to the full depth (every decoder
layer dispatches the same ops), so a 36-layer model costs two short meta steps. """

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from streambp_core.config import ConfigError
from streambp_core.step.ops import OpRecord

MATMUL_EFFICIENCY = 0.70
ATTENTION_EFFICIENCY = 0.35
BANDWIDTH_EFFICIENCY = 0.80
LAUNCH_S = 10e-6


@dataclass(frozen=True)
class GpuModel:
    """Datasheet figures of one GPU (SXM form factor)."""

    name: str
    peak_bf16_flops: float
    """Dense bf16 tensor-core FLOP/s (without structured sparsity)."""
    hbm_bytes_per_s: float
    pcie_bytes_per_s: float
    """Host link, one direction."""


GPU_MODELS: Mapping[str, GpuModel] = MappingProxyType({
    "h100": GpuModel("NVIDIA H100 SXM5 80GB", 989.4e12, 3.35e12, 64e9),
    "h200": GpuModel("NVIDIA H200 SXM 141GB", 989.4e12, 4.8e12, 64e9),
    "a100": GpuModel("NVIDIA A100 SXM4 80GB", 312e12, 2.039e12, 32e9),
    "a800": GpuModel("NVIDIA A800 SXM4 80GB", 312e12, 2.039e12, 32e9),
})


def gpu_model(name: str) -> GpuModel:
    """The GPU named `name` (h100, h200, a100, a800; case-insensitive), or ConfigError listing them."""
    key = name.strip().lower()
    if key not in GPU_MODELS:
        raise ConfigError(f"unknown GPU model {name!r}; choose from {', '.join(GPU_MODELS)}")
    return GPU_MODELS[key]


@dataclass(frozen=True)
class StepEstimate:
    """Estimated time of one step (one GPU's, or one sequence-parallel rank's), split by op kind, plus
    the offload copies and collectives compute does not hide; `source` is always 'estimated'. Every
    caller reads the same fields: a step without sequence parallelism has `all_to_all_bytes` None and
    `all_to_all_s` = `zero_s` = 0."""

    gpu: str
    matmul_s: float
    attention_s: float
    other_s: float
    launch_s: float
    launches: int
    source: str = "estimated"
    transfer_s: float = 0.0
    """Host-device copies (offload) not hidden by compute."""
    to_host_bytes: int = 0
    """Bytes the step copies device -> host (offload tiers; `simulate`'s)."""
    to_device_bytes: int = 0
    """Bytes the step copies host -> device."""
    pcie_bytes_per_s: float = 0.0
    """The PCIe bandwidth the copies were timed at (the GPU's, one direction); 0 without offload."""
    all_to_all_bytes: int | None = None
    """Bytes one rank sends in the step's Ulysses all-to-alls; None for a step without sequence
    parallelism (`sequence_time`)."""
    all_to_all_s: float = 0.0
    """The all-to-alls' time (attention waits for them: added whole)."""
    zero_s: float = 0.0
    """ZeRO's collectives (all-gathers, reduce-scatter) not hidden by compute."""
    interconnect: str = ""
    """The links the collectives were timed at, in words; empty without collectives."""

    @property
    def copy_s(self) -> float:
        """The offload copies' whole PCIe time, both directions' bytes over one direction's bandwidth
        (hidden by compute or not; `transfer_s` is the part that is not)."""
        if not self.pcie_bytes_per_s:
            return 0.0
        return (self.to_host_bytes + self.to_device_bytes) / self.pcie_bytes_per_s

    @property
    def step_time_ms(self) -> float:
        return 1e3 * (self.matmul_s + self.attention_s + self.other_s + self.launch_s + self.transfer_s
                      + self.all_to_all_s + self.zero_s)


def op_time_s(record: OpRecord, gpu: GpuModel) -> float:
    """Roofline time of one op on `gpu`, without its launch cost."""
    if not record.moves_data:
        return 0.0
    efficiency = {"matmul": MATMUL_EFFICIENCY, "attention": ATTENTION_EFFICIENCY}.get(record.kind)
    compute = record.flops / (gpu.peak_bf16_flops * efficiency) if efficiency else 0.0
    memory = record.bytes / (gpu.hbm_bytes_per_s * BANDWIDTH_EFFICIENCY)
    return max(compute, memory)


def estimate_ops(records: Sequence[OpRecord], gpu: GpuModel, scale: float = 1.0) -> StepEstimate:
    """Roofline estimate of the ops `records` (each counted `scale` times)."""
    by_kind = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    launches = 0
    for record in records:
        by_kind[record.kind] += op_time_s(record, gpu)
        launches += record.moves_data
    return StepEstimate(gpu.name, scale * by_kind["matmul"], scale * by_kind["attention"],
                        scale * by_kind["other"], scale * launches * LAUNCH_S, round(scale * launches))


def estimate_by_depth(record_step: Callable[[int], Sequence[OpRecord]], num_layers: int,
                      gpu: GpuModel) -> StepEstimate:
    """Estimate a `num_layers`-deep step from `record_step(depth)`, the ops of the same step on a model
    cut to `depth` layers, called with depths 1 and 2: step(L) = step(1) + (L - 1) x (step(2) - step(1))."""
    one = estimate_ops(record_step(1), gpu)
    if num_layers == 1:
        return one
    two = estimate_ops(record_step(2), gpu)
    extra = num_layers - 1

    def extend(field: str) -> float:
        return getattr(one, field) + extra * (getattr(two, field) - getattr(one, field))

    return StepEstimate(gpu.name, extend("matmul_s"), extend("attention_s"), extend("other_s"),
                        extend("launch_s"), round(extend("launches")))
