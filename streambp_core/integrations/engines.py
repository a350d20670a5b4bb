"""Trainers on sharded engines: what `stream_trainer` does when accelerate's FSDP2 or DeepSpeed plugin
holds the trainer (`accelerate launch --config_file ...`, or `TrainingArguments(fsdp=..., deepspeed=...)`).

The engine is read from the trainer's own accelerator (`trainer_engine`):

- **FSDP2** (accelerate's FSDP plugin, `fsdp_version: 2`). StreamBP and MsT run a unit's work through
  `engine.engines.fsdp_unit.sharded_forward`, so every FSDP2 unit they read must be a decoder layer or the
  root. accelerate 1.15's `fsdp2_prepare_model` carves the embedding and [final norm, LM head] into units of
  their own; the streamed head reads those weights outside any unit's forward, where they are still sharded.
  So `stream_trainer` shards the model itself, as the plugin says (`reshard_after_forward`: zero3 when true,
  zero2 when false), with one unit per decoder layer and the root holding the embedding, the final norm and
  the head (the layout `verify fsdp` checks), and accelerate, seeing an FSDP2 model, keeps it. The wrap policy
  must name exactly the decoder layer class (`TRANSFORMER_BASED_WRAP`); any other policy, CPU offload, FSDP's
  own activation checkpointing, a mixed-precision policy, ignored modules or `cpu_ram_efficient_loading` is
  refused by name.
- **DeepSpeed** (accelerate's DeepSpeed plugin, ZeRO-1, 2 or 3). The trainer wraps the model in the
  DeepSpeed engine inside `train()`, after `stream_trainer`; ZeRO reduces a gradient from a hook at each
  accumulation into it, and a streamed backward accumulates chunk by chunk. On ZeRO-1/2,
  `DeepSpeedReduction` attaches at the first training forward after the engine exists: one `OneReduction`
  (`engine.engines.reduction`, the mechanism `parallel.deepspeed` describes) armed once per backward, on the
  decoder stack's output (a forward hook) or on the streamed loss (StreamBP under `Trainer`, whose loss
  never calls the stack), so each parameter is reduced once per micro-step. On ZeRO-3 the run is
  prepared on the engine itself, once per optimizer step, from a trainer callback
  (`zero3_trainer.Zero3Preparation`), as `parallel.deepspeed` prepares a user's engine. Optimizer or
  parameter offload is refused (not checked).
- DDP and FSDP1 are refused: their gradient hooks fire per accumulation and nothing defers them.
"""

from __future__ import annotations

import torch
from torch import nn

from streambp_core.engine.engines.reduction import (
    OneReduction,
    check_version,
    installed_version,
    one_reduction_for,
    zero_stage_of,
)
from streambp_core.methods.guards import parts_of

ENGINES = ("single", "ddp", "fsdp1", "fsdp2", "deepspeed")
"""What can hold a trainer: one process, DDP, accelerate's FSDP plugin (version 1 or 2), DeepSpeed."""
DEEPSPEED_STAGES = (1, 2, 3)
"""ZeRO stages a trainer streams on (ZeRO-3 through `zero3_trainer`)."""
ZERO_1_OR_2 = 2
"""What `zero_stage_of` answers for a model ZeRO-1 or ZeRO-2 holds."""
WRAP_SETTING = "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP, fsdp_transformer_layer_cls_to_wrap: {}"


def trainer_engine(trainer) -> str:
    """One of ENGINES: the engine the trainer's accelerator will wrap its model in."""
    state = getattr(getattr(trainer, "accelerator", None), "state", None)
    if getattr(state, "deepspeed_plugin", None) is not None:
        return "deepspeed"
    plugin = getattr(state, "fsdp_plugin", None)
    if plugin is not None:
        return "fsdp2" if getattr(plugin, "fsdp_version", 1) == 2 else "fsdp1"
    args = trainer.args
    if args.world_size > 1:
        return "ddp"
    if args.fsdp or args.deepspeed:  # set on the arguments but not taken by an accelerator (one process)
        return "fsdp1" if args.fsdp else "deepspeed"
    return "single"


