"""One rank of N under FSDP2, from a simulated single-rank step: what sharding changes in the peak.

Ranks are symmetric, so one is enough. The step's activations (checkpoints, kv, logits, temporaries) are
a rank's own and stay as simulated; the model state is laid out as FSDP2 lays it out, exactly, from the
model's parameter shapes (each parameter split along dim 0, padded to a multiple of N):

- weights: every parameter's shard, plus the gathered units. zero2 keeps every unit gathered from its
  forward to the end of its backward (at the step's peak, all of them); in forward also the flat
  all-gather output of the last unit gathered (a decoder layer's padded bytes), which FSDP2 frees only
  when the root's forward returns, and the head and the loss run inside it. zero3 gathers the root
  (embedding, final norm, head) and two decoder layers at most (the one running and the one prefetched).
- optimizer: the state of the shards (the simulated state times the trainable shard fraction).
- grads: the shards of the simulated gradients, plus, in backward, the unsharded gradients in flight:
  the root's (reduce-scattered at the end of backward) and two layers' (the one being back-propagated
  and the flat reduce-scatter input of the one before, which FSDP2 holds until the next unit's
  reduce-scatter). In flight are gradients of the step, so never more bytes than the single-rank step
  holds as gradients at that point (with fresh gradients, what exists of them). None in forward.
- the optimizer phase: every unit is resharded and every gradient reduce-scattered: shards only (the
  optimizer's temporaries too: it updates shards).

`deepspeed_breakdown` lays out one rank of DeepSpeed ZeRO-2 with bf16 (`stage_1_and_2.py`, its default
settings) instead, the paper's Table 4 engine:
- weights: the bf16 parameters, replicated (ZeRO-2 does not shard them);
- optimizer: the rank's partition (1/N of the flattened trainable parameters) of the fp32 master weights
  and of AdamW's two fp32 moments: 12 bytes per partition element;
- grads: the bf16 gradient partition (`grads_in_partition`, allocated at the first reduction and kept
  from step to step); in backward also one reduce bucket (`ipg_buffer`: `reduce_bucket_size` = 5e8
  elements, bf16, allocated whole whatever the model's size; one buffer since `overlap_comm` is off by
  default for stage 2) and the unsharded gradients in flight as above;
- the optimizer phase: the bf16 partition, its flattened copy and the fp32 gradient partition the
  optimizer steps on (4 bytes per element); the bucket is gone.

`deepspeed_zero3_breakdown` lays out one rank of DeepSpeed ZeRO-3 with bf16 (`stage3.py`, its defaults):
- weights: every parameter's bf16 partition (`ds_tensor`, 1/N of it, padded), and in the step the
  gathered ones: the root's (embedding, final norm, head: each gathered in full while it runs) and one
  decoder layer, plus the prefetch (`stage3_prefetch_bucket_size` = 5e7 elements, at most a layer; a
  streamed method's units gather one layer at a time and do not prefetch: an upper bound there);
  parameters under `stage3_param_persistence_threshold` (1e5 elements: the norms) stay whole on every
  rank: counted in full;
- optimizer: as ZeRO-2 (fp32 master weights and AdamW's two fp32 moments of the rank's partition);
- grads: the gradient partition (`grad_partitions_flat_buffer`, bf16 by default, from initialisation
  on) and the reduce bucket (`ipg` buffer, `reduce_bucket_size` = 5e8 elements, allocated with the
  optimizer, so in every phase); in backward also the unsharded gradients in flight (the root's and
  two layers', as above); in the optimizer phase the fp32 gradient partition it steps on.
  With DeepSpeed's own offload (`offload`: the optimizer tier is `offload_optimizer`, params is
  `offload_param`; their host side in `step.simulation.deepspeed_host`): offload_optimizer takes the fp32
  state, the gradient partition, the fp32 gradient and the step's temporaries off the device (the reduce
  bucket and the gradients in flight stay); offload_param takes the partitions off (the gathered units and the
  persistent parameters stay).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from streambp_core.config import FSDP_STAGES, ConfigError, StepSpec, require_choice
from streambp_core.dtypes import FLOAT32_BYTES
from streambp_core.models.adapters import decoder_parts
from streambp_core.tiers import Tiers

PREFETCHED_LAYERS = 2
"""zero3: decoder layers gathered at once (the one running and the one FSDP prefetches)."""
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed ZeRO's default `reduce_bucket_size` (elements of the gradient reduce buffer)."""
DEEPSPEED_PREFETCH_ELEMENTS = 50_000_000
"""DeepSpeed ZeRO-3's default `stage3_prefetch_bucket_size` (elements gathered ahead of their module)."""
DEEPSPEED_PERSISTENCE_ELEMENTS = 100_000
"""DeepSpeed ZeRO-3's default `stage3_param_persistence_threshold`: smaller parameters stay whole."""


@dataclass(frozen=True, kw_only=True)
class UnitBytes:
    """Bytes of one FSDP unit's parameters, unsharded and as one rank's (padded) shard."""

    full: int
    shard: int
    trainable_full: int
    trainable_shard: int


