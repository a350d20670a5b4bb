"""Speed and categories for tracked training steps, above all simulated ones on the meta device.

`SimulationMode` is a `TorchDispatchMode` entered *after* a `MemoryTracker` (so it sees each op before
the tracker does). It handles ops whose schema returns fresh tensors (no alias annotations, only
`Tensor` returns); views, in-place and `out=` ops pass through untouched (they allocate nothing new).

On the meta device it memoises: a meta kernel has no data, so its outputs' metadata (shape, stride,
dtype) is a function of the op, its inputs' metadata and its other arguments. The first call with a
given key runs the real meta kernel with every dispatch mode disabled (the tracker does not see that
throw-away run) and records the metadata; every call then allocates its outputs with
`torch.empty_strided`, exactly the allocations the kernel makes. Given its tracker (the mode directly
underneath), it allocates them below the tracker's mode and hands them to `tracker.record_new`, runs
view ops below it too, and runs an in-place op on its first argument once per key (later calls return
that argument): what the tracker would have recorded, one Python dispatch per op instead of two.
Why: many meta kernels are Python decompositions (an elementwise `add` costs ~200 us) and a chunked
step repeats the same ops on the same shapes hundreds of times. Outputs that `empty_strided` would not
reproduce byte for byte (an offset, a storage larger than the view) or that share an input's storage
although the schema does not say so (`_unsafe_view`) are never memoised: those ops run.

On other devices (a measured CPU or CUDA step) it only categorises: given the tracker, it runs the op
with every mode disabled and files the op's new storages with `tracker.track` under their category.

Category: an output whose last dimension is the vocabulary and which has a token dimension (the lm_head
output, its float32 copy, log-softmax, their gradients) is filed under `logits` whatever the active
category; everything else under the active category. The lm_head's weight gradient, (vocab, hidden),
is not matched: its last dimension is the hidden size. `checkpoint_tags` files layer inputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from streambp_core.measure.schema import (
    EagerDispatchMode,
    returns_fresh,
    storage_ids,
    writes_any,
    writes_first_only,
)
from streambp_core.measure.tags import CHECKPOINTS, LOGITS, current_category, memory_category
from streambp_core.measure.tracker import MemoryTracker
from streambp_core.models.adapters import decoder_parts

_Spec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
_META = torch.device("meta")
_IN_PLACE = "in place"
"""Memo value of an in-place op that changes nothing but its first argument's (absent) data."""


