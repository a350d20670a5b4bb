"""Sharding on torch FSDP2 (`torch.distributed.fsdp.fully_shard`), the same wrapper for every method.

Units: each decoder layer is one FSDP unit; the root unit (the model) holds the embedding, the final
norm and the LM head (one unit, so tied embeddings stay together).

- zero2: `reshard_after_forward=False`. Gradients and optimizer states are sharded; a layer's parameters
  are gathered once in forward and stay gathered until its backward is done.
- zero3: `reshard_after_forward=True`. Parameters are sharded too, gathered once for a layer's forward
  and once more for its backward.

Methods that call `model(...)` (plain, checkpoint) get FSDP's hooks from the model's own forward. StreamBP
and MsT drive the modules themselves, so they run their step through
`engine.engines.fsdp_unit.sharded_forward`:
FSDP's own pre-/post-forward hooks (all-gather; reshard; the hooks that all-gather again before the unit's
backward and reduce-scatter its gradients after it) fire once per unit per step, around the whole streamed
layer, never per chunk. A streamed layer's chunks accumulate into the gathered parameters' `.grad`; FSDP
reduce-scatters that sum once, after the last chunk.
"""

from __future__ import annotations

import torch
from torch import nn

from streambp_core.config import FSDP_STAGES, ConfigError, require_choice
from streambp_core.engine.engines.fsdp_unit import fsdp_available, is_sharded
from streambp_core.models.adapters import decoder_parts

SHARD_STAGES = FSDP_STAGES
"""zero2: gradients and optimizer states sharded; zero3: parameters sharded as well."""


def shard_model(model: nn.Module, stage: str) -> nn.Module:
    """Shard `model` in place across the default process group: one FSDP2 unit per decoder layer, then the
    root (embedding, final norm, head). Returns `model` (its class is now an FSDP subclass)."""
    require_choice("shard", stage, SHARD_STAGES)
    if not fsdp_available():
        raise ConfigError("sharding needs torch.distributed with FSDP2 (torch.distributed.fsdp.fully_shard)")
    if not torch.distributed.is_initialized():
        raise ConfigError("sharding needs an initialized process group; start ranks with run_ranks")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    reshard = stage == "zero3"
    for layer in decoder_parts(model).layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def gathered_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The tensors every FSDP unit of `model` gathers its parameters into, once FSDP2 has allocated them.

    Each unit is unsharded and resharded in turn (a collective: every rank must call it): FSDP2 makes a
    unit's unsharded parameters on its first all-gather and keeps those tensors for good, freeing and
    re-allocating their storage in place (`UntypedStorage.resize_`) on every reshard and all-gather. While
    one unit is unsharded, its parameters are the model's only ones that are not `DTensor`s. A memory
    tracker counts them with `MemoryTracker.track_resizable`. Empty for an unsharded model.
    """
    from torch.distributed.tensor import DTensor

    gathered: list[torch.Tensor] = []
    for unit in (module for module in model.modules() if is_sharded(module)):
        unit.unshard()
        gathered.extend(p for p in unit.parameters() if not isinstance(p, DTensor))
        unit.reshard()
    return gathered


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every trainable parameter's gradient as a full tensor (sharded ones all-gathered), by name.

    A collective: every rank must call it.
    """
    grads: dict[str, torch.Tensor | None] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[name] = None if grad is None else grad.detach().clone()
    return grads
