"""What the engines that bracket a unit of modules by its forward hooks share (`host_params`: weights
in host memory; `zero3`: DeepSpeed ZeRO-3's partitioned weights): the unit's parameters, whether a call
is a checkpoint's recompute inside backward, and the hooks that bracket the unit's input and output."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


def unique_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The parameters of `modules`, each once (a tied one shared by two modules too), in order."""
    params: dict[int, nn.Parameter] = {}
    for module in modules:
        params.update((id(p), p) for p in module.parameters())
    return list(params.values())


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a checkpoint's recompute runs inside one)."""
    return torch._C._current_graph_task_id() != -1


def entered_inputs(args: tuple, kwargs: dict, enter: Callable[[Tensor], Tensor]) -> tuple[tuple, dict] | None:
    """A forward pre-hook's replacement of a unit's input: its first positional tensor, else its
    `hidden_states` keyword, passed through `enter`; None when the call has neither."""
    if args and isinstance(args[0], Tensor):
        return (enter(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return args, {**kwargs, "hidden_states": enter(kwargs["hidden_states"])}
    return None


def bracket_hooks(module: nn.Module, pre: Callable[[tuple, dict], Any],
                  post: Callable[[Any], Any]) -> list[RemovableHandle]:
    """`module`'s forward pre-hook `pre(args, kwargs)` and forward hook `post(output)`; their handles."""
    return [module.register_forward_pre_hook(lambda _m, args, kwargs: pre(args, kwargs), with_kwargs=True),
            module.register_forward_hook(lambda _m, _a, out: post(out))]


def bracket_unit(module: nn.Module, index: int, unit: Any,
                 gather: Callable[[int], None] | None = None) -> list[RemovableHandle]:
    """Bracket unit `index` of `unit` (`HostParams`, `Zero3Units`: its `gather`, `enter`, `leave`) by
    `module`'s own forward hooks; their handles. The pre-hook enters the call's input
    (`entered_inputs`), or with no tensor input gathers by `gather` (default `unit.gather`); a
    checkpoint's recompute inside backward only gathers (the output's bracket already did; the input's
    releases). The hook leaves with the output, or its first element when it is a tuple."""
    gather = unit.gather if gather is None else gather

    def pre(args: tuple, kwargs: dict):
        if in_backward():
            unit.gather(index)
            return None
        entered = entered_inputs(args, kwargs, lambda hidden: unit.enter(index, hidden))
        if entered is None:
            gather(index)
        return entered

    def post(output):
        if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
            return (unit.leave(index, output[0]), *output[1:])
        return unit.leave(index, output)

    return bracket_hooks(module, pre, post)


class UnitInput(torch.autograd.Function):
    """Identity on a unit's input whose inputs include the unit's owned parameters; its backward runs after
    the unit's and returns their summed gradients (`units.finish(index)`: `Zero3Units`, `UnitGrads`)."""

    @staticmethod
    def forward(ctx, hidden, units: Any, index: int, *params):
        ctx.units, ctx.index = units, index
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        return (grad, None, None, *ctx.units.finish(ctx.index))
