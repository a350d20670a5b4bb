"""Memory categories: which part of a training step a new tensor belongs to.

The engine wraps code in `with memory_category(CHECKPOINTS): ...`; a `MemoryTracker` reads the active
category when an op allocates a storage and files its bytes under it. The category lives in a
`contextvars.ContextVar`, so nesting restores the outer one and threads do not see each other's tags.
Entering a category is one ContextVar set/reset, cheap whether or not a tracker is active.

Thread caveat: on CUDA, autograd runs backward on a device thread that does not inherit the caller's
context, so a category set around `loss.backward()` applies on CPU and meta but not on CUDA. Set the
category inside the backward code (e.g. in an `autograd.Function.backward`) to be device-independent.
"""

from __future__ import annotations

from contextvars import ContextVar, Token

WEIGHTS = "weights"
"""Model parameters."""
GRADS = "grads"
"""Parameter gradients (`.grad`)."""
OPTIMIZER = "optimizer"
"""Optimizer state, and whatever `optimizer.step()` allocates while a tracker watches it."""
CHECKPOINTS = "checkpoints"
"""Layer inputs kept from forward for backward."""
KV = "kv"
"""Attention keys/values and their gradients."""
LOGITS = "logits"
"""Logits and their gradients."""
TEMPORARIES = "temporaries"
"""Everything untagged: the default."""
KERNEL_WORKSPACE = "kernel_workspace"
"""Buffers a kernel allocates and frees inside itself (attention backward's): only a simulated step files
any here, from the kernels' source (`engine/attention/workspace.py`); no tracker sees them on a GPU."""

OFFLOADED = "offloaded"
"""Host copies of tensors saved for backward (checkpoint offload): the host pool, not device memory."""

CATEGORIES: tuple[str, ...] = (
    WEIGHTS, GRADS, OPTIMIZER, CHECKPOINTS, KV, LOGITS, TEMPORARIES, KERNEL_WORKSPACE,
)
"""The device categories, in report order: their bytes make up a device peak."""
HOST_CATEGORIES: tuple[str, ...] = (OFFLOADED,)
"""Categories held in host memory: counted in a tracker's host pool, never in its device peak."""

_CURRENT: ContextVar[str] = ContextVar("streambp_memory_category", default=TEMPORARIES)


def current_category() -> str:
    """The category new allocations are filed under right now (TEMPORARIES when untagged)."""
    return _CURRENT.get()


def check_category(name: str) -> str:
    """Return `name` if it is a known (device or host) category, else raise ValueError listing them."""
    if name not in CATEGORIES and name not in HOST_CATEGORIES:
        known = ", ".join(CATEGORIES + HOST_CATEGORIES)
        raise ValueError(f"unknown memory category {name!r}; choose from {known}")
    return name


class memory_category:  # lower case: reads like a function, `with memory_category(KV):`
    """Context manager filing allocations made inside it under category `name`.

    Example:
        with memory_category(CHECKPOINTS):
            h_in = hidden.detach().clone()
    """

    __slots__ = ("_name", "_token")

    def __init__(self, name: str) -> None:
        self._name = check_category(name)
        self._token: Token[str] | None = None

    def __enter__(self) -> memory_category:
        self._token = _CURRENT.set(self._name)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None