def engine_refusals(trainer, method: str | None = None) -> list[tuple[bool, str, str]]:
    """(refused, setting, why) for the trainer's engine training `method`, as `checks._refusals` lists
    them."""
    engine = trainer_engine(trainer)
    if engine == "fsdp2":
        return fsdp2_refusals(trainer.accelerator.state.fsdp_plugin, trainer.model)
    if engine == "deepspeed":
        refusals = deepspeed_refusals(getattr(trainer.accelerator.state, "deepspeed_plugin", None))
        if deepspeed_stage(trainer) == 3 and method is not None:
            from streambp_core.integrations.zero3_trainer import zero3_refusals

            refusals += zero3_refusals(trainer, method)
        return refusals
    why = "its gradient hooks fire at every accumulation and the streamed backward accumulates chunk by " \
          "chunk; use accelerate's FSDP plugin with fsdp_version 2, or its DeepSpeed plugin"
    return [(engine == "ddp", "multi-process DDP", why), (engine == "fsdp1", "FSDP version 1", why)]


def fsdp2_refusals(plugin, model: nn.Module) -> list[tuple[bool, str, str]]:
    """What of accelerate's FSDP2 plugin the streamed layout cannot honour (module docstring)."""
    layer_class = type(parts_of(model).layers[0]).__name__
    wrapped = wrapped_classes(plugin, model)
    wrap = "" if wrapped is None else f" ({', '.join(sorted(wrapped)) or 'no class'})"
    offload = type(getattr(plugin, "cpu_offload", None)).__name__ == "CPUOffloadPolicy"
    policy = getattr(plugin, "mixed_precision_policy", None)
    reshard = getattr(plugin, "reshard_after_forward", True)
    unit = ("the streamed methods need one FSDP2 unit per decoder layer; set "
            f"{WRAP_SETTING.format(layer_class)}")
    return [
        (wrapped != {layer_class}, f"FSDP2 auto wrap policy {_policy_name(plugin)}{wrap}", unit),
        (offload, "FSDP2 CPU offload (fsdp_offload_params)", "it is not checked with streamed layers"),
        (policy is not None and any(getattr(policy, f, None) is not None for f in ("param_dtype",
                                                                                    "reduce_dtype")),
         "an FSDP2 mixed-precision policy", "the streamed layers compute in the weights' dtype; load the "
                                            "model in bfloat16 instead"),
        (bool(getattr(plugin, "activation_checkpointing", False)), "fsdp_activation_checkpointing",
         "the method decides what is recomputed; use method checkpoint for checkpointing"),
        (bool(getattr(plugin, "ignored_modules", None)), "fsdp_ignored_modules",
         "every parameter must be in a decoder layer's unit or the root's"),
        (bool(getattr(plugin, "cpu_ram_efficient_loading", False)), "fsdp_cpu_ram_efficient_loading",
         "stream_trainer shards the model before accelerate would load rank 0's weights into it"),
        (not isinstance(reshard, bool), f"fsdp_reshard_after_forward={reshard!r}",
         "give true (zero3) or false (zero2)"),
    ]


