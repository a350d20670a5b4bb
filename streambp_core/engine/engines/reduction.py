"""One gradient reduction per parameter per backward on a hook-based engine (DeepSpeed ZeRO).

The mechanism and why are in `streambp_core.parallel.deepspeed`'s docstring; this module holds the part
a method's `Run` uses (it sits below the methods), and never imports DeepSpeed: a model is recognised by
the marks ZeRO leaves on its parameters (`ds_id`: stage 3; `_hp_mapping`: stages 1 and 2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch
from torch import Tensor, nn

from streambp_core.config import ConfigError
from streambp_core.models.adapters import layer_mlp

R = TypeVar("R")

MIN_VERSION = (0, 17, 0)
"""`ds_grad_is_ready` appears in DeepSpeed 0.17.0."""


def version_tuple(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string such as '0.19.8' or '0.17.0+cu121'."""
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def check_version(text: str) -> None:
    """ConfigError unless DeepSpeed `text` is at least `MIN_VERSION`."""
    if version_tuple(text) < MIN_VERSION:
        floor = ".".join(map(str, MIN_VERSION))
        raise ConfigError(f"deepspeed {text} is below {floor}: it has no ds_grad_is_ready, so a chunked "
                          "backward cannot be reduced once per parameter; install deepspeed>=0.17")


def installed_version() -> str:
    """The installed DeepSpeed's version; ConfigError when it is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("deepspeed")
    except PackageNotFoundError as error:
        raise ConfigError("engine deepspeed is not installed; pip install 'streambp-bench[deepspeed]'") \
            from error


def zero_stage_of(model: nn.Module) -> int | None:
    """3 when ZeRO-3 partitions `model`'s parameters, 2 for ZeRO-1/2 (not told apart: both reduce from
    the same hooks), None when no DeepSpeed engine holds the model."""
    params = list(model.parameters())
    if any(hasattr(param, "ds_id") for param in params):
        return 3
    if any(hasattr(param, "_hp_mapping") for param in params):
        return 2
    return None


def is_zero3(model: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions `model`'s parameters (the `ds_id` mark)."""
    return any(hasattr(param, "ds_id") for param in model.parameters())


def engine_and_module(model: nn.Module) -> tuple[nn.Module | None, nn.Module]:
    """(a DeepSpeed engine, the model it wraps) for a `DeepSpeedEngine`; (None, `model`) for any other."""
    names = {cls.__name__ for cls in type(model).__mro__}
    if "DeepSpeedEngine" in names and isinstance(getattr(model, "module", None), nn.Module):
        return model, model.module
    return None, model


def through_engine(engine: nn.Module, fn: Callable[[], R]) -> R:
    """`fn()` run as `engine`'s forward: its module's `forward` is `fn` for this one call (restored as
    it starts, so a method that calls the model itself reaches the model's own forward). The engine's
    forward starts a micro-step for ZeRO (stage 3 counts micro-steps there, to accumulate rather than
    overwrite their gradients) and the module's DeepSpeed hooks run around it, as for any forward."""
    module = engine.module
    own = vars(module).get("forward")

    def restore() -> None:
        if own is None:
            vars(module).pop("forward", None)
        else:
            module.forward = own

    def forward(*_args, **_kwargs):
        restore()
        return fn()

    module.forward = forward
    try:
        return engine()
    finally:
        restore()


def full_shape(param: Tensor) -> torch.Size:
    """A parameter's shape, also while ZeRO-3 holds it partitioned (empty data, `ds_shape`)."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def check_experts(layers: Sequence[nn.Module], method: str, drives_modules: bool) -> None:
    """ConfigError for a mixture-of-experts model under ZeRO-3 whose experts would not all be reduced
    once on every rank: a method that calls transformers' modules (plain, checkpoint) needs MoE blocks
    that hold one module per expert (`experts` a ModuleList) marked as ZeRO-3 leaf modules (DeepSpeed
    marks the known ones by default): an expert a rank's tokens never reach fires no gradient hook of
    its own on that rank. Experts fused into 3-D parameters (gpt-oss, Llama 4, transformers 5's MoE
    blocks) are one parameter for every expert, whose hook fires once whatever the routing. (A method
    that drives the modules hands every expert over itself, marked or not.)"""
    if drives_modules:
        return
    mlps = [layer_mlp(layer) for layer in layers]
    marks = [bool(getattr(mlp, "_z3_leaf", False)) for mlp in mlps
             if isinstance(getattr(mlp, "experts", None), nn.ModuleList)]
    if marks and not all(marks):
        raise ConfigError(f"{method} under deepspeed zero3 on a mixture-of-experts model needs its MoE "
                          "blocks marked as leaf modules (deepspeed.utils.set_z3_leaf_modules, before "
                          "deepspeed.initialize): ranks would otherwise reduce different experts")


def one_reduction_for(model: nn.Module, method: str) -> OneReduction | None:
    """The deferral the run of a method that calls transformers' modules (checkpoint; not plain, whose
    model is untouched) arms on every loss under DeepSpeed ZeRO-1/2; None elsewhere, and under ZeRO-3,
    where such a method fires each parameter's hook once through the modules, as plain does. (A method
    that drives the modules, `Run.drives_modules`, hands each gradient over from its units instead,
    `engine.engines.zero3`.)"""
    stage = zero_stage_of(model)
    if stage is None or method == "plain":
        return None
    check_version(installed_version())
    if stage == 3:
        return None
    return OneReduction(model.parameters())


class OneReduction:
    """One backward's gradient hooks deferred to one firing per parameter (module docstring)."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.flushes = 0
        """How many times the flush ran (one per backward)."""

    def arm(self, loss: torch.Tensor) -> torch.Tensor:
        """Defer the hooks of the backward through `loss`; returns `loss`."""
        for param in self.params:
            param.ds_grad_is_ready = False
        if loss.requires_grad:
            loss.register_hook(self._queue_flush)
        return loss

    def _queue_flush(self, grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        return grad

    def _flush(self) -> None:
        """Hand every summed gradient to autograd once, through `p.view_as(p)` (grad mode is off while
        the engine runs its callbacks, so it is turned on for the views)."""
        views, grads = [], []
        with torch.enable_grad():
            for param in reversed(self.params):
                param.ds_grad_is_ready = True
                grad = param.grad
                if grad is None:
                    continue
                param.grad = None
                views.append(param.view_as(param))
                grads.append(grad)
        self.flushes += 1
        if views:
            torch.autograd.backward(views, grads)

    def disarm(self) -> None:
        """Leave every parameter ready again (the run is closing)."""
        for param in self.params:
            param.ds_grad_is_ready = True
