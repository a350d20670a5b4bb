"""The methods by name: what each one partitions, streams, accepts and costs, as class attributes.

Every question about a method by its name goes through `method_class(name)`: whether it takes partition
sizes, whether it drives the decoder's modules itself, which tier sets and `StreamConfig` fields it
accepts, what a search over it costs. Each run class (`streambp_core.methods`) inherits its method's class
here, so a prepared run answers the same questions (`run.partitioned`, `run.drives_modules`, ...).

Pure Python with no imports, on the core's lowest floor, so the tier rules, the step's validation and a
command refusing its input before torch is imported ask the same classes the runs are made of.
"""

from __future__ import annotations

from typing import ClassVar


class Method:
    """The facts of one method. Each method's class sets every fact itself (its run class inherits from
    several of these through the run classes it extends, so a fact left to a default could come from
    another method)."""

    method: ClassVar[str]
    """Its name, as a step, a result row and the command line spell it."""
    reference: ClassVar[bool]
    """Whether it is what the others' gradients are compared with (plain: `verify`'s reference)."""
    drives_modules: ClassVar[bool]
    """Whether it calls the decoder's modules itself rather than the model's forward: its loss comes from
    its own chunked or streamed LM head, never from the full logits (so a trainer setting that reads the
    logits is refused, and a peft wrapper's own forward does not run). The others are transformers' own
    forward and checkpointing, which hold the full logits and run every family transformers builds."""
    streams_layers: ClassVar[bool]
    """Whether each decoder layer's backward runs chunk by chunk along the sequence (`partition_size`
    query chunks; streambp)."""
    partitioned: ClassVar[bool]
    """Whether it takes partition sizes (`partition_size`, `head_partition_size`); the others ignore them."""
    keeps_checkpoints: ClassVar[bool]
    """Whether it saves layer inputs between forward and backward, which the checkpoints and params tiers
    move to the host (`tiers.tier_problem`); plain keeps every activation instead."""
    options: ClassVar[tuple[str, ...]]
    """The `StreamConfig` fields it reads (a trainer's settings name these; other fields do not change its
    step)."""
    attention_passes: ClassVar[int]
    """Attention passes per layer in a step: forward and backward, plus the recomputed forward of a method
    that recomputes its layers."""
    search_cost: ClassVar[int]
    """A max-length search's relative cost, largest first when searches are scheduled over workers."""


class Plain(Method):
    """Ordinary backpropagation: every activation of every layer and the full logits are kept."""

    method = "plain"
    reference = True
    drives_modules = False
    streams_layers = False
    partitioned = False
    keeps_checkpoints = False
    options = ()
    attention_passes = 2
    search_cost = 1


class Checkpoint(Method):
    """Gradient checkpointing: keep each layer's input, recompute the layer in backward."""

    method = "checkpoint"
    reference = False
    drives_modules = False
    streams_layers = False
    partitioned = False
    keeps_checkpoints = True
    options = ()
    attention_passes = 3
    search_cost = 2


class Mst(Method):
    """Mini-Sequence Transformer: checkpointed layers with chunked MLPs and a chunked LM head."""

    method = "mst"
    reference = False
    drives_modules = True
    streams_layers = False
    partitioned = True
    keeps_checkpoints = True
    options = ("partition_size", "mlp_chunk_size", "head_partition_size")
    attention_passes = 3
    search_cost = 3


class StreamBP(Method):
    """Exact backpropagation with one chunk's activations alive per layer."""

    method = "streambp"
    reference = False
    drives_modules = True
    streams_layers = True
    partitioned = True
    keeps_checkpoints = True
    options = ("partition_size", "head_partition_size", "head_mode", "attn")
    attention_passes = 3
    search_cost = 4


METHOD_CLASSES: tuple[type[Method], ...] = (Plain, Checkpoint, Mst, StreamBP)
"""Every method, in the order commands list them."""
METHODS = tuple(cls.method for cls in METHOD_CLASSES)
"""Every method's name, in that order."""


def method_class(name: str) -> type[Method]:
    """The class of the method called `name`; KeyError listing the methods for an unknown name
    (`config.check_method` makes it the user's ConfigError)."""
    for cls in METHOD_CLASSES:
        if cls.method == name:
            return cls
    raise KeyError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")


def methods_where(**facts: object) -> tuple[str, ...]:
    """The names of the methods whose facts have these values, in `METHODS` order
    (`methods_where(reference=False)`: every method compared with plain)."""
    unknown = [name for name in facts if name not in Method.__annotations__]
    if unknown:
        raise AttributeError(f"no method fact {', '.join(unknown)}")
    return tuple(cls.method for cls in METHOD_CLASSES
                 if all(getattr(cls, name) == value for name, value in facts.items()))
