"""Count the collectives of a step: how many all-gathers and reduce-scatters ran, and their bytes.

`CollectiveLog` is a torch dispatch mode that sees every c10d collective the process issues while it is
active (forward and backward), as torch's own `CommDebugMode` does, and also records sizes.
Bytes are those of the full (unsharded) tensor: an all-gather's output, a reduce-scatter's input; an
all-to-all's (sequence parallelism's layout swaps) and an all-reduce's are those of its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALL_GATHER_OPS = ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_")
REDUCE_SCATTER_OPS = ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_")
ALL_TO_ALL_OPS = ("alltoall_base_", "alltoall_")
ALL_REDUCE_OPS = ("allreduce_", "allreduce_coalesced_")
KINDS = {**dict.fromkeys(ALL_GATHER_OPS, "all_gather"), **dict.fromkeys(REDUCE_SCATTER_OPS, "reduce_scatter"),
         **dict.fromkeys(ALL_TO_ALL_OPS, "all_to_all"), **dict.fromkeys(ALL_REDUCE_OPS, "all_reduce")}


@dataclass
class CollectiveCount:
    """Calls and bytes of one kind of collective."""

    calls: int = 0
    bytes: int = 0


class CollectiveLog(TorchDispatchMode):
    """Use as `with CollectiveLog() as log: ...`; then `log.calls("all_gather")`, `log.summary()`."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, CollectiveCount] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self._record(func._opname, args)
        return func(*args, **kwargs)

    def _record(self, opname: str, args: tuple) -> None:
        kind = KINDS.get(opname, opname.rstrip("_"))
        full = args[0] if kind == "all_gather" else args[1] if kind == "reduce_scatter" else args[0]
        count = self.counts.setdefault(kind, CollectiveCount())
        count.calls += 1
        count.bytes += _nbytes(full)

    def calls(self, kind: str) -> int:
        """Calls of `kind` ('all_gather', 'reduce_scatter', 'all_to_all', 'all_reduce', or a c10d op name)
        while active."""
        return self.counts.get(kind, CollectiveCount()).calls

    def summary(self) -> dict[str, dict[str, int]]:
        """{kind: {"calls": n, "bytes": b}} for every kind seen."""
        return {kind: {"calls": c.calls, "bytes": c.bytes} for kind, c in sorted(self.counts.items())}


def _nbytes(value) -> int:
    """Bytes of a tensor or of a (nested) list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0
