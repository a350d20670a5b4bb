"""Estimated time of one rank's step over several GPUs: Ulysses sequence parallelism (`StepSpec.sp`), data
parallelism with ZeRO / FSDP2 shards (`StepSpec.shard` over `gpus`), or both. Every figure is labelled
`estimated`.

1. Compute: the roofline estimate (`estimate.estimate_by_depth`) of the rank's step, its ops recorded
   on meta tensors through the engine's sequence-parallel code path (`ops.spec_step_ops`: H/sp heads
   over all T queries and keys) at two shallow depths and extended to the full depth (`rank_compute`).
   A step is recorded at its length, every chunk as it runs, unless it is longer than the length fit's
   three references together (`_fits_sooner`: then the fit records fewer ops). Then each part (matmuls,
   attention, other ops, launches) is fitted in the length as a + b T + c T^2 through three steps of
   the same partitions at 1, 2 and 4 x `reference_lengths`' first, each a whole number of chunks per
   rank, and evaluated at the step's length. Each chunk's ops
   are then the same in every reference and at T; only their count and, for attention and ops over a
   chunk's prefix, their keys grow: matmuls, other ops and launches are affine in the chunk count,
   causal attention's FLOPs and prefix bytes quadratic, so the fit is exact at a length of whole chunks
   but for attention's speed, which follows its kernel's curve in the key length (each reference's
   attention ops timed for their keys scaled to the step's, keys x T / reference length: the keys the
   same calls have at T); a test checks it against recording every op (attention within 0.1 %, all
   within 1 % with a last chunk cut short). Chunk counts of a fixed partition are step functions of
   the length, so references that do not hold whole chunks (2k, 4k and 8k tokens with 3,000-token
   partitions: 1, 2 and 3 chunks) follow no curve: a parabola through them counted 621 head chunks
   where 32 run, and negative launches at 256k tokens. Where the two partitions meet in whole chunks
   only far apart (500 and 512: every 64,000 tokens), the step is fitted as its layers' chunks plus its
   head's (`_separately`). Recording costs about a second per 100k ops.
2. The all-to-alls (`SequenceLayout.all_to_all_bytes`): attention waits for them, so their time is
   added whole, at the interconnect's datasheet bandwidth (`INTERCONNECTS`): NVLink inside a node, the
   InfiniBand NIC of each GPU to the other nodes; a group of more than `GPUS_PER_NODE` ranks sends
   (sp - 8) / (sp - 1) of its bytes off the node, and the slower link sets the time.
3. ZeRO (`shard` over `gpus`): zero3 all-gathers the weights in forward and backward and reduce-scatters
   the gradients, 3 x the trainable bytes x (gpus - 1) / gpus per rank; zero2 reduce-scatters the
   gradients and all-gathers the updated weights, 2 x; over the same links. FSDP and DeepSpeed prefetch
   and bucket them, so only what compute cannot hide is added. Offload copies (PCIe) and the host
   optimizer step as `step_estimate.estimate_step` adds them, from the rank's simulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from streambp_core.config import StepSpec
from streambp_core.step.estimate.attention_kernels import attention_kernel
from streambp_core.step.estimate.roofline import GpuModel, StepEstimate, estimate_by_depth, host_optimizer_s
from streambp_core.step.simulation.sequence_layout import SequenceLayout
from streambp_core.stream_config import require_sized

REFERENCE_TOKENS = 2_048
"""The fewest tokens a rank holds in the shortest step the length fit records (`reference_lengths`)."""
GPUS_PER_NODE = 8
"""GPUs of one node (HGX boards): a larger group's collectives leave the node."""


@dataclass(frozen=True)
class Interconnect:
    """Bytes per second one GPU sends in one direction: to a GPU of its node, and off the node."""

    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    words: str


_NDR = "one 400 Gb/s InfiniBand NDR NIC per GPU (50 GB/s) off the node"
_HDR = "one 200 Gb/s InfiniBand HDR NIC per GPU (25 GB/s) off the node"
INTERCONNECTS = {
    "NVIDIA H100 SXM5 80GB": Interconnect(450e9, 50e9, f"NVLink 4, 450 GB/s per direction; {_NDR}"),
    "NVIDIA H200 SXM 141GB": Interconnect(450e9, 50e9, f"NVLink 4, 450 GB/s per direction; {_NDR}"),
    "NVIDIA A100 SXM4 80GB": Interconnect(300e9, 25e9, f"NVLink 3, 300 GB/s per direction; {_HDR}"),
    "NVIDIA A800 SXM4 80GB": Interconnect(200e9, 25e9, f"NVLink (A800), 200 GB/s per direction; {_HDR}"),
}
"""Per GPU model (`estimate.GpuModel.name`): datasheet bandwidths, no efficiency factor (a lower bound on
the time)."""


