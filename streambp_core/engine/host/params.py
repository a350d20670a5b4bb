"""Weights in host memory, gathered onto the device one unit (a decoder layer, the embedding, the head) at
a time: the `params` offload tier, as ZeRO-3 with `offload_param` runs it, on one device.

Each parameter's data is replaced by a host copy (`checkpoints.host_copy`: pinned on CUDA, filed under the
tracker's host pool; a meta copy on meta). A unit is gathered (`p.data` = a device copy, filed as
weights) while it runs and released (`p.data` = the host copy) after, in forward and again in backward:

- forward: entering unit i gathers it and prefetches unit i + 1; leaving it releases it.
- backward: two identity autograd functions bracket the unit's stream of hidden states. The one on its
  output gathers the unit (and prefetches the previous unit that runs a backward) before the unit's
  backward; the one on its input releases it after. A parameter autograd saved in forward is the
  parameter itself, so the backward reads the gathered data.
- A unit called as a module (checkpoint and mst: transformers' decoder layers, final norm and head) is
  bracketed by module hooks; a checkpointed layer's recompute runs inside backward, where leaving the
  layer releases nothing (its input's bracket does). streambp brackets its streamed layers and head
  itself (`enter`, `leave`).
- A unit whose input needs no gradient (LoRA's first layer) has no input bracket: it is released when
  the backward ends (a callback queued on autograd's engine).
- The embedding's backward needs no weight (it scatters by index): it is gathered for forward only.
On CUDA a prefetch copies on a side stream and records an event the compute stream waits for when the
unit is entered (no host synchronisation); on CPU and meta the copy runs at once. A parameter shared by
two units (tied embedding and head) is on the device while either unit is gathered.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from streambp_core.engine.engines.unit_hooks import bracket_unit, in_backward, unique_params
from streambp_core.engine.host.checkpoints import host_copy
from streambp_core.measure.tags import WEIGHTS, memory_category


class HostParams:
    """The weights of `units` (each a list of modules) in host memory; see the module docstring.

    `backward_units`: the indices of units whose backward reads their weights (every unit but those
    listed in `forward_only`). `close()` puts every weight back on the device."""

    def __init__(self, units: Sequence[Sequence[nn.Module]], device: torch.device | str,
                 forward_only: Sequence[int] = ()) -> None:
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._units: list[list[nn.Parameter]] = [unique_params(modules) for modules in units]
        self._forward_only = frozenset(forward_only)
        self._host: dict[int, Tensor] = {}
        self._pending: dict[int, tuple[Tensor, torch.cuda.Event | None]] = {}
        self._gathered: set[int] = set()
        self._on_device: set[int] = set()
        """Parameters (by id) whose data is a device copy now."""
        self._unbracketed: set[int] = set()
        """Units whose input carried no bracket in the last forward: released when the backward ends."""
        self._hooks: list = []
        for params in self._units:
            for param in params:
                if id(param) not in self._host:
                    self._host[id(param)] = _to_host(param)

    @property
    def num_units(self) -> int:
        return len(self._units)

    def host_tensors(self) -> list[Tensor]:
        """Every host copy (for a tracker's host pool)."""
        return list(self._host.values())

    def gathered_units(self) -> set[int]:
        """The units whose weights are on the device now."""
        return set(self._gathered)

    def gather(self, index: int) -> None:
        """Unit `index`'s weights on the device (a prefetched copy, after its event; else copied now)."""
        for param in self._units[index]:
            if id(param) not in self._on_device:
                param.data = self._device_copy(param)
                self._on_device.add(id(param))
        self._gathered.add(index)

    def release(self, index: int) -> None:
        """Unit `index`'s weights back to their host copies (a weight another gathered unit shares stays)."""
        self._gathered.discard(index)
        shared = {id(p) for i in self._gathered for p in self._units[i]}
        for param in self._units[index]:
            if id(param) in self._on_device and id(param) not in shared:
                param.data = self._host[id(param)]
                self._on_device.discard(id(param))

    def prefetch(self, index: int) -> None:
        """Start copying unit `index`'s weights to the device (no-op for a gathered or absent unit)."""
        if not 0 <= index < len(self._units) or index in self._gathered:
            return
        for param in self._units[index]:
            if id(param) not in self._pending and id(param) not in self._on_device:
                self._copy_to_device(param)

    def enter(self, index: int, hidden: Tensor) -> Tensor:
        """Gather unit `index` for its forward, prefetch the next; `hidden` (the unit's input) comes back
        bracketed so that the unit is released after its backward."""
        self.gather(index)
        self.prefetch(index + 1)
        if not hidden.requires_grad or index in self._forward_only:
            self._unbracketed.add(index)
            return hidden
        self._unbracketed.discard(index)
        return _OnBackward.apply(hidden, self.release, index)  # released after the unit's backward

    def leave(self, index: int, output: Tensor) -> Tensor:
        """Release unit `index` after its forward; `output` comes back bracketed so that the unit is
        gathered again before its backward."""
        if not in_backward():
            self.release(index)
        if not isinstance(output, Tensor) or not output.requires_grad or index in self._forward_only:
            return output
        return _OnBackward.apply(output, self.backward_enter, index)  # gathered before it

    def backward_enter(self, index: int) -> None:
        """Before unit `index`'s backward: gather it, prefetch the previous unit that runs a backward."""
        self.gather(index)
        if index in self._unbracketed:  # its input needs no gradient (e.g. LoRA's first layer)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.release(index))
        previous = [i for i in range(index) if i not in self._forward_only]
        if previous:
            self.prefetch(previous[-1])

    def hook(self, index: int, module: nn.Module) -> None:
        """Bracket unit `index` by `module`'s forward hooks (its first tensor argument and its output, or
        the output's first element)."""
        self._hooks.extend(bracket_unit(module, index, self, gather=self._gather_ahead))

    def close(self) -> None:
        """Remove the hooks and put every weight back on the device."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for index in range(len(self._units)):
            self.gather(index)
        self._pending.clear()
        self._host.clear()

    def _device_copy(self, param: nn.Parameter) -> Tensor:
        """The parameter's device copy: the prefetched one (the compute stream waits for its event), else
        one copied now."""
        if id(param) not in self._pending:
            self._copy_to_device(param)
        buffer, event = self._pending.pop(id(param))
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return buffer

    def _copy_to_device(self, param: nn.Parameter) -> None:
        """Copy one parameter's host data into a new device buffer, pending until gathered (on CUDA on
        the side stream, with an event)."""
        host = self._host[id(param)]
        with memory_category(WEIGHTS):
            buffer = torch.empty_like(host, device=self.device)
        if self._stream is None:
            self._pending[id(param)] = (buffer.copy_(host), None)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            buffer.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._pending[id(param)] = (buffer, event)

    def _gather_ahead(self, index: int) -> None:
        """Gather unit `index` for a forward call with no tensor input, and prefetch the next."""
        self.gather(index)
        self.prefetch(index + 1)


class _OnBackward(torch.autograd.Function):
    """Identity on a unit's input or output whose backward calls `action(index)` first: on the input
    (its backward runs after the unit's) `release`, on the output (before the unit's) `backward_enter`."""

    @staticmethod
    def forward(ctx, tensor, action, index: int):
        ctx.action, ctx.index = action, index
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.action(ctx.index)
        return grad, None, None


def _to_host(param: nn.Parameter) -> Tensor:
    host = host_copy(param.data)
    host.copy_(param.data)
    param.data = host
    return host