@dataclass(frozen=True, kw_only=True)
class ShardLayout:
    """The FSDP units of a model across `gpus` ranks: the root first, then one per decoder layer."""

    gpus: int
    units: tuple[UnitBytes, ...]
    trainable_numel: int = 0
    """Elements of the trainable parameters (all units)."""
    persistent_bytes: int = 0
    """Bytes of the parameters DeepSpeed ZeRO-3 keeps whole (under its persistence threshold), beyond
    their shards."""
    grad_element_bytes: int = 2
    """Bytes per element of a trainable parameter (and its gradient)."""

    @classmethod
    def from_model(cls, model: nn.Module, gpus: int) -> ShardLayout:
        """The layout of `model` (any device, meta included) over `gpus` ranks."""
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
            raise ConfigError(f"gpus must be a positive integer, got {gpus!r}")
        layers = list(decoder_parts(model).layers)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        root = [p for p in model.parameters() if id(p) not in in_layers]
        units = [_unit(root, gpus)] + [_unit(list(layer.parameters()), gpus) for layer in layers]
        trainable = [p for p in model.parameters() if p.requires_grad]
        small = [p for p in model.parameters() if p.numel() < DEEPSPEED_PERSISTENCE_ELEMENTS]
        return cls(gpus=gpus, units=tuple(units), trainable_numel=sum(p.numel() for p in trainable),
                   grad_element_bytes=max((p.element_size() for p in trainable), default=2),
                   persistent_bytes=sum(p.numel() * p.element_size() for p in small))

    @property
    def partition_numel(self) -> int:
        """Elements of one rank's partition of the flattened trainable parameters (DeepSpeed ZeRO)."""
        return -(-self.trainable_numel // self.gpus)

    def total(self, field: str) -> int:
        """Sum of one `UnitBytes` field over the units."""
        return sum(getattr(unit, field) for unit in self.units)

    @property
    def trainable_fraction(self) -> float:
        """A rank's share of the trainable parameters' bytes (1/N plus padding)."""
        full = self.total("trainable_full")
        return self.total("trainable_shard") / full if full else 0.0

    def gathered_bytes(self, stage: str) -> int:
        """Bytes of unsharded parameters alive at once on a rank at the step's peak."""
        if stage == "zero2":
            return self.total("full")
        layers = sorted((unit.full for unit in self.units[1:]), reverse=True)
        return self.units[0].full + sum(layers[:PREFETCHED_LAYERS])

    def forward_gather_bytes(self, stage: str) -> int:
        """Bytes of the flat all-gather output FSDP2 holds on top of the gathered units in forward: zero2
        keeps the last layer's until the root's forward returns (zero3's is within its two layers)."""
        if stage != "zero2" or len(self.units) < 2:
            return 0
        return max(unit.shard * self.gpus for unit in self.units[1:])

    def inflight_grad_bytes(self) -> int:
        """Unsharded gradients alive at once in backward: the root's and two layers'."""
        layers = sorted((unit.trainable_full for unit in self.units[1:]), reverse=True)
        return self.units[0].trainable_full + sum(layers[:PREFETCHED_LAYERS])


def _unit(params: list[nn.Parameter], gpus: int) -> UnitBytes:
    sizes = {"full": 0, "shard": 0, "trainable_full": 0, "trainable_shard": 0}
    for param in params:
        full = param.numel() * param.element_size()
        rows = param.shape[0] if param.dim() else 1
        shard = -(-rows // gpus) * (full // max(rows, 1))  # dim 0 padded to a multiple of gpus
        sizes["full"] += full
        sizes["shard"] += shard
        if param.requires_grad:
            sizes["trainable_full"] += full
            sizes["trainable_shard"] += shard
    return UnitBytes(**sizes)


def check_sharded_params(spec: StepSpec) -> None:
    """ConfigError for the params tier under an FSDP2 stage (zero2, zero3): the engine's FSDP2 run has no
    parameter offload, and this layout takes the simulated step's weights as the whole model's (with the
    tier they are one gathered unit: Qwen3-8B on 8 ranks at 4,400 tokens came out at -2.4 GiB)."""
    if spec.offload.params and spec.shard in FSDP_STAGES:
        raise ConfigError(f"offload params with {spec.shard} is not simulated (FSDP2 as the engine runs it "
                          "keeps its parameter shards on the device); use --shard deepspeed-zero3 "
                          "(DeepSpeed's offload_param)")


def sharded_breakdown(
    breakdown_bytes: dict[str, int], layout: ShardLayout, stage: str, phase: str = "backward"
) -> dict[str, int]:
    """One rank's bytes by category at the peak of a step phase whose single-rank breakdown is given.

    `phase` "optimizer" (after backward: every unit resharded, every gradient reduce-scattered) holds
    shards only; "forward" the gathered units and zero2's last all-gather output; any other phase (the
    backward's) the gathered units and the gradients in flight, at most the gradients there are.
    """
    require_choice("shard", stage, FSDP_STAGES)
    in_step = phase != "optimizer"
    fraction = layout.trainable_fraction
    rank = dict(breakdown_bytes)
    buffers = breakdown_bytes.get("weights", 0) - layout.total("full")  # buffers are not sharded
    forward_gather = layout.forward_gather_bytes(stage) if phase == "forward" else 0
    gathered = layout.gathered_bytes(stage) + forward_gather
    rank["weights"] = buffers + layout.total("shard") + (gathered if in_step else 0)
    rank["optimizer"] = round(breakdown_bytes.get("optimizer", 0) * fraction)
    grads = breakdown_bytes.get("grads", 0)
    in_backward = in_step and phase != "forward"
    rank["grads"] = round(grads * fraction) + (min(grads, layout.inflight_grad_bytes()) if in_backward else 0)
    if not in_step:
        rank["temporaries"] = round(breakdown_bytes.get("temporaries", 0) * fraction)
    return rank


def deepspeed_breakdown(
    breakdown_bytes: dict[str, int], layout: ShardLayout, phase: str = "backward", *,
    optimizer_state: bool = True,
) -> dict[str, int]:
    """One rank's bytes by category under DeepSpeed ZeRO-2 with bf16 (module docstring), at the peak of a
    step phase whose single-rank breakdown is given; `optimizer_state` False: a backprop-only step."""
    part = layout.partition_numel
    rank = dict(breakdown_bytes)
    master = 0 if layout.grad_element_bytes == FLOAT32_BYTES else FLOAT32_BYTES
    rank["optimizer"] = (master + 2 * FLOAT32_BYTES) * part if optimizer_state else 0
    partition = layout.grad_element_bytes * part
    grads = breakdown_bytes.get("grads", 0)
    if phase == "optimizer":
        rank["grads"] = 2 * partition + FLOAT32_BYTES * part
        rank["temporaries"] = round(breakdown_bytes.get("temporaries", 0) * layout.trainable_fraction)
    elif phase == "forward":
        rank["grads"] = partition
    else:
        bucket = layout.grad_element_bytes * DEEPSPEED_REDUCE_BUCKET_ELEMENTS
        rank["grads"] = partition + bucket + (layout.inflight_grad_bytes() if grads else 0)
    return rank


def deepspeed_zero3_breakdown(
    breakdown_bytes: dict[str, int], layout: ShardLayout, phase: str = "backward", *,
    optimizer_state: bool = True, offload: Tiers = Tiers.NONE,
) -> dict[str, int]:
    """One rank's bytes by category under DeepSpeed ZeRO-3 with bf16 (module docstring), at the peak of a
    step phase whose single-rank breakdown is given; `optimizer_state` False: a backprop-only step;
    `offload` the tiers DeepSpeed holds on the host (`offload_optimizer`, `offload_param`:
    `deepspeed_host`)."""
    host_optimizer = optimizer_state and offload.optimizer
    part = layout.partition_numel
    element = layout.grad_element_bytes
    rank = dict(breakdown_bytes)
    buffers = breakdown_bytes.get("weights", 0) - layout.total("full")  # buffers are not partitioned
    layers = sorted((unit.full for unit in layout.units[1:]), reverse=True) or [0]
    prefetch = min(DEEPSPEED_PREFETCH_ELEMENTS * element, layers[0])
    gathered = layout.units[0].full + layers[0] + prefetch if phase != "optimizer" else 0
    shards = 0 if offload.params else layout.total("shard")
    rank["weights"] = buffers + shards + layout.persistent_bytes + gathered
    master = 0 if element == FLOAT32_BYTES else FLOAT32_BYTES
    rank["optimizer"] = (master + 2 * FLOAT32_BYTES) * part if optimizer_state and not host_optimizer else 0
    bucket = element * DEEPSPEED_REDUCE_BUCKET_ELEMENTS
    grads = breakdown_bytes.get("grads", 0)
    rank["grads"] = (0 if host_optimizer else element * part) + bucket
    if phase == "optimizer":
        rank["grads"] += 0 if host_optimizer else FLOAT32_BYTES * part
        scaled = round(breakdown_bytes.get("temporaries", 0) * layout.trainable_fraction)
        rank["temporaries"] = 0 if host_optimizer else scaled
    elif phase != "forward":
        rank["grads"] += min(grads, layout.inflight_grad_bytes())
    return rank


def rank_breakdown(spec: StepSpec, layout: ShardLayout, breakdown_bytes: dict[str, int], phase: str
                   ) -> dict[str, int]:
    """One rank's bytes by category under `spec.shard` at a point of phase `phase` whose single-GPU
    breakdown is given (`sharded_breakdown`, `deepspeed_breakdown` or `deepspeed_zero3_breakdown`)."""
    optimizer_state = spec.optimizer != "none"
    if spec.shard == "deepspeed-zero2":
        return deepspeed_breakdown(breakdown_bytes, layout, phase, optimizer_state=optimizer_state)
    if spec.shard == "deepspeed-zero3":
        return deepspeed_zero3_breakdown(breakdown_bytes, layout, phase, optimizer_state=optimizer_state,
                                         offload=spec.offload)
    return sharded_breakdown(breakdown_bytes, layout, spec.shard, phase)
