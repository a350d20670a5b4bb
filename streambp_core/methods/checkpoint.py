"""checkpoint: transformers' own per-layer activation checkpointing; full logits as usual.

transformers checkpoints a layer only while the layer is in train mode; for a model in eval() the run
puts the decoder layers themselves (not their children: dropout stays off) in train mode while it is
open, so eval() changes the dropout, never whether the method checkpoints.
"""

from __future__ import annotations

from streambp_core.methods.plain import PlainRun


class CheckpointRun(PlainRun):
    """Gradient checkpointing: keep each layer's input, recompute the layer in backward."""

    method = "checkpoint"

    def _setup(self) -> None:
        super()._setup()
        self._was_checkpointing = activation_checkpointing(self.model)
        self._had_input_grads_hook = hasattr(self.model, "_require_grads_hook")
        self._attributes_before = {m: set(vars(m)) for m in self.model.modules()}
        enable_activation_checkpointing(self.model)
        self._eval_layers = [layer for layer in self.parts.layers if not layer.training]
        for layer in self._eval_layers:
            layer.training = True  # the layer's own flag only: transformers' checkpoint gate

    def _teardown(self) -> None:
        for layer in self._eval_layers:
            layer.training = False
        if not self._was_checkpointing:
            disable_activation_checkpointing(self.model)
        if not self._had_input_grads_hook and hasattr(self.model, "_require_grads_hook"):
            self.model.disable_input_require_grads()
        for module, names in self._attributes_before.items():
            for name in set(vars(module)) - names:  # e.g. `_gradient_checkpointing_func` left by transformers
                delattr(module, name)
        super()._teardown()


def activation_checkpointing(model) -> bool:
    """Whether transformers' activation checkpointing is on for `model`."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def enable_activation_checkpointing(model) -> None:
    """Turn on per-layer checkpointing (non-reentrant), with the name this transformers version has."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_activation_checkpointing(model) -> None:
    """Turn per-layer checkpointing off again."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
