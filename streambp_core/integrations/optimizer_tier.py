"""The optimizer offload tier under a trainer: `stream_trainer(trainer, method, offload="...,optimizer")`.

The trainer builds its optimizer inside `train()`, from its own param groups (weight decay on all but the
biases and norms) and `optimizer_cls_and_kwargs` when set: `stream_trainer` sets it, on this trainer
instance (restored by `close`), to `engine.host.optimizer.HostAdamW` with the trainer's AdamW settings
(learning rate, betas, epsilon), so the masters, the two moments and the step live in host memory and each
gradient goes there as it is complete (under FSDP2, each rank its own shard's, as FSDP2's reduce-scatter
leaves it). The trainer's scheduler, accumulation and `optimizer.step()` run as they do; the applied update
equals that of the trainer's own AdamW on the device (`adamw_torch`).

Refused by name (`optimizer_refusals`): an `optim` other than AdamW (`adamw_torch`, `adamw_torch_fused`),
gradient clipping (`max_grad_norm` > 0: the trainer's clipping reads `.grad` after backward, and the tier
has taken each gradient to host memory by then), an optimizer the trainer was given already, and
DeepSpeed (whose own `offload_optimizer` holds the tier).
"""

from __future__ import annotations

from collections.abc import Callable

ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
"""The trainer's `optim` values whose update the host AdamW reproduces."""


def optimizer_refusals(trainer, engine: str) -> list[tuple[bool, str, str]]:
    """(refused, setting, why) for the optimizer tier on this trainer (module docstring)."""
    args = trainer.args
    optim = str(getattr(args.optim, "value", args.optim))
    return [
        (optim not in ADAMW_OPTIMS, f"optim {optim} with offload optimizer",
         "the optimizer tier steps AdamW in host memory; use optim adamw_torch"),
        (bool(args.max_grad_norm), f"max_grad_norm {args.max_grad_norm} with offload optimizer",
         "the trainer clips the gradients on the device after backward, and the tier has sent each to host "
         "memory as it was complete; set max_grad_norm=0"),
        (trainer.optimizer is not None or getattr(trainer, "optimizer_cls_and_kwargs", None) is not None,
         "an optimizer given to the trainer with offload optimizer", "the tier builds the trainer's AdamW"),
        (engine == "deepspeed", "offload optimizer under DeepSpeed",
         "DeepSpeed's own offload_optimizer section holds that tier (not checked under a trainer)"),
    ]


def host_adamw_for(trainer) -> tuple[type, dict]:
    """The trainer's `optimizer_cls_and_kwargs` for the tier: HostAdamW with the trainer's AdamW settings."""
    from streambp_core.engine.host.optimizer import HostAdamW

    args = trainer.args
    return HostAdamW, {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
                       "eps": args.adam_epsilon}


def set_host_optimizer(trainer) -> Callable[[], None]:
    """Make the trainer build `HostAdamW` (module docstring); returns the undo, which also takes the built
    optimizer's gradient hooks off."""
    from streambp_core.engine.host.optimizer import HostAdamW

    trainer.optimizer_cls_and_kwargs = host_adamw_for(trainer)

    def undo() -> None:
        trainer.optimizer_cls_and_kwargs = None
        built = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper, or itself
        if isinstance(built, HostAdamW):
            built.remove_hooks()

    return undo
