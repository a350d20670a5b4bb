"""Each trainable parameter's gradient handed over once per backward, for methods whose backward adds to a
parameter's `.grad` several times (the `optimizer` offload tier's `HostAdamW` sends a gradient to the host
as it is complete).

A tiled or streamed backward (mst's tiled MLP and head, streambp's layers and head) back-propagates chunk
by chunk, and each chunk adds to its unit's parameters' `.grad`: through autograd's accumulation, which
fires the parameter's post-accumulate-grad hooks each time, or by hand (an in-place GEMM), which fires
none. A hook that took the gradient away as it fired would take one partial sum per chunk; one that never
fired would leave the gradient on the device until the step. So `UnitGrads` brackets each unit (a decoder
layer, an MLP block, a head) as ZeRO-3's units are bracketed (`engine.engines.zero3`):

1. forward: `enter` marks the unit's trainable parameters held (`grad_held`) and brackets its input with
   an identity whose inputs include the parameters the unit owns;
2. backward, inside the unit: a hook that honours the mark (`HostAdamW`) leaves each firing's gradient
   in `.grad`;
3. backward, after the unit (the input's bracket runs then): the marks are cleared, each owned
   parameter's summed gradient is taken out of `.grad` and returned as the bracket's own gradient of
   that parameter, so autograd's accumulation fires its hooks once, with the whole gradient.
A parameter a unit shares with a module outside every unit (a tied embedding and head) is held until the
end of the unit's backward and not returned: its last firing is the embedding's own accumulation, with
the head's part already summed in `.grad`. A checkpoint's recompute inside backward enters nothing.
The gradients are bitwise those without the bracket: the same additions in `.grad`, moved once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from streambp_core.engine.engines.unit_hooks import UnitInput, entered_inputs, in_backward, unique_params

HELD = "_streambp_grad_held"
"""The mark `UnitGrads` sets on a parameter whose gradient is not complete yet (cleared by `close`)."""


def grad_held(param: Tensor) -> bool:
    """Whether `param`'s gradient is still being summed by its unit's backward (leave it in `.grad`)."""
    return bool(getattr(param, HELD, False))


class UnitGrads:
    """The units of a chunked method, each handing its parameters' gradients over once per backward (module
    docstring). `units`: each a list of modules; `shared`: parameters whose last firing is outside every
    unit (a tied embedding's). `close()` removes the hooks and the marks."""

    def __init__(self, units: Sequence[Sequence[nn.Module]], shared: Iterable[nn.Parameter] = ()) -> None:
        shared_ids = {id(param) for param in shared}
        params = [[p for p in unique_params(modules) if p.requires_grad] for modules in units]
        self._owned = [[p for p in unit if id(p) not in shared_ids] for unit in params]
        self._shared = [[p for p in unit if id(p) in shared_ids] for unit in params]
        self._handles: list = []
        self.handovers = 0
        """How many unit backward passes handed their gradients over (one per unit per backward)."""

    @property
    def num_units(self) -> int:
        return len(self._owned)

    def enter(self, index: int, hidden: Tensor) -> Tensor:
        """Mark unit `index`'s parameters held; `hidden` (its input) comes back bracketed so that their
        gradients are handed over after the unit's backward (unchanged outside a training forward)."""
        owned, shared = self._owned[index], self._shared[index]
        trainable = owned or shared and hidden.requires_grad  # else no backward would reach the bracket
        if not torch.is_grad_enabled() or in_backward() or not trainable:
            return hidden
        for param in (*owned, *shared):
            setattr(param, HELD, True)
        return UnitInput.apply(hidden, self, index, *owned)

    def leave(self, index: int, output):
        """`output` of unit `index`, unchanged (the hand-over needs only the input's bracket)."""
        return output

    def hook(self, index: int, module: nn.Module) -> None:
        """Bracket unit `index` by `module`'s forward pre-hook (its first tensor argument or its
        `hidden_states`), for a module that transformers calls (an MLP block inside a layer)."""
        self._handles.append(module.register_forward_pre_hook(
            lambda _module, args, kwargs: entered_inputs(args, kwargs, lambda x: self.enter(index, x)),
            with_kwargs=True))

    def finish(self, index: int) -> list[Tensor | None]:
        """After unit `index`'s backward: the marks cleared, its owned parameters' summed gradients taken
        out of `.grad` and returned (None where none arrived)."""
        for param in self._shared[index]:
            setattr(param, HELD, False)
        grads = []
        for param in self._owned[index]:
            setattr(param, HELD, False)
            grads.append(param.grad)
            param.grad = None
        self.handovers += 1
        return grads

    def close(self) -> None:
        """Remove the hooks and every mark."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for unit in (*self._owned, *self._shared):
            for param in unit:
                if hasattr(param, HELD):
                    delattr(param, HELD)
