"""Small pieces every streamed autograd function shares: chunk bounds and accumulating backward, and the
key bands of chunked local attention (`LocalChunks`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn


def chunk_bounds(length: int, size: int, keep: int | None = None) -> list[tuple[int, int]]:
    """[(start, end), ...] covering 0..length in pieces of at most `size` tokens.

    `keep` (simulation only, see `StreamConfig.keep_chunks`): only the first and last `keep` pieces, so
    the loop does not cover the whole length; None keeps every piece.
    """
    starts = range(0, length, size)
    if keep is not None and len(starts) > 2 * keep:  # build only the kept pieces
        starts = [*starts[:keep], *starts[-keep:]]
    return [(start, min(start + size, length)) for start in starts]


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


def allowed_mask(
    num_queries: int, key_valid: Tensor | None, num_keys: int | None = None, window: int | None = None
) -> Tensor:
    """Boolean (B or 1, c, e) mask of a query chunk, the last c of e positions: lower-right causal and,
    when given, the key padding `key_valid` (B, e) and a sliding `window` (a query sees itself and the
    window - 1 keys before it: the lower-right band). A (B, c, e) `key_valid` is a per-query mask (the
    keys of each query's own document in a packed row, `engine.packing`)."""
    e = key_valid.shape[-1] if key_valid is not None else num_keys
    device = key_valid.device if key_valid is not None else None
    q_pos = torch.arange(e - num_queries, e, device=device)
    distance = q_pos[:, None] - torch.arange(e, device=device)[None, :]  # (c, e)
    allowed = distance >= 0
    if window is not None:
        allowed = allowed & (distance < window)
    if key_valid is None:
        return allowed[None]
    return allowed[None] & (key_valid if key_valid.dim() == 3 else key_valid[:, None, :])


def window_start(end: int, num_queries: int, window: int | None) -> int:
    """First key position a chunk of `num_queries` queries ending at `end` can see: 0 without a window,
    else the first key of the earliest query's band."""
    if window is None:
        return 0
    return max(0, end - num_queries - window + 1)


def check_accumulates(ctx, what: str) -> None:
    """RuntimeError, in the backward of `ctx`'s autograd function, when this backward will not accumulate
    into `ctx.params` (its last inputs): `torch.autograd.grad`, or `backward(inputs=...)` leaving one out.
    `what` (e.g. "streambp's chunked decoder layer") writes their gradients into `.grad` itself instead of
    returning them, so such a call would get None for them and find them in `.grad` instead."""
    edges = ctx.next_functions[len(ctx.next_functions) - len(ctx.params):]
    for node, _ in edges:
        if node is not None and not _will_execute(node):
            raise RuntimeError(f"torch.autograd.grad (or backward(inputs=...)) is not supported through "
                               f"{what}: it writes its parameters' gradients into .grad rather than "
                               "returning them; use loss.backward() and read each parameter's .grad")


def _will_execute(node) -> bool:
    """Whether the running backward executes `node`; torch refuses the question for a leaf's node under
    `torch.autograd.grad`, which executes none."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return False


@dataclass(frozen=True)
class LocalChunks:
    """Chunked local attention (Llama 4's `attention_chunk_size`): a query sees only the keys of its own chunk
    of `size` positions. transformers' mask (`masking_utils.chunked_overlay`) numbers the chunks of a row
    from its first real token, index t in chunk (t - left padding) // size, and in packed rows by each
    token's position id, position // size (so each document's chunks start with it); `ids` (B, T) holds
    that number, or is None where every row's chunks start at index 0 (no padding, not packed) and a
    chunk's keys are host arithmetic."""

    size: int
    ids: Tensor | None
    batch: int
    device: torch.device

    def first_key(self, start: int) -> int:
        """The earliest key a query chunk starting at `start` can see in any row."""
        if self.ids is None:
            return start // self.size * self.size
        return max(0, start - self.size + 1)

    def narrow(self, allowed: Tensor | None, start: int, end: int, first: int) -> Tensor | None:
        """The key mask of query chunk start..end over keys first..end, `allowed` ((B, e) key validity,
        (B, c, e) per query, or None), narrowed to each query's own chunk: (B, c, e), or `allowed`
        itself when every key in the band shares the queries' one chunk."""
        if self.ids is None:
            if (end - 1) // self.size == first // self.size:
                return allowed
            queries = torch.arange(start, end, device=self.device) // self.size
            same = queries[:, None] == torch.arange(first, end, device=self.device)[None] // self.size
            same = same.expand(self.batch, -1, -1)
        else:
            same = self.ids[:, start:end, None] == self.ids[:, None, first:end]
        if allowed is None:
            return same
        return same & (allowed if allowed.dim() == 3 else allowed[:, None, :])


def local_chunks(size: int | None, key_valid: Tensor | None, positions: Tensor | None, shape: tuple[int, int],
                 device) -> LocalChunks | None:
    """The chunks of rows of `shape` (B, T) for a layer of chunk `size` (None: not chunked): numbered from
    each row's first real token of `key_valid` (B, T), or by packed rows' `positions` (B, T) when given."""
    if size is None:
        return None
    batch, length = shape
    if positions is not None:
        return LocalChunks(size, torch.div(positions, size, rounding_mode="floor"), batch, device)
    if key_valid is None:
        return LocalChunks(size, None, batch, device)
    left_padding = (key_valid.long().cumsum(dim=-1) == 0).sum(dim=-1)  # (B,), transformers' count
    index = torch.arange(length, device=device)[None] - left_padding[:, None]
    return LocalChunks(size, torch.div(index, size, rounding_mode="floor"), batch, device)
