"""Device-agnostic live-tensor memory tracker: peak bytes of live storages, by category.

`MemoryTracker` is a context manager. Inside it a `TorchDispatchMode` sees every aten op (below
autograd, so forward, backward, recomputation and optimizer steps alike) on CPU, CUDA, meta and fake
tensors. Each op output whose storage is new (not already tracked, not shared with an input) is
recorded with its byte size, device and the category active when it was made (`tags.memory_category`).
A weak reference on the storage object tells when the storage is freed; torch keeps one Python object
per storage, so the reference dies exactly when the storage does. Views share their base's storage and
so add nothing.

What is and is not seen:
- Seen: outputs of every aten op and of every `torch.library` custom op, including factory functions
  (`torch.empty`, `zeros_like`), copies, `torch.tensor(...)` (via `lift_fresh`) and in-place resizes.
- Not seen: memory an op's kernel allocates and frees inside itself (workspaces, the real body of a
  custom op: only its outputs count), and storages made before entering that are not model parameters,
  gradients or optimizer state (e.g. `input_ids`), unless `count_existing=True` or `track()` adds them.
  Nor a storage resized outside any op (FSDP2's gathered parameters) unless `track_resizable()` names it.
- Sharded tensors (`DTensor`: FSDP2's parameters, gradients, optimizer state) count their local shard.
- Categories: parameters and buffers count as weights, `.grad` tensors as grads and optimizer state as
  optimizer from the start. A gradient autograd creates inside the region is first filed under the
  category active when its op ran (usually temporaries) and moved to grads when the parameter's
  post-accumulate-grad hook fires; a peak recorded between the two shows it under the first category.
  Everything `optimizer.step()` allocates is filed under optimizer (a step pre-hook sets the category).
- Host pool: storages filed under `tags.OFFLOADED` (checkpoint offload's host copies) and, when the
  tracker watches CUDA, pinned CPU storages made inside the region (torch's `save_on_cpu`, which
  transformers' checkpoint offload uses, pins them) count in a separate host pool with its own peak
  (`host_peak_bytes`); the device peak excludes them.
  Copies between the pools (`copy_`, `_to_copy`) add up `to_host_bytes` and `to_device_bytes`.
- On CUDA the allocator's peak (also reported) exceeds the tracker's by what kernels allocate for
  themselves: measured on an H200 with torch 2.11, 65 MiB of cuBLAS workspace kept from the first
  matmul on, and ~97 MiB inside cuDNN attention's forward+backward (16 heads x 8k tokens, bf16).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_leaves

from streambp_core.measure.cuda import CudaPeak
from streambp_core.measure.ledger import StorageLedger
from streambp_core.measure.result import TrackerResult
from streambp_core.measure.schema import (
    FRESH_OPS,
    EagerDispatchMode,
    returns_aliases_only,
    storage_ids,
    storage_of,
    takes_tensors,
    tensors_in,
)
from streambp_core.measure.tags import (
    GRADS,
    HOST_CATEGORIES,
    OFFLOADED,
    OPTIMIZER,
    WEIGHTS,
    check_category,
    current_category,
    memory_category,
)

_COPY_OPS = frozenset({torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default})
"""Ops that may move bytes between the device and the host pool: (destination, source) below."""


class _AllocationWatcher(EagerDispatchMode):
    """Runs each op unchanged, then shows its inputs and outputs to the tracker."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self._tracker = tracker

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._tracker._observe(func, (args, kwargs), out)
        return out


