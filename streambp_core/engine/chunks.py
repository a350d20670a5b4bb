"""Small pieces every streamed autograd function shares: chunk bounds and accumulating backward."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn


def chunk_bounds(length: int, size: int) -> list[tuple[int, int]]:
    """[(start, end), ...] covering 0..length in pieces of at most `size` tokens."""
    return [(start, min(start + size, length)) for start in range(0, length, size)]


def trainable_parameters(modules: Iterable[nn.Module | None]) -> tuple[nn.Parameter, ...]:
    """The parameters that require grad in `modules`, each once, in a stable order."""
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        if module is None:
            continue
        for param in module.parameters():
            if param.requires_grad:
                seen.setdefault(id(param), param)
    return tuple(seen.values())


def leaf(tensor: Tensor) -> Tensor:
    """A detached view of `tensor` that starts a fresh graph and collects its own gradient."""
    return tensor.detach().requires_grad_(True)


def backward_into(
    outputs: Sequence[Tensor], grads: Sequence[Tensor], leaves: Sequence[Tensor], params: Sequence[Tensor]
) -> None:
    """Back-propagate one chunk's graph; gradients land in `.grad` of `leaves` and of `params`.

    Parameters accumulate into their own `.grad` (in place when it exists), so a streamed backward needs no
    per-layer gradient buffer of its own, just as a plain backward.
    """
    pairs = [(out, grad) for out, grad in zip(outputs, grads, strict=True) if out.requires_grad]
    inputs = [t for t in (*leaves, *params) if t.requires_grad]
    if not pairs or not inputs:
        return
    torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs], inputs=inputs)


def grad_or_zeros(tensor: Tensor) -> Tensor:
    """The gradient a leaf collected, or zeros when nothing reached it."""
    return tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
