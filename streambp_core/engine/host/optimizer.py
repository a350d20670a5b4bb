"""AdamW stepped in host memory: the `optimizer` offload tier, as ZeRO-Offload's CPU Adam runs it.

`HostAdamW(params)` keeps, per trainable parameter, a master copy in host memory (the parameter's dtype
promoted to at least float32) and AdamW's two moments beside it (torch's AdamW, single-tensor, over the
masters). The device holds neither.

Steps of one training step:
1. Backward: as each parameter's gradient is complete (its post-accumulate-grad hook), the gradient is
   copied to host memory (pinned, on a side stream with an event on CUDA) and the device gradient
   dropped, so the device never holds the whole model's gradients. A hook that fires while the parameter
   is held (`engine.host.unit_grads.grad_held`: a tiled or streamed unit's backward is still adding to it,
   chunk by chunk) leaves the gradient in `.grad`; the unit hands the sum over once as its backward ends.
   With a run prepared with the optimizer tier every parameter is thus sent once per backward (a tied
   embedding and head: at its last firing, the embedding's).
2. `step()`: per parameter, its host gradients (one per backward; more when gradients of several
   backward passes accumulate, or when a hook fired unheld) are summed in the master's dtype in arrival
   order, AdamW updates the master and its moments, and the master is copied into the parameter's data:
   back to the device, or into the host copy when the weights live on the host too
   (`engine.host.params`). A gradient still in `.grad` (set by hand, or never completed by a hook) is
   sent then.

Parameters held as DTensors (FSDP2's shards) keep masters, moments and gradients of their local shard:
each rank steps its own shard, as FSDP2's optimizer does. Param groups (dicts with "params" and their own
"weight_decay" or "lr", as transformers' Trainer builds them) step with their own settings.

Exactness: with parameters of float32 or float64 the masters have the parameters' dtype, so the applied
update is bitwise that of torch's AdamW (single-tensor) on the device; with bfloat16 or float16
parameters it is the fp32 master's update (of the same bf16 gradient the device summed) rounded to the
parameters' dtype (mixed-precision AdamW, not the pure-bf16 AdamW a step without the tier runs).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from streambp_core.dtypes import at_least_float32
from streambp_core.engine.host.checkpoints import host_copy
from streambp_core.engine.host.unit_grads import grad_held
from streambp_core.measure.tags import OFFLOADED, memory_category


def adamw(model: nn.Module, on_host: bool = False, *, lr: float = 1e-5, **options) -> torch.optim.Optimizer:
    """AdamW over `model`'s trainable parameters: `HostAdamW` (masters, moments and step in host memory)
    when `on_host`, else torch's, single-tensor (`foreach=False`: no fused temporaries in a peak).
    `options`: AdamW's other hyperparameters (betas, eps, weight_decay)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if on_host:
        return HostAdamW(params, lr=lr, **options)
    return torch.optim.AdamW(params, lr=lr, foreach=False, **options)