class MemoryTracker:
    """Track live tensor bytes and their peak, by category, on any device.

    Args:
        model: its parameters and buffers count as weights and existing `.grad`s as grads from entry;
            gradients made inside the region are moved to grads when accumulated.
        optimizer: its state counts as optimizer from entry, and `step()` allocations as optimizer.
        device: count only storages on this device (e.g. "cuda:0", "meta"); None counts every device.
        cuda: report the CUDA caching allocator's peaks too; None decides by whether the model or
            optimizer has real (not fake) CUDA parameters. torch.cuda is touched only when this holds.
        count_existing: also count storages that existed before entry, from the first op that reads them.

    Example:
        with MemoryTracker(model) as tracker:
            loss = model(input_ids, labels=labels).loss
            loss.backward()
        print(tracker.result().peak_gib)
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        device: torch.device | str | None = None,
        cuda: bool | None = None,
        count_existing: bool = False,
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._device = None if device is None else torch.device(device)
        self._cuda = cuda
        self._count_existing = count_existing
        self._lock = threading.RLock()
        self._ledger = StorageLedger()
        self._mode: _AllocationWatcher | None = None
        self._hooks: list[Any] = []
        self._step_category: memory_category | None = None
        self._cuda_peak: CudaPeak | None = None
        self._result: TrackerResult | None = None
        self._pinned_is_host = False
        self.to_host_bytes = 0
        """Bytes copied from the device pool into the host pool since entry."""
        self.to_device_bytes = 0
        """Bytes copied from the host pool into the device pool since entry."""

    def __enter__(self) -> MemoryTracker:
        if self._mode is not None:
            raise RuntimeError("MemoryTracker is already active")
        self._ledger = StorageLedger()
        self._result = None
        self._cuda_peak = None
        self.to_host_bytes = self.to_device_bytes = 0
        self._seed_existing()
        self._install_hooks()
        if self._wants_cuda():
            self._cuda_peak = CudaPeak(self._cuda_device()).__enter__()
        watches_cuda = self._device is not None and self._device.type == "cuda"
        self._pinned_is_host = self._cuda_peak is not None or watches_cuda
        self._mode = _AllocationWatcher(self)
        self._mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._mode is not None
        self._mode.__exit__(exc_type, exc, tb)
        self._mode = None
        self._remove_hooks()
        if self._cuda_peak is not None:
            self._cuda_peak.read()
        self._result = self._snapshot()
        self._ledger.close()

    # --- public queries and adjustments -------------------------------------------------------------

    @property
    def live_bytes(self) -> int:
        """Bytes of tracked storages alive now."""
        with self._lock:
            self._ledger.drain()
            return self._ledger.live_bytes

    @property
    def host_live_bytes(self) -> int:
        """Bytes of host-pool storages alive now."""
        with self._lock:
            self._ledger.drain()
            return self._ledger.host_live_bytes

    @property
    def peak_bytes(self) -> int:
        """Most bytes live at once since entry or the last `reset_peak()`."""
        with self._lock:
            self._ledger.drain()
            return self._ledger.peak_bytes

    def result(self) -> TrackerResult:
        """The figures so far inside the region; after exit, the figures frozen at exit."""
        if self._result is not None:
            return self._result
        with self._lock:
            if self._cuda_peak is not None:
                self._cuda_peak.read()
            return self._snapshot()

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (and reset the CUDA allocator's peak too)."""
        with self._lock:
            self._ledger.drain()
            self._ledger.reset_peak()
            if self._cuda_peak is not None:
                self._cuda_peak.reset()

    def retag(self, tensor: torch.Tensor, category: str) -> None:
        """File `tensor`'s storage under `category` (counting it from now if it was not tracked)."""
        check_category(category)
        storage = storage_of(tensor)
        if storage is None or not self._counts(tensor):
            return
        with self._lock:
            self._ledger.drain()
            if not self._ledger.retag(storage, category):
                self._ledger.add(storage, category, str(tensor.device))

    def track(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Count existing `tensors` (e.g. input_ids made before entry) under `category` from now on."""
        for tensor in tensors:
            self.retag(tensor, category)

    def track_resizable(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Count `tensors`' storages under `category` from now on, re-reading their sizes before every op:
        for storages their owner resizes in place outside any op (FSDP2's unsharded parameters, which it
        frees with `UntypedStorage.resize_(0)` and re-allocates before the next all-gather's copy-out)."""
        tensors = list(tensors)
        self.track(tensors, category)
        with self._lock:
            for storage in map(storage_of, tensors):
                if storage is not None:  # not `filter(None, ...)`: an empty storage is falsy
                    self._ledger.watch_size(storage)

    # --- the dispatch-mode callback ---------------------------------------------------------------

    def record_new(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count `tensors`, just made by a factory op that ran below this tracker's dispatch mode (e.g.
        `simulation_mode.SimulationMode`'s memoised meta kernels), exactly as if the mode had seen that op."""
        with self._lock:
            self._ledger.drain()
            self._add_outputs(tensors, None)

    def ignores(self, func: Any) -> bool:
        """Whether a call of `func` that changes no storage's size (the caller vouches for that) can run
        below this tracker's mode, or not at all, leaving every figure as if the mode had seen it: an op
        returning only its inputs or views of them (a view or in-place op; not a copy, which may move
        bytes between pools), while storages made before entry are not picked up (`count_existing`)."""
        return not self._count_existing and func not in _COPY_OPS and returns_aliases_only(func)

    def _observe(self, func: Any, inputs: Any, out: Any) -> None:
        """Record the new storages among an op's outputs (called by the dispatch mode after each op)."""
        with self._lock:
            self._ledger.drain()
            if self._count_existing:
                self._add_untracked(tensors_in(inputs))
            aliased = func not in FRESH_OPS and takes_tensors(func)
            self._add_outputs(tensors_in(out), inputs if aliased else None)
            if func in _COPY_OPS:
                self._count_transfer(func, inputs, out)

    def _add_outputs(self, tensors: Iterable[torch.Tensor], inputs: Any) -> None:
        """Track the new storages among `tensors`; with `inputs`, not those shared with an input."""
        input_ids: set[int] | None = None
        for tensor in tensors:
            storage = storage_of(tensor)
            if storage is None or self._ledger.resize(storage):
                continue
            category = self._category_of_new(tensor)
            if category is None:
                continue
            if inputs is not None:
                input_ids = storage_ids(inputs) if input_ids is None else input_ids
                if id(storage) in input_ids:
                    continue  # a view of, or in-place result on, an untracked input
            self._ledger.add(storage, category, str(tensor.device))

    def _category_of_new(self, tensor: torch.Tensor) -> str | None:
        """The category a new storage of `tensor` is filed under; None when this tracker ignores it."""
        category = current_category()
        if category in HOST_CATEGORIES:
            return category
        host_copy = self._pinned_is_host and tensor.device.type == "cpu" and tensor.is_pinned()
        if host_copy:
            return OFFLOADED
        return category if self._counts(tensor) else None

    def _count_transfer(self, func: Any, inputs: Any, out: Any) -> None:
        """Add a copy between the pools to `to_host_bytes` or `to_device_bytes`."""
        args = inputs[0]
        dst, src = (args[0], args[1]) if func is torch.ops.aten.copy_.default else (out, args[0])
        if not isinstance(dst, torch.Tensor) or not isinstance(src, torch.Tensor):
            return
        dst_host, src_host = self._in_host_pool(dst), self._in_host_pool(src)
        if dst_host and not src_host:
            self.to_host_bytes += dst.numel() * dst.element_size()
        elif src_host and not dst_host:
            self.to_device_bytes += dst.numel() * dst.element_size()

    def _in_host_pool(self, tensor: torch.Tensor) -> bool:
        storage = storage_of(tensor)
        return storage is not None and self._ledger.category(storage) in HOST_CATEGORIES

    def _add_untracked(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            storage = storage_of(tensor)
            if storage is not None and not self._ledger.knows(storage) and self._counts(tensor):
                self._ledger.add(storage, current_category(), str(tensor.device))

    # --- setup and teardown -------------------------------------------------------------------------

    def _parameters(self) -> list[torch.Tensor]:
        """Model and optimizer parameters, each once."""
        params: dict[int, torch.Tensor] = {}
        if self._model is not None:
            params.update((id(p), p) for p in self._model.parameters())
        if self._optimizer is not None:
            for group in self._optimizer.param_groups:
                params.update((id(p), p) for p in group["params"])
        return list(params.values())

    def _seed_existing(self) -> None:
        """Count parameters, buffers, existing grads and optimizer state from the start."""
        params = self._parameters()
        buffers = list(self._model.buffers()) if self._model is not None else []
        with memory_category(WEIGHTS):
            self._add_untracked(params + buffers)
        with memory_category(GRADS):
            self._add_untracked(p.grad for p in params if p.grad is not None)
        with memory_category(OPTIMIZER):
            self._add_untracked(self._optimizer_state())

    def _optimizer_state(self) -> Iterator[torch.Tensor]:
        if self._optimizer is None:
            return iter(())
        return (t for t in tree_leaves(list(self._optimizer.state.values())) if isinstance(t, torch.Tensor))

    def _install_hooks(self) -> None:
        for param in self._parameters():
            if param.requires_grad and param.is_leaf:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad_accumulated))
        if self._optimizer is not None:
            self._hooks.append(self._optimizer.register_step_pre_hook(self._on_step_start))
            self._hooks.append(self._optimizer.register_step_post_hook(self._on_step_end))

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._step_category is not None:  # a step raised before its post-hook ran
            self._step_category.__exit__(None, None, None)
            self._step_category = None

    def _on_grad_accumulated(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.retag(param.grad, GRADS)

    def _on_step_start(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._step_category = memory_category(OPTIMIZER).__enter__()

    def _on_step_end(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._step_category is not None:
            self._step_category.__exit__(None, None, None)
            self._step_category = None
        self.track(self._optimizer_state(), OPTIMIZER)

    # --- helpers --------------------------------------------------------------------------------------

    def _counts(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives on the device this tracker counts."""
        wanted = self._device
        if wanted is None:
            return True
        device = tensor.device
        return device.type == wanted.type and (wanted.index is None or device.index == wanted.index)

    def _wants_cuda(self) -> bool:
        if self._cuda is not None:
            return self._cuda
        real_cuda = any(p.is_cuda and not is_fake(p) for p in self._parameters())
        return real_cuda and torch.cuda.is_available()

    def _cuda_device(self) -> torch.device | None:
        if self._device is not None and self._device.type == "cuda":
            return self._device
        return next((p.device for p in self._parameters() if p.is_cuda and not is_fake(p)), None)

    def _snapshot(self) -> TrackerResult:
        self._ledger.drain()
        ledger, cuda_peak = self._ledger, self._cuda_peak
        device = str(self._device) if self._device is not None else ",".join(sorted(ledger.devices))
        return TrackerResult(
            peak_bytes=ledger.peak_bytes,
            peak_breakdown_bytes=dict(ledger.peak_breakdown),
            activation_peak_breakdown_bytes=dict(ledger.activation_peak_breakdown),
            end_bytes=ledger.live_bytes,
            end_breakdown_bytes=ledger.breakdown(),
            device=device,
            **({} if cuda_peak is None else cuda_peak.figures()),
            host_peak_bytes=ledger.host_peak_bytes, host_end_bytes=ledger.host_live_bytes,
            to_host_bytes=self.to_host_bytes, to_device_bytes=self.to_device_bytes,
        )

