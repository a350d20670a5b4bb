"""What a streamed layer keeps of its input between forward and backward (the input itself, or its copy in
host memory), and whether its input gradient may be written over the output gradient's storage. Shared by
every streamed layer's autograd function (decoder, latent attention, Gated DeltaNet, sequence-parallel)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor


def overwritable(grad_out: Tensor, h_in: Tensor) -> bool:
    """Whether dL/dH_in can be written into grad_out's storage: same shape and dtype, dense."""
    return grad_out.shape == h_in.shape and grad_out.dtype == h_in.dtype and grad_out.is_contiguous()


def keep_input(ctx, plan, h_in: Tensor) -> Tensor | None:
    """A streamed layer's forward keeps its input: on the host when `plan` (a layer plan) offloads it
    (`plan.offload`, a host chain; kept in `ctx.host_input`),
    else for `save_for_backward` (what to save there: h_in, or None when it went to the host)."""
    ctx.host_input = None if plan.offload is None else plan.offload.save(h_in)
    return h_in if ctx.host_input is None else None


def kept_input(ctx, saved: Tensor | None) -> tuple[Tensor, Callable[[int, int], None] | None]:
    """The input `keep_input` kept (`saved`, or loaded back from the host) and the host's per-chunk
    release callback (None without offload)."""
    host = ctx.host_input
    return (saved, None) if host is None else (host.load(), host.chunk_done)
