"""One DeepSpeed ZeRO-3 rank with DeepSpeed's own offload (`--shard deepspeed-zero3 --offload
optimizer[,params]`): the step the methods run and what DeepSpeed holds in host memory and copies.

The project's tiers map onto DeepSpeed's sections (`streambp_core.parallel.deepspeed.offload_sections`):
optimizer is `offload_optimizer: {device: cpu}`, params is `offload_param: {device: cpu}`; checkpoints
stays the methods' own. So the step is simulated with the checkpoints tier only (`engine_spec`: DeepSpeed,
not `HostAdamW` or the params tier, holds the rest) and laid out as DeepSpeed 0.19.8's `stage3.py` holds
the state, its defaults (`step.parts.shards.deepspeed_zero3_breakdown` for the device; `deepspeed_host` here):

- offload_param: every parameter's partition (`ds_tensor`) lives in one flat host buffer
  (`param_groups_fp16_flat_cpu_memory`, pinned): the rank's shards in the parameters' dtype. A unit's
  partition is copied to the device for each gather, one for its forward and one for its backward.
- offload_optimizer: allocated at initialisation and held throughout, in host memory: the fp32 master
  partition and AdamW's two fp32 moments (12 bytes per partition element; 8 when the parameters are
  float32), the gradient partition in the gradient-accumulation dtype (the parameters' by default:
  `grad_partitions_flat_buffer`) and the fp32 gradient the optimizer steps (`subgroup_gradient_buffer`,
  4 bytes). Each backward copies the rank's gradient partition out into that buffer, back to the device
  (`partition_grads`: `grad_buffer.to(device)`), and, cast to fp32 there, out again into the fp32
  gradient (`_offload_grad_partition_at_boundary`): out (element + 4) bytes, back element bytes per
  partition element; without offload_param the updated partition also comes back, cast on the host
  (element bytes).
- DeepSpeed's CPU Adam (`DeepSpeedCPUAdam`, what `offload_optimizer` runs unless told otherwise) steps
  those buffers in place: no host temporaries; the device holds no optimizer state, no gradient
  partition and no step temporaries, only the reduce bucket and the gradients in flight.
On top, the checkpoints tier's host copies and their traffic, as the simulated step has them.
"""

from __future__ import annotations

from streambp_core.config import ConfigError, StepSpec
from streambp_core.dtypes import FLOAT32_BYTES
from streambp_core.engine.engines.deepspeed_tiers import OFFLOAD_SECTIONS
from streambp_core.step.parts.shards import ShardLayout
from streambp_core.tiers import Tiers

DEEPSPEED_SECTIONS = tuple(OFFLOAD_SECTIONS)
"""The tiers DeepSpeed holds itself under ZeRO-3 (its `offload_optimizer` and `offload_param`)."""


def check_deepspeed_offload(spec: StepSpec) -> None:
    """ConfigError for DeepSpeed offload that is not laid out: ZeRO-2's `offload_optimizer` (its own
    buffers, not simulated) and params below ZeRO-3 (DeepSpeed has no `offload_param` there)."""
    tiers = [tier for tier in spec.offload.names if tier in DEEPSPEED_SECTIONS]
    if spec.shard == "deepspeed-zero2" and tiers:
        why = ("DeepSpeed offloads parameters under ZeRO-3 only" if "params" in tiers
               else "ZeRO-2's offload_optimizer buffers are not laid out")
        raise ConfigError(f"offload {','.join(sorted(tiers))} with deepspeed-zero2 is not simulated ({why}); "
                          "use --shard deepspeed-zero3")


def engine_spec(spec: StepSpec) -> StepSpec:
    """The step the methods run under DeepSpeed ZeRO-3 with its offload: `spec` with its checkpoints tier
    only (DeepSpeed holds the optimizer and the parameters itself); any other spec, `spec` itself."""
    if spec.shard != "deepspeed-zero3" or not set(spec.offload.names) & set(DEEPSPEED_SECTIONS):
        return spec
    return spec.replaced(offload=Tiers(checkpoints=spec.offload.checkpoints))


def deepspeed_host(spec: StepSpec, layout: ShardLayout, checkpoints: tuple[int, int, int]
                   ) -> tuple[int, int, int]:
    """(host peak, bytes to host, bytes to device) of one ZeRO-3 rank with DeepSpeed's offload sections
    (module docstring), over one step; `checkpoints`: the same three figures of the simulated step's own
    host pool (the checkpoints tier), added on top."""
    tiers = spec.offload
    element = layout.grad_element_bytes
    part = layout.partition_numel
    host = to_host = to_device = 0
    if tiers.params:
        host += layout.total("shard")
        to_device += 2 * layout.total("shard")  # each unit gathered for its forward and its backward
    if tiers.optimizer and spec.optimizer != "none":
        master = 0 if element == FLOAT32_BYTES else FLOAT32_BYTES
        host += (master + 2 * FLOAT32_BYTES) * part + element * part + FLOAT32_BYTES * part
        to_host += (element + FLOAT32_BYTES) * part
        to_device += element * part + (0 if tiers.params else element * part)
    peak, out, back = checkpoints
    return host + peak, to_host + out, to_device + back