class SimulationMode(EagerDispatchMode):
    """Memoised meta kernels and the logits category (see the module docstring).

    Args:
        vocab_size: outputs with >= 2 dims whose last one is this count as logits; None: no categories.
        cache: a memo to share between steps in one process (its keys hold everything that determines
            its values, so sharing is safe); None starts an empty one.
        tracker: the tracker directly underneath: on the meta device this mode hands it the allocations
            (see the module docstring); off it, an op then runs untracked and this mode files its fresh
            outputs with `tracker.track` under their category. None: every op passes through.
    """

    def __init__(
        self, vocab_size: int | None = None, cache: dict | None = None, tracker: MemoryTracker | None = None
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.cache: dict[Any, Any] = {} if cache is None else cache
        self.tracker = tracker

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not returns_fresh(func):
            return self._aliasing(func, args, kwargs)
        devices: set[torch.device] = set()
        try:
            key = (func, _key(args, devices), _key(tuple(kwargs.items()), devices))
            entry = self.cache.get(key)
        except TypeError:  # an unhashable argument
            return func(*args, **kwargs)
        if not (devices <= {_META} and kwargs.get("device", _META) == _META):
            return self._run_and_file(func, args, kwargs)
        if entry is None:
            entry = self.cache[key] = _outputs_spec(func, args, kwargs)
        returns_tuple, first_shape, specs = entry
        with memory_category(LOGITS) if self._is_logits(first_shape) else nullcontext():
            if specs is None:
                return func(*args, **kwargs)
            if self.tracker is None:
                outs = tuple(_empty(spec) for spec in specs)
            else:  # allocate below the tracker's mode and hand it the outputs: one dispatch, not two
                with torch._C._DisableTorchDispatch():
                    outs = tuple(_empty(spec) for spec in specs)
                self.tracker.record_new(outs)
        return outs if returns_tuple else outs[0]

    def _aliasing(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op returning its inputs or views of them. Above a tracker that ignores it, on plain meta
        tensors: a view runs below the tracker's mode; an in-place op on its first argument alone runs
        once per key, and later calls return that argument (a meta kernel computes no data, and the
        first run showed that the op changes neither the argument's layout nor its storage's size)."""
        if self.tracker is None or not self.tracker.ignores(func) or not _plain_meta(args, kwargs):
            return func(*args, **kwargs)
        if not writes_first_only(func):
            if writes_any(func):
                return func(*args, **kwargs)
            with torch._C._DisableTorchDispatch():
                return func(*args, **kwargs)
        try:
            key = (func, _key(args, set()), _key(tuple(kwargs.items()), set()))
            if self.cache.get(key) is _IN_PLACE:
                return args[0]
        except TypeError:  # an unhashable argument
            return func(*args, **kwargs)
        before = _layout(args[0])
        out = func(*args, **kwargs)
        if out is args[0] and _layout(out) == before:
            self.cache[key] = _IN_PLACE
        return out

    def _run_and_file(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Off the meta device: run the op untracked, then file its new storages under their category."""
        if self.tracker is None:
            return func(*args, **kwargs)
        with _disable_current_modes():
            out = func(*args, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        taken = storage_ids((args, kwargs))
        fresh = [t for t in outs if isinstance(t, torch.Tensor) and not storage_ids(t) & taken]
        logits = bool(outs) and self._is_logits(tuple(outs[0].shape))
        self.tracker.track(fresh, LOGITS if logits else current_category())
        return out

    def _is_logits(self, shape: tuple[int, ...]) -> bool:
        return self.vocab_size is not None and len(shape) >= 2 and shape[-1] == self.vocab_size


class ForwardPhase:
    """Whether the step is still in its forward (set `done` when the loss is computed)."""

    done = False


@contextmanager
def checkpoint_tags(model: torch.nn.Module, tracker: MemoryTracker) -> Iterator[ForwardPhase]:
    """Until `phase.done`, file the embedding's and each decoder layer's output under checkpoints.

    These are the layer inputs transformers' activation checkpointing keeps (and, in `plain`, the ones
    the next layer saves); the engine tags StreamBP's own. Recomputations in backward are not retagged.
    """
    phase = ForwardPhase()

    def retag(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not phase.done:
            first = output[0] if isinstance(output, tuple | list) else output
            if isinstance(first, torch.Tensor):
                tracker.retag(first, CHECKPOINTS)

    parts = decoder_parts(model)
    handles = [module.register_forward_hook(retag) for module in (parts.embed, *parts.layers)]
    try:
        yield phase
    finally:
        for handle in handles:
            handle.remove()


def _key(values: Any, devices: set[torch.device]) -> tuple:
    """Hashable metadata of op arguments, tensors as (shape, stride, dtype, offset); adds their devices."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            devices.add(value.device)
            out.append((tuple(value.shape), value.stride(), value.dtype, value.storage_offset()))
        elif isinstance(value, (list, tuple)):
            out.append(_key(value, devices))
        else:
            out.append(value)
    return tuple(out)


def _outputs_spec(func: Any, args: tuple, kwargs: dict) -> tuple[bool, tuple, list | None]:
    """(returns a tuple, first output's shape, [spec, ...] or None) from one untracked meta run.

    Specs are None when `empty_strided` cannot reproduce an output; such an op always runs for real.
    """
    with _disable_current_modes():
        out = func(*args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    first_shape = tuple(outs[0].shape) if outs else ()
    taken = storage_ids((args, kwargs))
    specs = [None if storage_ids(t) & taken else _spec(t) for t in outs]  # e.g. `_unsafe_view` aliases
    return isinstance(out, tuple), first_shape, None if any(s is None for s in specs) else specs


def _layout(tensor: torch.Tensor) -> tuple:
    return tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.untyped_storage().nbytes()


def _plain_meta(args: tuple, kwargs: dict) -> bool:
    """Whether every tensor argument is a plain `torch.Tensor` (no subclass) on the meta device."""
    values = (*args, *kwargs.values())
    return all(type(a) is torch.Tensor and a.device == _META for a in values if isinstance(a, torch.Tensor))


def _spec(tensor: Any) -> _Spec | None:
    """(shape, stride, dtype) of a meta tensor that `empty_strided` reproduces byte for byte, else None."""
    if not isinstance(tensor, torch.Tensor) or tensor.device != _META or tensor.storage_offset() != 0:
        return None
    shape, stride = tuple(tensor.shape), tensor.stride()
    extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    if tensor.untyped_storage().nbytes() != extent * tensor.element_size():
        return None
    return shape, stride, tensor.dtype


def _empty(spec: _Spec) -> torch.Tensor:
    shape, stride, dtype = spec
    return torch.empty_strided(shape, stride, dtype=dtype, device=_META)
