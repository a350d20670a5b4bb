"""A roofline estimate of one training step's time on a named GPU, from the ops the step dispatches on
meta tensors (`streambp_core.step.estimate.ops`). Every figure it gives is labelled `estimated`.

Per op: max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x efficiency)), plus a fixed cost per
launched kernel (views launch none). Peaks and bandwidths are the vendors' datasheet figures (dense
bf16 tensor-core FLOP/s, HBM and PCIe bandwidth per direction of the SXM parts); the efficiencies are
what tuned kernels reach on them, not fitted to this project's measurements or to the published step
times the estimate answers to (`benchmarks/published_step_time.py`):

- matmuls: 70 % of peak (cuBLAS bf16 GEMMs of transformer sizes);
- attention: by kernel, pass and the call's key length, from the kernels' published speed curves
  (`step.estimate.attention_kernels`): on Hopper with torch's SDPA (cuDNN) 60 % forward and 52 % backward at
  16k keys and more, 37 % and 33 % with FlashAttention-2. A flash kernel's backward does 2.5x its forward's
  matmul FLOPs (`ops.prefix_attention_flops`), so a checkpointed step's attention is 4.5 forwards: forward,
  recomputed forward, backward. (A flat 35 % for every pass and kernel, as before, made TRL's 1M-token
  Qwen3-8B step 545 s against the 380 s published: the step runs cuDNN's kernels, not FlashAttention-2's.)
- everything else: 80 % of HBM bandwidth;
- 10 us per kernel: launch plus eager PyTorch's host-side dispatch of the op (Python, autograd,
  dispatcher), which a GPU waiting on small kernels cannot hide. This is the one constant set with the
  committed H200 step times in view (5, 10, 15, 20 us were tried; 10 us puts all six within 15 %).

Offload transfers (PCIe) are not in the op record of a meta step: `step_estimate.estimate_step` takes the
bytes each way from the simulation, times them at one direction's PCIe bandwidth (transfer = (bytes to
host + bytes to device) / bandwidth: the two directions are not assumed to overlap each other) and adds
the part that the step's compute cannot hide, max(0, transfer - compute), as if every copy overlapped
compute (it runs on a side stream). With the optimizer and params offload tiers those bytes include each
gradient sent to the host, the updated weights returned and every weight gathered for forward and
backward. PCIe assumed per direction: 64 GB/s on H100 and H200 (Gen5 x16), 32 GB/s on A100 and A800 (Gen4
x16), the links' nominal rates. The host optimizer step (optimizer tier) runs on the CPU after backward,
hidden by nothing: `HOST_ADAM_BYTES_PER_PARAM` streamed per trainable parameter at the host's DRAM
bandwidth (`GpuModel.host_dram_bytes_per_s`, the reference board's two CPU sockets at their datasheet
rate). Depth (`estimate_by_depth`): the ops of the model cut to two depths that are whole periods of its layer
pattern apart (`step.parts.depth.depth_plan` with `min_layers=1`: 1 and 2 layers on a uniform model, 4 and 8
on Qwen3.5's 3-linear-1-full hybrid) are recorded and the difference scaled to the full depth (every whole
period dispatches the same ops), so a 36-layer model costs two short meta steps.

The estimate's band and regime (`StepEstimate.band_s`, `StepEstimate.regime`): every row of the committed
published-step-time table lies within `STEP_BAND` of its estimate, which is the band an estimate carries;
the regime is the part of the step that dominates it (GEMM-, attention-, memory-, PCIe-, interconnect- or
host-bound). """

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from transformers import PretrainedConfig

from streambp_core.config import ConfigError
from streambp_core.step.estimate.attention_kernels import attention_efficiency, attention_kernel
from streambp_core.step.estimate.ops import OpRecord
from streambp_core.step.parts.depth import depth_plan

MATMUL_EFFICIENCY = 0.70
BANDWIDTH_EFFICIENCY = 0.80
LAUNCH_S = 10e-6
HOST_ADAM_BYTES_PER_PARAM = 30
"""Host DRAM traffic of one AdamW update of a parameter on the CPU (DeepSpeed's CPU Adam, torch's
AdamW alike): fp32 weight, gradient and both moments read (16 B), weight and moments written (12 B),
the bf16 weight for the device written (2 B)."""
HOST_DRAM_EFFICIENCY = 0.80
STEP_BAND = (0.75, 1.25)
"""Estimated / published step time: every row of the committed published-step-time table lies in it."""


@dataclass(frozen=True)
class GpuModel:
    """Datasheet figures of one GPU (SXM form factor)."""

    name: str
    peak_bf16_flops: float
    """Dense bf16 tensor-core FLOP/s (without structured sparsity)."""
    hbm_bytes_per_s: float
    pcie_bytes_per_s: float
    """Host link, one direction."""
    host_dram_bytes_per_s: float
    """DRAM bandwidth of the host of the reference 8-GPU board (both sockets), shared by its ranks."""