class HostAdamW(torch.optim.Optimizer):
    """AdamW with master weights, moments and the step in host memory (see the module docstring).

    Takes torch.optim.AdamW's hyperparameters. Registers one post-accumulate-grad hook per parameter;
    `remove_hooks()` takes them off (a later backward then leaves gradients on the device, stepped as
    they are)."""

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict], *, lr: float = 1e-3,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**group, "params": [p for p in group["params"] if p.requires_grad]} for group in groups]
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})
        self._stream = None
        params = [p for group in self.param_groups for p in group["params"]]
        with memory_category(OFFLOADED):
            self._masters = {id(p): _master_of(_local(p)) for p in params}
        # one torch AdamW per master: a parameter steps alone (its gradient complete), and an AdamW over
        # every master would scan them all at each parameter's step
        self._host_adamws = {id(p): torch.optim.AdamW([self._masters[id(p)]], lr=group["lr"], betas=betas,
                                                      eps=eps, weight_decay=group["weight_decay"],
                                                      foreach=False)
                             for group in self.param_groups for p in group["params"]}
        self._pending: dict[int, list[tuple[Tensor, torch.cuda.Event | None]]] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._take_grad) for p in params]

    def host_tensors(self) -> list[Tensor]:
        """Masters, moments and gradients waiting in host memory (for a tracker's host pool)."""
        state = [t for adamw in self._host_adamws.values() for s in adamw.state.values() for t in s.values()
                 if isinstance(t, Tensor)]
        pending = [host for pieces in self._pending.values() for host, _ in pieces]
        return [*self._masters.values(), *state, *pending]

    def master(self, param: nn.Parameter) -> Tensor:
        """`param`'s master copy in host memory."""
        return self._masters[id(param)]

    def remove_hooks(self) -> None:
        """Stop taking gradients to the host as they are complete."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @torch.no_grad()
    def step(self, closure=None):
        """Sum each parameter's host gradients into its master's dtype, step AdamW on the host, copy the
        updated masters into the parameters (module docstring, step 2)."""
        if closure is not None:
            raise ValueError("HostAdamW.step takes no closure")
        with memory_category(OFFLOADED):
            for group in self.param_groups:
                for param in group["params"]:
                    self._step_one(param, group["lr"])
        self._pending.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients waiting in host memory and any still on the device."""
        self._pending.clear()
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None

    def host_gradient(self, param: nn.Parameter) -> Tensor | None:
        """The gradient `step` will apply to `param`, as it sums it (its host gradients in arrival order,
        then one still in `.grad`, in the master's dtype), without taking it; None when there is none."""
        pieces = list(self._pending.get(id(param), []))
        if param.grad is not None:
            pieces.append(self._to_host(_local(param.grad)))
        return self._summed(param, pieces)

    def _step_one(self, param: nn.Parameter, lr: float) -> None:
        pieces = self._pending.pop(id(param), [])
        if param.grad is not None:  # a gradient set by hand, or made with the hooks off
            pieces.append(self._to_host(_local(param.grad)))
            param.grad = None
        grad = self._summed(param, pieces)
        if grad is None:
            return
        master = self._masters[id(param)]
        master.grad = grad
        adamw = self._host_adamws[id(param)]
        adamw.param_groups[0]["lr"] = lr
        adamw.step()
        master.grad = None
        _local(param.data).copy_(master)

    def _summed(self, param: nn.Parameter, pieces: list[tuple[Tensor, torch.cuda.Event | None]]
                ) -> Tensor | None:
        """`pieces`' host gradients summed, in arrival order, into a new tensor of `param`'s master dtype."""
        grad = None
        for host, event in pieces:
            if event is not None:
                event.synchronize()
            grad = host.to(self._masters[id(param)].dtype, copy=True) if grad is None else grad.add_(host)
        return grad

    def pending_sends(self, param: nn.Parameter) -> int:
        """How many gradients of `param` wait in host memory for the step (one per backward when each
        arrives complete)."""
        return len(self._pending.get(id(param), []))

    def _take_grad(self, param: Tensor) -> None:
        """Post-accumulate-grad hook: the gradient to host memory, the device's dropped (left in `.grad`
        while its unit still adds to it)."""
        if param.grad is None or grad_held(param):
            return
        self._pending.setdefault(id(param), []).append(self._to_host(_local(param.grad)))
        param.grad = None

    def _to_host(self, grad: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
        host = host_copy(grad)
        if not grad.is_cuda:
            return host.copy_(grad), None
        if self._stream is None:
            self._stream = torch.cuda.Stream(grad.device)
        self._stream.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(self._stream):
            host.copy_(grad, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        grad.record_stream(self._stream)
        return host, event


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local shard (FSDP2's parameters and gradients), sharing its storage; else `tensor`."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _master_of(param: nn.Parameter) -> Tensor:
    """A host copy of `param` in its dtype promoted to at least float32 (filed as offloaded; pinned for a
    CUDA parameter, so running out of pinned memory is `PinnedHostOutOfMemory`)."""
    dtype = at_least_float32(param.dtype)
    return host_copy(param.detach(), dtype).copy_(param.detach())
