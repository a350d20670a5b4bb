"""One file per method behind one interface: `prepare(model, method, config) -> Run`."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from streambp_core.config import ConfigError, StreamConfig, check_method, check_offload, require_sized
from streambp_core.engine.engines.reduction import engine_and_module
from streambp_core.engine.sequence.group import SequenceGroup
from streambp_core.methods.base import Run
from streambp_core.methods.checkpoint import CheckpointRun
from streambp_core.methods.mst import MstRun
from streambp_core.methods.plain import PlainRun
from streambp_core.methods.streambp import StreamBPRun

RUN_CLASSES: tuple[type[Run], ...] = (PlainRun, CheckpointRun, MstRun, StreamBPRun)
"""Each method's run: its method's class (`registry.method_class`) extended with what running it takes."""


def run_class(method: str) -> type[Run]:
    """The run class of `method` (ConfigError listing the methods for an unknown name)."""
    check_method(method)
    return next(cls for cls in RUN_CLASSES if cls.method == method)


def prepare(model: nn.Module, method: str, config: StreamConfig | None = None, *,
            sequence_group: SequenceGroup | None = None, **options) -> Run:
    """Prepare `model` (a transformers *ForCausalLM, optionally peft-wrapped) for `method`.

    `model` may be a DeepSpeed engine wrapping one: the run prepares `engine.module` and computes each
    loss through the engine's forward (which DeepSpeed ZeRO-3 needs,
    `engine.engines.reduction.through_engine`).

    `config` is a `StreamConfig` (default: the defaults); `options` are its fields by keyword
    (objective, partition_size, head_partition_size, head_mode, attn, offload, ...), replacing the
    config's; its partitions are sizes in tokens (an AUTO one is resolved first: `step.search.partitions`,
    ValueError here). Preparing never copies the weights; `run.close()` (or leaving a `with` block)
    undoes it. `sequence_group` (`engine.sequence.group.SequenceGroup`, real or simulated): Ulysses sequence
    parallelism over its ranks, each computing its shard of every sequence (`methods.sequence`).
    """
    cls = run_class(method)
    try:
        config = StreamConfig(**options) if config is None else replace(config, **options)
    except TypeError as err:
        raise ConfigError(f"unknown option for prepare(): {err}") from None
    check_offload(method, config.offload)
    require_sized(config)
    if config.keep_chunks is not None and any(p.device.type != "meta" for p in model.parameters()):
        raise ConfigError("keep_chunks thins the chunk loops for simulation: only on the meta device")
    engine, module = engine_and_module(model)
    return cls(module, config, sequence_group, engine=engine)


__all__ = ["RUN_CLASSES", "Run", "prepare", "run_class"]
