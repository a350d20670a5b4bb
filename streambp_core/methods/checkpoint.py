"""checkpoint: transformers' own per-layer activation checkpointing; full logits as usual.

transformers checkpoints a layer only while the layer is in train mode; for a model in eval() the run
puts the decoder layers themselves (not their children: dropout stays off) in train mode while it is
open, so eval() changes the dropout, never whether the method checkpoints.

With `offload="checkpoints"` each layer's saved input lives in host memory: transformers' own
`activation_checkpointing_enable(offload=True)` (torch's `save_on_cpu(pin_memory=True)` around every
checkpointed layer) on an accelerator; elsewhere (a CPU-only torch, which cannot pin, and the meta device
of a simulation) the same checkpoint function with `engine.host.checkpoints.save_on_host`, which pins only on
CUDA.
"""

from __future__ import annotations

import functools
import inspect

from streambp_core.config import ConfigError
from streambp_core.engine.host.checkpoints import offloaded_checkpoint
from streambp_core.methods.hook_guards import FORWARD_HOOKS, HookScope
from streambp_core.methods.plain import PlainRun
from streambp_core.registry import Checkpoint


class CheckpointRun(Checkpoint, PlainRun):
    """Gradient checkpointing: keep each layer's input, recompute the layer in backward."""


    def _setup(self) -> None:
        if not getattr(self.model, "supports_gradient_checkpointing", True):
            raise ConfigError(f"{self.method}: {type(self.model).__name__} does not support transformers' "
                              "activation checkpointing (supports_gradient_checkpointing is False); plain "
                              "runs it")
        super()._setup()
        self._was_checkpointing = activation_checkpointing(self.model)
        self._had_input_grads_hook = hasattr(self.model, "_require_grads_hook")
        self._attributes_before = {m: set(vars(m)) for m in self.model.modules()}
        self._functions_before = {m: vars(m)["_gradient_checkpointing_func"] for m in self.model.modules()
                                  if "_gradient_checkpointing_func" in vars(m)}
        enable_activation_checkpointing(self.model, offload=self.config.offload.checkpoints)
        self._eval_layers = [layer for layer in self.parts.layers if not layer.training]
        for layer in self._eval_layers:
            layer.training = True  # the layer's own flag only: transformers' checkpoint gate

    def _hook_scopes(self) -> list[HookScope]:
        """The modules inside each decoder layer: the backward's recompute calls their forward hooks again."""
        inner = tuple(child for layer in self.parts.layers for child in layer.children())
        return [HookScope(inner, "its backward recomputes each decoder layer, calling the forward hooks of "
                                 "the modules inside it a second time", module_kinds=FORWARD_HOOKS)]

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
        for module, function in self._functions_before.items():
            module._gradient_checkpointing_func = function
        super()._teardown()


def activation_checkpointing(model) -> bool:
    """Whether transformers' activation checkpointing is on for `model`."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def enable_activation_checkpointing(model, offload: bool = False) -> None:
    """Turn on per-layer checkpointing (non-reentrant), with the name this transformers version has;
    `offload`: with each layer's saved input in host memory (see the module docstring)."""
    kwargs = {"use_reentrant": False}
    if offload and _on_accelerator(model):
        if not _has_offload_option(model):
            raise ConfigError("offloaded checkpoints need transformers >= 5.16 "
                              "(activation_checkpointing_enable(offload=True))")
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, offload=True)
        return
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if offload:
        offloading = functools.partial(offloaded_checkpoint, **kwargs)
        for module in model.modules():
            if hasattr(module, "_gradient_checkpointing_func"):
                module._gradient_checkpointing_func = offloading


def _on_accelerator(model) -> bool:
    return next(model.parameters()).device.type not in ("cpu", "meta")


def _has_offload_option(model) -> bool:
    enable = getattr(model, "activation_checkpointing_enable", None)
    return enable is not None and "offload" in inspect.signature(enable).parameters


def disable_activation_checkpointing(model) -> None:
    """Turn per-layer checkpointing off again."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
