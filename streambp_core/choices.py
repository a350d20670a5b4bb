"""The choices of a step's settings, each a `Literal` type and the tuple of its values (`typing.get_args`),
declared once: `streambp_core.config` types and validates `StepSpec` and `StreamConfig` with them, and
the command line offers them. A partition size left to the automatic choice is an `Auto`."""

from __future__ import annotations

from enum import Enum
from typing import Literal, get_args

from streambp_core.registry import METHODS as METHODS
from streambp_core.registry import methods_where

Method = Literal["plain", "checkpoint", "mst", "streambp"]
"""A method's name, as the registry's classes name them (`registry.METHODS`: a test holds the two equal)."""
VERIFY_METHODS = methods_where(reference=False)
"""The methods `verify` compares with plain when none are named."""
Objective = Literal["sft", "grpo", "dpo"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
AttnBackend = Literal["auto", "sdpa", "flash"]
ATTN_BACKENDS: tuple[str, ...] = get_args(AttnBackend)
BaselineAttention = Literal["auto", "engine", "model"]
BASELINE_ATTENTION: tuple[str, ...] = get_args(BaselineAttention)
Padding = Literal["none", "right", "left"]
PADDINGS: tuple[str, ...] = get_args(Padding)
"""Where padding goes in each row of a random batch."""
Protocol = Literal["default", "paper", "trl"]
PROTOCOLS: tuple[str, ...] = get_args(Protocol)
"""Step protocols of a memory figure (see `streambp_core.step.run.protocol`)."""
BaselineLoss = Literal["full", "trl"]
BASELINE_LOSSES: tuple[str, ...] = get_args(BaselineLoss)
"""How plain and checkpoint compute a GRPO or DPO loss from the model's logits (see StreamConfig)."""
HeadMode = Literal["auto", "fused", "recompute"]
HEAD_MODES: tuple[str, ...] = get_args(HeadMode)
"""How streambp's LM head differentiates (see `streambp_core.engine.stream.head`)."""
FUSED_HEAD_OBJECTIVES = ("sft", "grpo")
"""Objectives whose loss is linear in its per-sequence sums, so the fused head can serve them."""
Shard = Literal["none", "zero2", "zero3", "deepspeed-zero2", "deepspeed-zero3"]
SHARD_MODES: tuple[str, ...] = get_args(Shard)
"""How one rank of `gpus` holds the model state. none: all of it (one GPU). zero2 and zero3: torch FSDP2,
what `streambp_core.parallel.shard_model` runs (zero2: gradients and optimizer states sharded, parameters
gathered from forward to backward; zero3: parameters sharded too). deepspeed-zero2: what DeepSpeed ZeRO-2
allocates with bf16 (the paper's Table 4 engine: replicated bf16 parameters, fp32 master weights and AdamW
moments and a bf16 gradient partition per rank, gradient buckets); deepspeed-zero3: what DeepSpeed
ZeRO-3 allocates with bf16 (partitioned bf16 parameters, one unit gathered at a time plus its prefetch,
the same fp32 partitions; with the optimizer or params tier DeepSpeed's own `offload_optimizer` or
`offload_param`, `step.simulation.deepspeed_host`). Both simulated (see `streambp_core.step.parts.shards`);
`streambp_core.parallel.deepspeed` runs the methods on DeepSpeed itself."""
DEEPSPEED_SHARDS = ("deepspeed-zero2", "deepspeed-zero3")
"""The shard modes laid out as DeepSpeed allocates (`step.parts.shards.deepspeed_breakdown`)."""
FSDP_STAGES = ("zero2", "zero3")
"""The shard stages the engine runs (torch FSDP2; `streambp_core.parallel.fsdp`)."""
Grads = Literal["auto", "resident", "fresh"]
GRADS_MODES: tuple[str, ...] = get_args(Grads)[1:]
"""Whether parameter gradients exist before the step (resident) or are made by it (fresh); a step's
`grads` may also read auto, resolved by `StepSpec`."""
Optimizer = Literal["none", "adamw"]
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
"""The optimizer of a training step: none (backprop only) or AdamW over the trainable parameters."""
Dtype = Literal["bfloat16", "float16", "float32", "float64"]
DTYPES: tuple[str, ...] = get_args(Dtype)
Device = Literal["sim", "cpu", "cuda"]
DEVICES: tuple[str, ...] = get_args(Device)
"""Where a step runs: simulated on meta tensors, or measured on CPU or CUDA tensors."""
GPU_MODEL_NAMES = ("h100", "h200", "a100", "a800")
"""GPUs whose datasheet figures the step-time estimate knows
(`streambp_core.step.estimate.roofline.GPU_MODELS`)."""
MIN_AUTO_PARTITION = 64
"""The smallest layer and head partition (tokens) the automatic choice considers
(`streambp_core.step.search.partitions`)."""
PARTITION_FIELDS = ("partition_size", "head_partition_size")
"""The `StreamConfig` fields that may read AUTO."""


class Auto(str, Enum):
    """A partition size left to the automatic choice: `StreamConfig.partition_size` or
    `head_partition_size` reads AUTO until `step.search.partitions.resolve_partitions` puts the largest that
    fit there. A max-length search runs an automatic partition at MIN_AUTO_PARTITION
    (`step.search.partitions.searched`: the smallest candidate, which reaches the longest length). What runs a
    step takes sizes in tokens only (`config.require_sized`). It reads and writes as the text 'auto' (a str:
    equal to it, the same in JSON and CSV), which `StreamConfig` takes as AUTO."""

    AUTO = "auto"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)

    def __hash__(self) -> int:  # equal to the text 'auto', so hashed as it
        return hash(self.value)


AUTO = Auto.AUTO
"""The one automatic partition size."""
