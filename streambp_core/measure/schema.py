"""What an op's schema says, and which tensors and storages its arguments hold, for the dispatch modes
that watch a step (`MemoryTracker`, `SimulationMode`).

Each predicate is a pure function of the op overload (its `_schema`), memoised per overload.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

FRESH_OPS = frozenset({torch.ops.aten.lift_fresh.default})
"""Ops whose output storage is new although their schema says it is their input (`torch.tensor` data)."""


class EagerDispatchMode(TorchDispatchMode):
    """A dispatch mode for eager steps: torch wraps every mode's `__torch_dispatch__` in a frame that
    keeps torch.compile out of it, by default; these modes run under no compiler, and that wrapper cost
    about a tenth of a simulated step."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


@functools.cache
def returns_fresh(func: Any) -> bool:
    """Whether `func`'s schema returns only new tensors: no alias annotations, only `Tensor` returns."""
    schema = getattr(func, "_schema", None)
    return (
        schema is not None
        and len(schema.returns) > 0
        and all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns)
        and all(a.alias_info is None for a in schema.arguments)
    )


@functools.cache
def takes_tensors(func: Any) -> bool:
    """Whether `func`'s schema has a tensor argument (else no output can share an input's storage);
    True when it has no schema."""
    schema = getattr(func, "_schema", None)
    return schema is None or any("Tensor" in str(arg.type) for arg in schema.arguments)


@functools.cache
def returns_aliases_only(func: Any) -> bool:
    """Whether `func`'s schema returns only aliases of its inputs (a view or an in-place op)."""
    schema = getattr(func, "_schema", None)
    return (
        schema is not None
        and func not in FRESH_OPS
        and len(schema.returns) > 0
        and all(r.alias_info is not None for r in schema.returns)
    )


@functools.cache
def writes_any(func: Any) -> bool:
    """Whether `func`'s schema writes to an argument."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


@functools.cache
def writes_first_only(func: Any) -> bool:
    """Whether `func`'s schema writes to its first argument alone and returns just that argument."""
    arguments, returns = func._schema.arguments, func._schema.returns
    writes = [i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write]
    return (writes == [0] and len(returns) == 1 and returns[0].alias_info is not None
            and returns[0].alias_info.before_set == arguments[0].alias_info.before_set)


def tensors_in(tree: Any, found: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors in a (nested) op argument or result, in order: aten ops take and return tensors,
    lists and tuples of them, and keyword dicts (walked directly: torch's pytree costs ~1/4 of a
    simulation)."""
    found = [] if found is None else found
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, (list, tuple, dict)):
                tensors_in(item, found)
    elif isinstance(tree, dict):
        tensors_in(tuple(tree.values()), found)
    return found


def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage object, or None for tensors without one (sparse, some subclasses). A sharded
    `DTensor` (FSDP2's parameters, gradients and optimizer state) answers with its local shard's storage:
    its own is a placeholder of the global size that holds no bytes."""
    if type(tensor) is not torch.Tensor:
        tensor = getattr(tensor, "_local_tensor", tensor)
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_ids(inputs: Any) -> set[int]:
    """Identities of the storages of the tensors in a (nested) op argument or result."""
    return {id(s) for s in map(storage_of, tensors_in(inputs)) if s is not None}
