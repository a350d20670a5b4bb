"""DeepSpeed ZeRO-3 for methods that drive a layer's modules themselves (streambp, mst): each unit's
parameters gathered once for its forward and once for its backward, never per chunk, and each trainable
parameter's gradient handed to ZeRO once per backward.

ZeRO-3 partitions every parameter (`p.data` is empty between uses; `p.ds_shape` is its shape) and
gathers a module's own parameters from module hooks around each call of that module. A streamed layer
calls its modules once per chunk, in forward and again in backward: those hooks would all-gather and
re-partition per chunk, so the collectives a rank issues would depend on its chunk count (ranks with
different lengths would deadlock) and DeepSpeed's module trace would differ between ranks. So, while a
run is open, a unit (a decoder layer, a head, an MoE or MLP block) is taken out of DeepSpeed's module
hooks (`_DeepSpeedHooks`: removed from the unit's modules and restored on `close`) and gathered here:

- forward: `enter` all-gathers the unit (one collective per unit, whatever the length) and brackets its
  input; `leave` re-partitions it and brackets its output.
- backward: the output's bracket gathers the unit again before the unit's backward; the input's runs
  after it (`unit_hooks.UnitInput`): it sets `ds_grad_is_ready`, takes each trainable parameter's summed
  gradient out of `.grad` (zeros where none arrived, e.g. an expert this rank's tokens never reached, so every
  rank reduces the same parameters in the same order) and returns those gradients as the bracket's own:
  autograd's accumulation then fires ZeRO's gradient hook for each parameter exactly once, in the outer
  backward (so ZeRO's end-of-backward epilogue sees them). The unit is re-partitioned after that
  accumulation (which checks a gradient against its parameter's shape): when the next unit is gathered,
  or, for the last, when the backward ends (a callback queued on autograd's engine).
- Until then every firing of a unit's parameter (the chunks' own backward passes) finds
  `ds_grad_is_ready` False (DeepSpeed >= 0.17: its stage-3 hook then leaves the gradient in `.grad`).
- A parameter a unit shares with a module outside every unit (a tied embedding and head) gets its flag
  back at the end of the unit's backward and is not returned: its last firing is the embedding's own
  accumulation, under DeepSpeed's hooks, with the head's part already summed in `.grad`.
A unit's collectives are the same on every rank: one gather per unit in forward, one in backward (none
inside a chunk loop), and every unit parameter reduced once, in the order of the units. This module never
imports DeepSpeed: it uses the methods ZeRO-3 puts on each partitioned parameter (`all_gather`,
`partition`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from streambp_core.engine.engines.unit_hooks import UnitInput, bracket_unit, in_backward, unique_params


class Zero3Units:
    """The units of a streamed method under ZeRO-3 (module docstring); `close()` gives every module its
    DeepSpeed hooks back and leaves every parameter ready (`ds_grad_is_ready`) and partitioned."""

    def __init__(self, units: Sequence[Sequence[nn.Module]], shared: Iterable[nn.Parameter] = ()) -> None:
        shared_ids = {id(param) for param in shared}
        self._params = [unique_params(modules) for modules in units]
        self._owned = [[p for p in params if p.requires_grad and id(p) not in shared_ids]
                       for params in self._params]
        self._shared = [[p for p in params if p.requires_grad and id(p) in shared_ids]
                        for params in self._params]
        self._hooks = _DeepSpeedHooks([module for modules in units for module in modules])
        self._leaves = [[m for module in modules for m in module.modules()
                         if getattr(m, "_z3_leaf", False) and id(m) in self._hooks.backward]
                        for modules in units]
        """ZeRO-3 leaf modules in each unit (DeepSpeed marks MoE blocks so by default) with DeepSpeed's
        backward hook: their parameters have no gradient hook of their own; it reduces them."""
        leaf_ids = [{id(p) for leaf in leaves for p in leaf.parameters()} for leaves in self._leaves]
        self._owned = [[p for p in owned if id(p) not in ids] for owned, ids in zip(self._owned, leaf_ids,
                                                                                     strict=True)]
        self._finished: list[int] = []
        """Units whose backward is done, released once their gradients are accumulated."""
        self._handles: list = []
        self.gathers = 0
        """How many all-gathers the units issued (tests count them: one per unit in forward and one in
        backward, whatever the chunk count)."""

    @property
    def num_units(self) -> int:
        return len(self._params)

    def enter(self, index: int, hidden: Tensor) -> Tensor:
        """Gather unit `index` for its forward; `hidden` (its input) comes back bracketed so that the
        unit's gradients are handed to ZeRO, and the unit released, after its backward."""
        self.gather(index)
        owned = self._owned[index]
        if not torch.is_grad_enabled() or not (owned or self._params[index] and hidden.requires_grad
                                               or self._leaf_params(index) or self._shared[index]):
            return hidden
        for param in (*owned, *self._shared[index], *self._leaf_params(index)):
            param.ds_grad_is_ready = False
        return UnitInput.apply(hidden, self, index, *owned)

    def leave(self, index: int, output):
        """Release unit `index` after its forward; `output` comes back bracketed so that the unit is
        gathered again before its backward."""
        if not in_backward():  # a checkpoint's recompute inside backward keeps the unit gathered
            self.release(index)
        if not isinstance(output, Tensor) or not output.requires_grad:
            return output
        return _UnitOutput.apply(output, self, index)

    def _leaf_params(self, index: int) -> list[nn.Parameter]:
        return [p for leaf in self._leaves[index] for p in leaf.parameters() if p.requires_grad]

    def hook(self, index: int, module: nn.Module) -> None:
        """Bracket unit `index` by `module`'s own forward hooks (a module transformers calls, e.g. an MLP
        block inside a checkpointed layer): its first tensor argument and its output. A checkpoint's
        recompute inside backward only gathers (the output's bracket already did; the input's releases)."""
        self._handles.extend(bracket_unit(module, index, self))

    def gather(self, index: int) -> None:
        """All-gather unit `index`'s partitioned parameters (a collective; none when all are there),
        after releasing the units whose backward is done."""
        self.release_finished()
        missing = [p for p in self._params[index] if _status(p) == "NOT_AVAILABLE"]
        if missing:
            self.gathers += 1
            missing[0].all_gather(param_list=missing)

    def release(self, index: int) -> None:
        """Re-partition unit `index`'s gathered parameters (DeepSpeed's persistent ones stay)."""
        gathered = [p for p in self._params[index] if _status(p) == "AVAILABLE" and not _persistent(p)]
        if gathered:
            gathered[0].partition(param_list=gathered, has_been_updated=False)

    def finish(self, index: int) -> list[Tensor]:
        """After unit `index`'s backward: flags set, its owned parameters' summed gradients taken out of
        `.grad` (zeros where none arrived), the unit released. Returns those gradients."""
        for param in self._shared[index]:
            param.ds_grad_is_ready = True
        grads = []
        for param in self._owned[index]:
            param.ds_grad_is_ready = True
            grads.append(param.grad if param.grad is not None else torch.zeros_like(param))
            param.grad = None
        self._reduce_leaves(index)
        if not self._finished:
            torch.autograd.Variable._execution_engine.queue_callback(self.release_finished)
        self._finished.append(index)
        return grads

    def _reduce_leaves(self, index: int) -> None:
        """Hand the leaf modules' summed gradients (zeros where none arrived) to ZeRO once: their
        flags set, then DeepSpeed's backward hook of each leaf, taken off it, called once here."""
        for leaf in self._leaves[index]:
            for param in leaf.parameters():
                if param.requires_grad:
                    param.ds_grad_is_ready = True
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
            for hook in self._hooks.backward.get(id(leaf), []):
                hook(leaf, (), ())

    def release_finished(self) -> None:
        """Release every unit whose backward is done (its gradients accumulated by now)."""
        while self._finished:
            self.release(self._finished.pop())

    def close(self) -> None:
        """Give DeepSpeed its module hooks back; every parameter ready and partitioned."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooks.restore()
        self._finished.clear()
        for index, params in enumerate(self._params):
            for param in params:
                param.ds_grad_is_ready = True
            self.release(index)


class _UnitOutput(torch.autograd.Function):
    """Identity on a unit's output whose backward gathers the unit first (before the unit's backward)."""

    @staticmethod
    def forward(ctx, output, units: Zero3Units, index: int):
        ctx.units, ctx.index = units, index
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        ctx.units.gather(ctx.index)
        return grad, None, None


class _DeepSpeedHooks:
    """DeepSpeed's module hooks (its parameter fetch and release, their backward counterparts, and a leaf
    module's gradient reduction) taken off `modules` and every module inside them; `restore()` puts
    them back in their places."""

    KINDS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks")

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self._taken: list[tuple[dict, list, dict]] = []
        self.backward: dict[int, list] = {}
        """DeepSpeed's backward hooks taken off each module (by id): a leaf module's gradient reduction."""
        seen: set[int] = set()
        for top in modules:
            for module in top.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                for kind in self.KINDS:
                    hooks = getattr(module, kind)
                    taken = {key: hook for key, hook in hooks.items() if _from_deepspeed(hook)}
                    if taken:
                        self._taken.append((hooks, list(hooks), taken))
                        if kind == "_backward_hooks":
                            self.backward[id(module)] = list(taken.values())
                        for key in taken:
                            del hooks[key]

    def restore(self) -> None:
        """Every hook back, in its original order (hooks added meanwhile stay, after them)."""
        for hooks, order, taken in self._taken:
            current = dict(hooks)
            hooks.clear()
            for key in order:
                if key in taken:
                    hooks[key] = taken[key]
                elif key in current:
                    hooks[key] = current.pop(key)
            hooks.update(current)
        self._taken.clear()
        self.backward.clear()


def _from_deepspeed(hook) -> bool:
    module = getattr(getattr(hook, "__wrapped__", hook), "__module__", "") or ""
    return module.startswith("deepspeed.")



def _status(param: Tensor) -> str:
    status = getattr(param, "ds_status", None)
    return getattr(status, "name", "")


def _persistent(param: Tensor) -> bool:
    return bool(getattr(param, "ds_persist", False))