def reference_lengths(spec: StepSpec) -> tuple[int, int, int] | None:
    """The three lengths the length fit of `spec` goes through (module docstring, 1): the first the
    shortest of at least sp x `REFERENCE_TOKENS` whose every rank holds a whole number of chunks of each
    partition that cuts the step (a multiple of sp x their lcm; a partition of at least a rank's tokens
    is one chunk at every shorter length too), then twice and four times it. None for a step that no
    partition cuts (its ops do not grow in count with the length: it is always recorded)."""
    if not spec.partitioned:
        return None
    require_sized(spec.stream)
    cutting = [size for size in _partitions(spec) if size < -(-spec.seq_len_tokens // spec.sp)]
    if not cutting:
        return None
    unit = spec.sp * math.lcm(*cutting)
    first = unit * -(-spec.sp * REFERENCE_TOKENS // unit)
    return first, 2 * first, 4 * first


def _partitions(spec: StepSpec) -> set[int]:
    """The chunk sizes of `spec`'s loops: layer (or MLP) and head partitions, and the fused head's blocks
    of chunks (its norm runs once per block, `NORM_BLOCK_CHUNKS`)."""
    from streambp_core.engine.stream.head import NORM_BLOCK_CHUNKS

    stream = spec.stream
    sizes = {stream.partition_size, stream.head_partition_size, stream.mlp_chunk_tokens}
    return sizes | {stream.head_partition_size * NORM_BLOCK_CHUNKS} if stream.head_mode == "fused" else sizes


def rank_compute(spec: StepSpec, gpu: GpuModel, model) -> StepEstimate:
    """The compute estimate of one rank of `spec` at its length (module docstring, 1): fitted through
    `reference_lengths` where that records fewer ops (`_fits_sooner`), else as its layers plus its head
    where each of those fits sooner (`_separately`), else recorded. Memoised in `model.memo` under the
    step as one GPU runs it (`single_gpu_step`: the shard stages share its ops)."""
    from streambp_core.step.estimate.ops import spec_step_ops
    from streambp_core.step.run.setup import build_setup
    from streambp_core.step.simulation.simulate import single_gpu_step

    length = spec.seq_len_tokens
    kernel = attention_kernel(spec.stream.attn, gpu.name)

    def at(tokens: int) -> StepEstimate:  # every shard stage records the one step it lays out
        key = ("rank_compute", single_gpu_step(replace(spec, seq_len_tokens=tokens)), gpu.name, kernel,
               length / tokens)
        if key not in model.memo:
            model.memo[key] = estimate_by_depth(
                lambda depth: spec_step_ops(build_setup(key[1], model.at_depth(depth), "meta"), model.memo),
                model.config, gpu, kernel, key[-1])
        return model.memo[key]

    lengths = reference_lengths(spec)
    if not _fits_sooner(spec, lengths):
        parts = _separately(spec)
        if parts is None:
            return at(length)
        layers, head, neither = (rank_compute(part, gpu, model) for part in parts)

        def added(field: str):
            return getattr(layers, field) + getattr(head, field) - getattr(neither, field)

        return replace(layers, **{field: added(field) for field in (*_FITTED, "launches")})
    points = [at(tokens) for tokens in lengths]

    def fit(field: str) -> float:  # the parabola through the three points, at `length` (Lagrange)
        total = 0.0
        for i, (x_i, point) in enumerate(zip(lengths, points, strict=True)):
            weight = math.prod((length - x_j) / (x_i - x_j) for j, x_j in enumerate(lengths) if j != i)
            total += weight * getattr(point, field)
        return total

    return replace(points[0], **{field: fit(field) for field in _FITTED}, launches=round(fit("launches")))


_FITTED = ("matmul_s", "attention_s", "other_s", "launch_s")
"""The parts of a compute estimate the length fit fits (and `launches`, rounded)."""


def _fits_sooner(spec: StepSpec, lengths: tuple[int, int, int] | None) -> bool:
    """Whether the length fit through `lengths` records fewer ops than `spec` itself: a step's ops grow
    with its length at fixed partitions, so when it is longer than the three together."""
    return lengths is not None and spec.seq_len_tokens > sum(lengths)


def _separately(spec: StepSpec) -> tuple[StepSpec, StepSpec, StepSpec] | None:
    """`spec` as three steps whose compute adds up to its own, each fitted sooner than it is recorded
    (`_fits_sooner`), or None. For a step whose layer and head partitions both cut it, when their lcm puts
    its own fit's references too far. The layers' chunks and the head's run apart (the layer loops never
    read the head partition nor the head loop the layer one), so the step is its layers chunked with the
    head whole, plus its head chunked with the layers whole, less the step with both whole (counted
    twice): exact, a test checks it."""
    stream, whole = spec.stream, spec.seq_len_tokens
    if not spec.partitioned or stream.mlp_chunk_size is not None \
            or stream.partition_size == stream.head_partition_size:
        return None
    parts = (spec.replaced(head_partition_size=whole), spec.replaced(partition_size=whole),
             spec.replaced(partition_size=whole, head_partition_size=whole))
    if not all(_fits_sooner(part, reference_lengths(part)) for part in parts[:2]):
        return None
    return parts


def estimate_sequence_step(spec: StepSpec, gpu: GpuModel, model) -> StepEstimate:
    """Estimated step of one rank of `spec` (any sp, 1 included; any gpus) on `gpu` (module docstring):
    the rank's compute with the offload copies, the host optimizer step, the all-to-alls and ZeRO's
    collectives in its fields."""
    from streambp_core.step.parts.resolved import resolved
    from streambp_core.step.simulation.simulate import simulate

    model = resolved(spec.model, model)
    compute = rank_compute(spec, gpu, model)
    compute_s = compute.step_time_ms / 1e3
    if spec.offload:
        sim = simulate(spec, model)
        compute = replace(compute, to_host_bytes=sim.to_host_bytes, to_device_bytes=sim.to_device_bytes,
                          pcie_bytes_per_s=gpu.pcie_bytes_per_s)
        compute = replace(compute, transfer_s=max(0.0, compute.copy_s - compute_s),
                          host_optimizer_s=host_step_s(spec, model, gpu))
    link = INTERCONNECTS[gpu.name]
    layout = SequenceLayout.of(spec, model.config)
    sent = layout.all_to_all_bytes(spec.method) if spec.sp > 1 else 0
    zero = 0.0
    if spec.shard != "none" and spec.gpus > 1:
        from streambp_core.step.simulation.simulate import shard_layout

        trainable = shard_layout(spec, model.config, model.memo).total("trainable_full")
        passes = 3 if spec.shard.endswith("zero3") else 2
        zero = max(0.0, collective_s(passes * trainable * (spec.gpus - 1) // spec.gpus, spec.gpus, link)
                   - compute_s)
    return replace(compute, all_to_all_bytes=sent, all_to_all_s=collective_s(sent, spec.sp, link),
                   zero_s=zero, interconnect=link.words)


def collective_s(sent_bytes: int, ranks: int, link: Interconnect) -> float:
    """Seconds for one rank to send `sent_bytes` spread evenly over the other `ranks - 1`: the slower of
    its NVLink share (peers on its node) and its NIC share (peers off it)."""
    if ranks <= 1 or sent_bytes <= 0:
        return 0.0
    on_node = min(ranks, GPUS_PER_NODE) - 1
    off_node = ranks - 1 - on_node
    intra = sent_bytes * on_node / (ranks - 1) / link.intra_node_bytes_per_s
    inter = sent_bytes * off_node / (ranks - 1) / link.inter_node_bytes_per_s
    return max(intra, inter)


def host_step_s(spec, model, gpu: GpuModel) -> float:
    """The host optimizer step of `spec` (0 without the optimizer tier or an optimizer): every trainable
    parameter of the model, whichever rank steps it (`estimate.host_optimizer_s`)."""
    if not spec.stream.offload.optimizer or spec.optimizer in (None, "none"):
        return 0.0
    from streambp_core.step.simulation.simulate import shard_layout

    bytes_per_param = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}[spec.dtype]
    trainable_bytes = shard_layout(spec, model.config, model.memo).total("trainable_full")
    return host_optimizer_s(trainable_bytes // bytes_per_param, gpu)
