"""Checkpoints in host memory: what a method keeps between forward and backward, copied out of device
memory in forward and back in backward. Host copies are filed under `tags.OFFLOADED` (the tracker's host
pool); pinned only on CUDA, where pinning exists; a meta tensor's host copy stays on meta, so a simulated
step allocates and moves the same bytes without data.

- `offloaded_checkpoint`: torch's non-reentrant checkpoint inside `save_on_host()`, the hooks of torch's
  `save_on_cpu` that transformers' `activation_checkpointing_enable(offload=True)` wraps each layer in.
  The checkpoint method uses transformers' own on an accelerator and this one where `save_on_cpu(
  pin_memory=True)` cannot run (a CPU-only torch, the meta device).
- `HostChain`: StreamBP's layer inputs and the head's hidden state, one slot per streamed function in
  forward order.
  Forward: each slot's tensor is copied into host memory on a side stream (the compute stream goes on;
  the device tensor is kept until the copy is done by `record_stream`).
  Backward consumes the slots last to first through one device buffer: the consumer of slot k reports
  each finished chunk (its slice of the buffer is read no more), and the same slice of slot k-1 is copied
  into it on the side stream, so the device holds about one layer input at a time (DESIGN.md, engine
  contract). Loading slot k-1 copies whatever no chunk report covered, then orders the compute stream
  after the side stream: events only, no host synchronisation.
  On CPU the same code runs with host = CPU and no side stream.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from streambp_core.measure.cuda import pinned_host_allocation
from streambp_core.measure.tags import CHECKPOINTS, OFFLOADED, memory_category


def pins_host_copies(tensor: Tensor) -> bool:
    """Whether `host_copy` pins the host copy of `tensor`: on CUDA only, where pinning exists."""
    return tensor.is_cuda


def host_copy(tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An empty host tensor laid out like `tensor` (in `dtype` when given), filed as offloaded: pinned CPU
    memory for a CUDA tensor, CPU memory for a CPU tensor, and meta for a meta tensor. Pinned memory that
    runs out raises `PinnedHostOutOfMemory` (an out-of-memory data point, pool 'host pinned')."""
    device = "meta" if tensor.device.type == "meta" else "cpu"
    pin = pins_host_copies(tensor)
    if not pin:
        with memory_category(OFFLOADED):
            return torch.empty_like(tensor, dtype=dtype, device=device)
    nbytes = tensor.numel() * (dtype or tensor.dtype).itemsize
    with memory_category(OFFLOADED), pinned_host_allocation(nbytes):
        return torch.empty_like(tensor, dtype=dtype, device=device, pin_memory=True)


class save_on_host(torch.autograd.graph.saved_tensors_hooks):  # lower case like torch's save_on_cpu
    """Within the block, tensors saved for backward are kept in host memory (`host_copy`) and copied back
    to their device when backward unpacks them."""

    def __init__(self) -> None:
        super().__init__(_pack, _unpack)


def _pack(tensor: Tensor) -> tuple[torch.device, Tensor]:
    host = host_copy(tensor)
    host.copy_(tensor, non_blocking=tensor.is_cuda)
    return tensor.device, host


def _unpack(packed: tuple[torch.device, Tensor]) -> Tensor:
    device, host = packed
    return torch.empty_like(host, device=device).copy_(host, non_blocking=host.is_pinned())


def offloaded_checkpoint(function, *args, **kwargs):
    """torch's checkpoint of `function` with its saved inputs in host memory (see the module docstring)."""
    with save_on_host():
        return checkpoint(function, *args, **kwargs)


@dataclass(frozen=True)
class HostSlot:
    """One tensor of a `HostChain`: load it in backward, report the chunks its consumer is done with."""

    chain: HostChain
    index: int

    def load(self) -> Tensor:
        """The saved tensor, back in device memory (the chain's buffer)."""
        return self.chain.load(self.index)

    def chunk_done(self, start: int, end: int) -> None:
        """The consumer reads positions start..end of the loaded tensor no more."""
        self.chain.chunk_done(self.index, start, end)


class HostChain:
    """Host copies of a chain of (B, T, d) tensors saved in forward and used in reverse order in backward
    (see the module docstring). One chain per training step."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._host: list[Tensor | None] = []
        self._buffer: Tensor | None = None
        self._buffer_next: int | None = None
        """The slot whose slices are being copied into the buffer."""
        self._filled: list[tuple[int, int]] = []

    def save(self, tensor: Tensor) -> HostSlot:
        """Copy `tensor` to host memory (on the side stream on CUDA); return its slot."""
        host = host_copy(tensor)
        with self._side():
            host.copy_(tensor, non_blocking=self._stream is not None)
        if self._stream is not None:
            tensor.record_stream(self._stream)
        self._host.append(host)
        return HostSlot(self, len(self._host) - 1)

    def load(self, index: int) -> Tensor:
        """Slot `index` in the device buffer: the slices its successor's chunks prefetched, the rest
        copied now. The host copy is released; after slot 0 the chain lets go of the buffer."""
        host = self._host[index]
        if host is None:
            raise RuntimeError("an offloaded tensor was loaded twice; run backward once per forward")
        if not self._buffer_fits(host) or self._buffer_next != index:
            self._filled = []
        if not self._buffer_fits(host):
            with memory_category(CHECKPOINTS):
                self._buffer = torch.empty_like(host, device=self.device)
            if self._stream is not None:
                self._buffer.record_stream(self._stream)
        buffer = self._buffer
        with self._side():
            for start, end in _missing(self._filled, host.shape[1]):
                buffer[:, start:end].copy_(host[:, start:end], non_blocking=self._stream is not None)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._host[index] = None
        self._buffer, self._buffer_next, self._filled = (buffer, index - 1, []) if index else (None, None, [])
        return buffer

    def chunk_done(self, index: int, start: int, end: int) -> None:
        """Slot `index`'s consumer is done with start..end: copy slot index-1's slice into the buffer."""
        if index == 0 or self._buffer_next != index - 1:
            return
        host = self._host[index - 1]
        if host is None or not self._buffer_fits(host):
            return
        with self._side():
            self._buffer[:, start:end].copy_(host[:, start:end], non_blocking=self._stream is not None)
        self._filled.append((start, end))

    def _buffer_fits(self, host: Tensor) -> bool:
        buffer = self._buffer
        return buffer is not None and buffer.shape == host.shape and buffer.dtype == host.dtype

    def _side(self):
        """On CUDA: the side stream, after the work queued so far on the compute stream."""
        if self._stream is None:
            return nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._stream)


def _missing(filled: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The ranges of 0..length that no (start, end) in `filled` covers."""
    gaps, position = [], 0
    for start, end in sorted(filled):
        if start > position:
            gaps.append((position, start))
        position = max(position, end)
    if position < length:
        gaps.append((position, length))
    return gaps