_XEON_8480 = 2 * 8 * 4.8e9 * 8  # DGX H100/H200: 2 sockets x 8 channels DDR5-4800 x 8 B = 614 GB/s
_EPYC_7742 = 2 * 8 * 3.2e9 * 8  # DGX A100: 2 sockets x 8 channels DDR4-3200 x 8 B = 410 GB/s
GPU_MODELS: Mapping[str, GpuModel] = MappingProxyType({
    "h100": GpuModel("NVIDIA H100 SXM5 80GB", 989.4e12, 3.35e12, 64e9, _XEON_8480),
    "h200": GpuModel("NVIDIA H200 SXM 141GB", 989.4e12, 4.8e12, 64e9, _XEON_8480),
    "a100": GpuModel("NVIDIA A100 SXM4 80GB", 312e12, 2.039e12, 32e9, _EPYC_7742),
    "a800": GpuModel("NVIDIA A800 SXM4 80GB", 312e12, 2.039e12, 32e9, _EPYC_7742),
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
    host_optimizer_s: float = 0.0
    """The optimizer step on the host's CPU (optimizer tier), after backward: added whole."""
    kernel: str = ""
    """The attention kernel the attention was timed as (`attention_kernels.KERNELS`)."""

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
                      + self.all_to_all_s + self.zero_s + self.host_optimizer_s)

    @property
    def band_s(self) -> tuple[float, float]:
        """The real step's range this estimate carries (`STEP_BAND`): estimate / 1.25 to / 0.75."""
        step_s = self.step_time_ms / 1e3
        return step_s / STEP_BAND[1], step_s / STEP_BAND[0]

    @property
    def regime(self) -> str:
        """What bounds the step: the largest of its parts ('GEMM', 'attention', 'memory' for the other
        ops and launches, 'PCIe' for the offload copies, whole, when they outlast compute, 'interconnect'
        for the collectives, 'host' for the host optimizer step)."""
        compute = self.matmul_s + self.attention_s + self.other_s + self.launch_s
        parts = {"GEMM": self.matmul_s, "attention": self.attention_s,
                 "memory": self.other_s + self.launch_s,
                 "PCIe": self.copy_s if self.copy_s > compute else 0.0,
                 "interconnect": self.all_to_all_s + self.zero_s, "host": self.host_optimizer_s}
        return max(parts, key=parts.__getitem__) + "-bound"


def default_kernel(gpu: GpuModel) -> str:
    """The attention kernel of torch's SDPA on `gpu` (`attention_kernels.attention_kernel`)."""
    return attention_kernel("sdpa", gpu.name)


def op_time_s(record: OpRecord, gpu: GpuModel, kernel: str | None = None, key_scale: float = 1.0) -> float:
    """Roofline time of one op on `gpu`, without its launch cost; an attention op at `kernel`'s speed
    (None: `default_kernel`) over its keys x `key_scale` (`sequence_time` times a shorter step's ops as
    the longer step's)."""
    if not record.moves_data:
        return 0.0
    if record.kind == "attention":
        efficiency = attention_efficiency(kernel or default_kernel(gpu), gpu.name,
                                          record.keys * key_scale, backward=record.name.endswith("bwd"))
    else:
        efficiency = MATMUL_EFFICIENCY if record.kind == "matmul" else None
    compute = record.flops / (gpu.peak_bf16_flops * efficiency) if efficiency else 0.0
    memory = record.bytes / (gpu.hbm_bytes_per_s * BANDWIDTH_EFFICIENCY)
    return max(compute, memory)


def estimate_ops(records: Sequence[OpRecord], gpu: GpuModel, scale: float = 1.0, kernel: str | None = None,
                 key_scale: float = 1.0) -> StepEstimate:
    """Roofline estimate of the ops `records` (each counted `scale` times; attention as `op_time_s`)."""
    by_kind = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    launches = 0
    for record in records:
        by_kind[record.kind] += op_time_s(record, gpu, kernel, key_scale)
        launches += record.moves_data
    return StepEstimate(gpu.name, scale * by_kind["matmul"], scale * by_kind["attention"],
                        scale * by_kind["other"], scale * launches * LAUNCH_S, round(scale * launches),
                        kernel=kernel or default_kernel(gpu))


def host_optimizer_s(trainable_params: int, gpu: GpuModel) -> float:
    """The host's AdamW step over `trainable_params` (all ranks' together: they share the host's DRAM)."""
    return trainable_params * HOST_ADAM_BYTES_PER_PARAM / (gpu.host_dram_bytes_per_s * HOST_DRAM_EFFICIENCY)


def estimate_by_depth(record_step: Callable[[int], Sequence[OpRecord]], config: PretrainedConfig,
                      gpu: GpuModel, kernel: str | None = None, key_scale: float = 1.0) -> StepEstimate:
    """Estimate a step of the model `config` from `record_step(depth)`, the ops of the same step on the
    model cut to `depth` layers (`depth.with_depth`). Steps: take the two depths of
    `depth.depth_plan(config, min_layers=1)`, a whole number of periods of the layer pattern apart (1 and
    2 on a uniform model); estimate each depth's ops; extend each part by the difference once per whole
    period left to the full depth (`DepthPlan.periods_to_add`). Without a shallower pair (a model of 1 or
    2 layers, or per-layer lists of unknown meaning: `depth.layer_kinds`) the full depth is recorded.
    `kernel`, `key_scale`: as `op_time_s`."""
    plan = depth_plan(config, min_layers=1)
    if plan is None:
        return estimate_ops(record_step(config.num_hidden_layers), gpu, kernel=kernel, key_scale=key_scale)
    shallow, deep = (estimate_ops(record_step(depth), gpu, kernel=kernel, key_scale=key_scale)
                     for depth in plan.depths)

    def extend(field: str) -> float:
        at_shallow = getattr(shallow, field)
        return at_shallow + plan.periods_to_add * (getattr(deep, field) - at_shallow)

    return StepEstimate(gpu.name, extend("matmul_s"), extend("attention_s"), extend("other_s"),
                        extend("launch_s"), round(extend("launches")), kernel=shallow.kernel)
