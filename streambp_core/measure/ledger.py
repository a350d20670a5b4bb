"""Byte accounting for tracked storages: live bytes per category, the peak and its breakdown.

The ledger knows nothing about ops; `MemoryTracker` tells it which storages are new. Each storage is
keyed by `id()` of its Python object (torch keeps one object per storage while the storage lives) and
watched by a weak reference. The reference's callback only queues the reference (an atomic
`deque.append`, safe from any thread and from inside garbage collection); `drain()` applies queued frees,
and the tracker drains before every addition, so the peak is exact: every free that happened before an
allocation is applied before that allocation is counted. A storage its owner resizes in place outside
any op (`watch_size`) has its size re-read at every drain too.

Two pools: storages filed under a host category (`tags.HOST_CATEGORIES`, e.g. offloaded checkpoints)
count in the host pool (`host_live_bytes`, `host_peak_bytes`), every other one in the device pool
(`live_bytes`, `peak_bytes` and the breakdowns). Each pool has its own peak.

Beside the device peak, the activation peak: the most device bytes outside the model state
(weights, gradients, optimizer state) live at once, with the breakdown there. A
sharded rank holds only a shard of the state but all of its activations, so its peak can sit where the
activations do (the LM head's backward, before the layers' gradients) rather than where one GPU's does
(the backward's end, every gradient held): `simulate` lays out both points.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass

import torch

from streambp_core.measure.tags import (
    CATEGORIES,
    GRADS,
    HOST_CATEGORIES,
    OPTIMIZER,
    WEIGHTS,
    check_category,
)


class _StorageRef(weakref.ref):
    """A weak reference to a storage that remembers the ledger key of its referent."""

    __slots__ = ("key",)
    key: int


@dataclass(slots=True)
class _Entry:
    ref: _StorageRef
    nbytes: int
    category: str


class StorageLedger:
    """Live bytes of tracked storages, per category, with the peak and the breakdown at the peak."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._freed: deque[_StorageRef] = deque()
        self._resizable: set[int] = set()
        self._by_category: dict[str, int] = dict.fromkeys(CATEGORIES + HOST_CATEGORIES, 0)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_breakdown: dict[str, int] = self.breakdown()
        self.activation_peak_bytes = 0
        """Most device bytes outside the model state live at once (module docstring)."""
        self.activation_peak_breakdown: dict[str, int] = self.breakdown()
        self.host_live_bytes = 0
        self.host_peak_bytes = 0
        self.devices: set[str] = set()

    def knows(self, storage: torch.UntypedStorage) -> bool:
        """Whether `storage` is tracked."""
        return id(storage) in self._entries

    def add(self, storage: torch.UntypedStorage, category: str, device: str) -> None:
        """Start tracking `storage` under `category` (no-op if already tracked)."""
        key = id(storage)
        if key in self._entries:
            return
        ref = _StorageRef(storage, self._freed.append)
        ref.key = key
        nbytes = storage.nbytes()
        self._entries[key] = _Entry(ref, nbytes, check_category(category))
        self.devices.add(device)
        self._change(category, nbytes)

    def category(self, storage: torch.UntypedStorage) -> str | None:
        """The category a tracked storage is filed under; None if it is not tracked."""
        entry = self._entries.get(id(storage))
        return None if entry is None else entry.category

    def retag(self, storage: torch.UntypedStorage, category: str) -> bool:
        """Move a tracked storage's bytes to `category`; False if the storage is not tracked."""
        entry = self._entries.get(id(storage))
        if entry is None:
            return False
        if (entry.category in HOST_CATEGORIES) == (category in HOST_CATEGORIES):
            self._by_category[entry.category] -= entry.nbytes
            self._by_category[category] += entry.nbytes
            if category not in HOST_CATEGORIES:
                self._new_peaks()
        else:  # a move between pools: free in one, allocate in the other
            self._change(entry.category, -entry.nbytes)
            self._change(category, entry.nbytes)
        entry.category = category
        return True

    def resize(self, storage: torch.UntypedStorage) -> bool:
        """Account a tracked storage's new size (after `resize_`); False if it is not tracked."""
        entry = self._entries.get(id(storage))
        if entry is None:
            return False
        nbytes = storage.nbytes()
        if nbytes != entry.nbytes:
            self._change(entry.category, nbytes - entry.nbytes)
            entry.nbytes = nbytes
        return True

    def watch_size(self, storage: torch.UntypedStorage) -> None:
        """Re-read a tracked storage's size at every `drain` (one resized in place outside any op)."""
        if id(storage) in self._entries:
            self._resizable.add(id(storage))

    def drain(self) -> None:
        """Apply the frees queued by weak-reference callbacks, then the sizes of watched storages."""
        while self._freed:
            ref = self._freed.popleft()
            entry = self._entries.get(ref.key)
            if entry is not None and entry.ref is ref:
                del self._entries[ref.key]
                self._change(entry.category, -entry.nbytes)
        for key in list(self._resizable):
            storage = self._entries[key].ref() if key in self._entries else None
            if storage is None:
                self._resizable.discard(key)
            else:
                self.resize(storage)

    def reset_peak(self) -> None:
        """Make what is live now the peak (of both pools)."""
        self.peak_bytes = self.live_bytes
        self.peak_breakdown = self.breakdown()
        self.activation_peak_bytes = self._activation_bytes()
        self.activation_peak_breakdown = self.peak_breakdown
        self.host_peak_bytes = self.host_live_bytes

    def breakdown(self) -> dict[str, int]:
        """Live device bytes per device category now."""
        return {name: self._by_category[name] for name in CATEGORIES}

    def host_breakdown(self) -> dict[str, int]:
        """Live host bytes per host category now."""
        return {name: self._by_category[name] for name in HOST_CATEGORIES}

    def _activation_bytes(self) -> int:
        """Live device bytes outside the model state now."""
        by_category = self._by_category
        return self.live_bytes - by_category[WEIGHTS] - by_category[GRADS] - by_category[OPTIMIZER]

    def close(self) -> None:
        """Stop watching: dropping the weak references cancels their callbacks."""
        self._entries.clear()
        self._freed.clear()
        self._resizable.clear()

    def _change(self, category: str, delta: int) -> None:
        self._by_category[category] += delta
        if category in HOST_CATEGORIES:
            self.host_live_bytes += delta
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_live_bytes)
            return
        self.live_bytes += delta
        if delta > 0:
            self._new_peaks()

    def _new_peaks(self) -> None:
        """Record the device peak where what is live now passes it, and the activation peak where the
        activations now reach it: of points with the most activations, the latest, which holds the most
        state where the state only grows (the gradients over a backward)."""
        peak = self.live_bytes > self.peak_bytes
        activations = self._activation_bytes()
        if peak or activations >= self.activation_peak_bytes:
            now = self.breakdown()  # shared by both records: neither is ever changed in place
            if peak:
                self.peak_bytes, self.peak_breakdown = self.live_bytes, now
            if activations >= self.activation_peak_bytes:
                self.activation_peak_bytes, self.activation_peak_breakdown = activations, now
