"""Running a module's work as its FSDP2 unit's forward, for methods that drive the modules themselves.

A model sharded with `streambp_core.parallel.shard_model` has one FSDP2 unit per decoder layer and a
root unit. StreamBP and MsT call the layers' pieces directly, not `module(...)`, so they run a unit's work
through `sharded_forward`: FSDP's own pre-/post-forward hooks fire once per unit per step, around the
whole streamed layer, never per chunk. On a model that is not sharded it is a plain call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

R = TypeVar("R")


def fsdp_available() -> bool:
    """Whether this torch build has torch.distributed with FSDP2's `fully_shard`."""
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method  # noqa: F401
    except ImportError:
        return False
    return True


def is_sharded(module: nn.Module) -> bool:
    """Whether `module` is an FSDP2 unit (`fully_shard` was applied to it)."""
    if not fsdp_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def sharded_forward(module: nn.Module, fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)` run as `module`'s forward for FSDP2 when `module` is a unit, else plainly.

    FSDP's pre-forward all-gathers the unit's parameters (so `fn` sees them gathered) and hooks the
    tensor arguments that require grad, to reduce-scatter after the unit's backward; its post-forward
    reshards (zero3) and hooks the output, to all-gather again before that backward. The call goes
    through `register_fsdp_forward_method` on a method set for this call only and removed after it.
    `fn` must take tensors (or None) only, and read the unit's parameters inside, not before.
    """
    if not is_sharded(module):
        return fn(*args)
    from torch.distributed.fsdp import register_fsdp_forward_method

    name = "_sharded_call"
    setattr(module, name, fn)
    try:
        register_fsdp_forward_method(module, name)
        return getattr(module, name)(*args)
    finally:
        delattr(module, name)
