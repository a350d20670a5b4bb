"""The offload tiers under DeepSpeed: optimizer and params are DeepSpeed's own sections there.

A DeepSpeed engine owns the optimizer and the partitioned weights, so under it the project's optimizer
tier (`HostAdamW`) and params tier (`HostParams`) have nothing to hold: DeepSpeed's
`zero_optimization.offload_optimizer` (the fp32 masters, moments and gradient partitions in host memory,
stepped there by its CPU Adam) and `offload_param` (ZeRO-3's partitions in host memory, each gathered
onto the device when its module runs; the units of `engine.engines.zero3` gather them the same way) are those
tiers. A run under DeepSpeed asked for either tier checks that the engine's config offloads it and
holds nothing itself; the checkpoints tier stays the method's own. This module never imports DeepSpeed:
it reads the engine's `zero_offload_optimizer()` / `zero_offload_param()`.
"""

from __future__ import annotations

from torch import nn

from streambp_core.config import ConfigError
from streambp_core.tiers import Tiers

OFFLOAD_SECTIONS = {"optimizer": "offload_optimizer", "params": "offload_param"}
"""The project's tiers DeepSpeed holds itself, by the name of its `zero_optimization` section."""


def engine_tiers(engine: nn.Module) -> tuple[str, ...]:
    """The tiers `engine`'s config offloads (a section whose device is not `none`), in canonical order."""
    found = []
    for tier, section in OFFLOAD_SECTIONS.items():
        config = getattr(engine, f"zero_{section}")()
        device = getattr(config, "device", None)
        if config is not None and str(getattr(device, "value", device)).lower() not in ("none", ""):
            found.append(tier)
    return tuple(found)


def check_deepspeed_tiers(method: str, offload: Tiers, stage: int, engine: nn.Module | None) -> None:
    """ConfigError (one line) when the tier set `offload` asks under DeepSpeed ZeRO `stage` (3, or 2 for
    ZeRO-1/2: `engine.engines.reduction.zero_stage_of`) for a tier
    DeepSpeed does not hold: params below ZeRO-3 (DeepSpeed has no `offload_param` there), optimizer or
    params without the engine (its config cannot be read) or without its section on in the config."""
    wanted = [tier for tier in offload.names if tier in OFFLOAD_SECTIONS]
    if not wanted:
        return
    if "params" in wanted and stage != 3:
        raise ConfigError(f"{method}: offload params under deepspeed zero1/2: DeepSpeed offloads parameters "
                          "under ZeRO-3 only (zero_optimization.offload_param)")
    sections = ", ".join(f"zero_optimization.{OFFLOAD_SECTIONS[tier]}" for tier in wanted)
    if engine is None:
        raise ConfigError(f"{method}: offload {','.join(wanted)} under deepspeed is DeepSpeed's own "
                          f"({sections}); prepare the engine itself (prepare(engine, ...)) so that its "
                          "config is read")
    missing = [tier for tier in wanted if tier not in engine_tiers(engine)]
    if missing:
        names = ", ".join(f"zero_optimization.{OFFLOAD_SECTIONS[tier]}" for tier in missing)
        raise ConfigError(f"{method}: offload {','.join(missing)} under deepspeed is DeepSpeed's own: set "
                          f"{names} to {{device: cpu}} in the engine's config (the project's host tiers "
                          "do not run inside a DeepSpeed engine)")