def wrapped_classes(plugin, model: nn.Module) -> set[str] | None:
    """The module classes the plugin's transformer-based wrap policy makes units of (its class names,
    else the model's `_no_split_modules`, as accelerate resolves them); None for any other policy."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = getattr(plugin, "auto_wrap_policy", None)
    if getattr(policy, "func", policy) is not transformer_auto_wrap_policy:
        return None
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    if names is None:
        names = list(getattr(model, "_no_split_modules", None) or [])
    return set(names)


def _policy_name(plugin) -> str:
    policy = getattr(plugin, "auto_wrap_policy", None)
    policy = getattr(policy, "func", policy)
    return "NO_WRAP" if policy is None else getattr(policy, "__name__", type(policy).__name__)


def deepspeed_refusals(plugin) -> list[tuple[bool, str, str]]:
    """What of accelerate's DeepSpeed plugin cannot be reduced once per parameter (module docstring)."""
    check_version(installed_version())  # missing, or below the floor: ConfigError naming it
    zero = _zero_section(plugin)
    stage = int(zero.get("stage", 0) or 0)
    offloaded = [name for name in ("offload_optimizer", "offload_param")
                 if (zero.get(name) or {}).get("device", "none") not in ("none", None)]
    return [
        (stage not in DEEPSPEED_STAGES, f"DeepSpeed zero_stage {stage}",
         "stream_trainer runs on ZeRO-1, ZeRO-2 and ZeRO-3"),
        (bool(offloaded), f"DeepSpeed {' and '.join(offloaded)}", "it is not checked with streamed layers"),
    ]


def deepspeed_stage(trainer) -> int:
    """The ZeRO stage the trainer's DeepSpeed plugin configures (0 when it names none)."""
    zero = _zero_section(getattr(trainer.accelerator.state, "deepspeed_plugin", None))
    return int(zero.get("stage", 0) or 0)


def _zero_section(plugin) -> dict:
    """The `zero_optimization` section of accelerate's DeepSpeed plugin's config ({} when none)."""
    config = getattr(plugin, "deepspeed_config", None) or {}
    return config.get("zero_optimization", {}) or {}


def shard_for_plugin(trainer) -> None:
    """Shard `trainer.model` in place as its FSDP2 plugin says, one unit per decoder layer and the root
    (module docstring); accelerate's `fsdp2_prepare_model` then keeps it. A collective on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = trainer.model
    if isinstance(model, FSDPModule):
        return
    accelerator = trainer.accelerator
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None:
        mesh = init_device_mesh(accelerator.device.type, (torch.distributed.get_world_size(),))
    plugin = accelerator.state.fsdp_plugin
    # As accelerate's prepare does first: the policy finds the layer class by its name, which fully_shard
    # changes (Qwen3DecoderLayer becomes FSDPQwen3DecoderLayer).
    plugin.set_auto_wrap_policy(model)
    reshard = plugin.reshard_after_forward
    for layer in parts_of(model).layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


class DeepSpeedReduction:
    """One `OneReduction` armed once per backward of a model the trainer's DeepSpeed engine holds."""

    def __init__(self, model: nn.Module, method: str) -> None:
        self.model = model
        self.method = method
        self.reduction: OneReduction | None = None
        """Made at the first training forward under the engine (ZeRO marks the parameters then)."""
        self._armed = False

    def arm(self, tensor: torch.Tensor) -> torch.Tensor:
        """Arm the deferral on `tensor` (a training forward's output) unless this backward has it already;
        returns `tensor`. Outside a ZeRO engine (before `train()` wraps the model) it does nothing."""
        if self._armed or not tensor.requires_grad or zero_stage_of(self.model) != ZERO_1_OR_2:
            return tensor
        if self.reduction is None:
            self.reduction = one_reduction_for(self.model, self.method)
        if self.reduction is None:  # plain: autograd fires each hook once
            return tensor
        self._armed = True
        self.reduction.arm(tensor)
        tensor.register_hook(self._queue_rearm)  # after the reduction's hook: its flush runs first
        return tensor

    def hook_output(self, module: nn.Module, args, output):
        """A forward hook: arm on the decoder stack's `last_hidden_state`."""
        hidden = getattr(output, "last_hidden_state", None)
        if isinstance(hidden, torch.Tensor):
            self.arm(hidden)

    def _queue_rearm(self, grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(self._rearm)
        return grad

    def _rearm(self) -> None:
        self._armed = False

    def close(self) -> None:
        """Leave every parameter ready again."""
        if self.reduction is not None:
            self.reduction.disarm()
