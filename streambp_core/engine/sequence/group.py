"""The ranks that share one sequence under Ulysses sequence parallelism, and the all-to-alls between them.

Each of the group's `size` ranks holds a contiguous shard of the sequence (`shard_bounds`: the first
`T mod size` ranks one token more). Attention needs every position of a head, so Ulysses swaps layouts
with one all-to-all: sequence-sharded (B, T_r, H, hd), all heads of this rank's tokens, becomes
head-sharded (B, T, H / size, hd), this rank's heads over every token (`seq_to_heads`), and back
(`heads_to_seq`). Both are differentiable: each one's backward is the other on the gradient.

A swap allocates its output once. An all-to-all sends one contiguous buffer, each destination's part in
rank order (the send buffer: a copy, except `heads_to_seq`'s contiguous batch-1 input, already in that
order) and receives one (the receive buffer: with batch 1 in one piece, the output itself; else copied
into it). Where the ranks hold equal shards (T a multiple of the group), each rank's part sits at the
same place in its shard, and one strided copy moves every part; else a copy per rank. `copies` repeats
heads into the send buffer (KV heads over more ranks than heads) and sums them out of the receive
buffer, without a repeated tensor. `pieces` splits a swap into that many all-to-alls
over parts of every rank's tokens, so its buffers are that fraction of the output (a whole-sequence K/V).

A group is real (a torch.distributed process group; gloo on CPU, nccl on CUDA) or simulated: one rank of
`size` on the meta device. Both run the same code, allocations and copies (on meta the copies move
nothing); only the exchange (`SequenceGroup.exchange`) is skipped on a simulated group, so a simulated step
of one rank holds, tensor for tensor, what that rank would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from streambp_core.config import ConfigError


@dataclass(frozen=True)
class SequenceGroup:
    """`size` ranks sharing each sequence; this process is `rank`. `process_group` None: simulated."""

    size: int
    rank: int
    process_group: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ConfigError(f"sequence-parallel size must be a positive integer, got {self.size!r}")
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"sequence-parallel rank {self.rank} is outside 0..{self.size - 1}")

    @classmethod
    def simulated(cls, size: int) -> SequenceGroup:
        """Rank 0 of `size` on the meta device: collectives allocate their outputs and move nothing."""
        return cls(size=size, rank=0)

    @classmethod
    def of_process_group(cls, process_group: Any = None) -> SequenceGroup:
        """This process's rank in `process_group` (None: the default group, which must be initialized)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError("sequence parallelism over real ranks needs an initialized process group")
        group = process_group if process_group is not None else dist.group.WORLD
        return cls(size=dist.get_world_size(group), rank=dist.get_rank(group), process_group=group)

    @property
    def is_simulated(self) -> bool:
        """True for a simulated group (meta tensors, no communication)."""
        return self.process_group is None

    def shard_sizes(self, total_tokens: int) -> list[int]:
        """Tokens each rank holds of a `total_tokens` sequence, in rank order (differ by at most one)."""
        base, extra = divmod(total_tokens, self.size)
        return [base + (1 if r < extra else 0) for r in range(self.size)]

    def shard_bounds(self, total_tokens: int) -> tuple[int, int]:
        """(start, end) positions of this rank's shard of a `total_tokens` sequence."""
        sizes = self.shard_sizes(total_tokens)
        start = sum(sizes[: self.rank])
        return start, start + sizes[self.rank]

    def exchange(self, recv: Tensor, send: Tensor, recv_counts: list[int], send_counts: list[int]) -> None:
        """One all-to-all of flat buffers: `send_counts[j]` elements of `send` to rank j, `recv_counts[j]`
        from rank j into `recv`, in rank order. Simulated: nothing moves (the buffers exist all the same)."""
        if self.is_simulated:
            return
        import torch.distributed as dist

        dist.all_to_all_single(recv, send, output_split_sizes=recv_counts, input_split_sizes=send_counts,
                               group=self.process_group)

    def all_reduce_sum(self, value: Tensor) -> Tensor:
        """The sum of `value` over the group's ranks (no autograd; e.g. a global count of valid tokens).
        Simulated: `value` times the group size, the sum of identical ranks."""
        if self.is_simulated:
            return value * self.size
        import torch.distributed as dist

        total = value.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.process_group)
        return total


def seq_to_heads(x: Tensor, group: SequenceGroup, total_tokens: int, *, copies: int = 1,
                 pieces: int = 1, thin: bool = False) -> Tensor:
    """(B, T_r, H, hd) of this rank's tokens -> (B, T, H x copies / size, hd) of this rank's heads.

    The ranks' token counts are `shard_sizes(total_tokens)`: any counts that differ by at most one, the
    larger on the lower ranks (e.g. every rank's i-th chunk of its shard), are those of their sum.
    `copies`: each head repeated that many times first (adjacent copies, as `repeat_interleave`), without
    materialising the repeat. `pieces`: the swap runs as that many all-to-alls over parts of the sequence
    (fewer when a shard is shorter), so its send and receive buffers are that fraction of the output.
    `thin` (simulation only, as `StreamConfig.keep_chunks`): only the first and the last piece run. A
    piece's buffers are freed before the next piece's are made and the first piece is the largest, so the
    two set the swap's peak; the output is left unwritten between them."""
    return _SeqToHeads.apply(group, total_tokens, copies, pieces, thin, x)


def parts_to_heads(parts: Sequence[Tensor], group: SequenceGroup, total_tokens: int, *, copies: int = 1,
                   pieces: int = 1, thin: bool = False) -> Tensor:
    """`seq_to_heads` of the tensors `parts` (B, T_r, H, w_i) side by side in their last dimension (e.g.
    keys and values), without concatenating them first: (B, T, H x copies / size, sum of w_i)."""
    return _SeqToHeads.apply(group, total_tokens, copies, pieces, thin, *parts)


def heads_to_seq(x: Tensor, group: SequenceGroup, total_tokens: int, *, copies: int = 1,
                 pieces: int = 1, thin: bool = False) -> Tensor:
    """(B, T, H x copies / size, hd) of this rank's heads -> (B, T_r, H, hd) of this rank's tokens, each
    head's `copies` summed (the transpose of `seq_to_heads`'s repeat); `pieces`, `thin` as there."""
    return _HeadsToSeq.apply(x, group, total_tokens, copies, pieces, thin)


def group_sum(value: Tensor, group: SequenceGroup) -> Tensor:
    """The sum of `value` over the group, differentiable: every rank goes on to compute the same function
    of the sum, so the gradient of each rank's share is the sum's own gradient (identity backward).
    Simulated: `value` times the group size (`all_reduce_sum`)."""
    return _GroupSum.apply(value, group)


def sum_gradients(parameters, group: SequenceGroup) -> None:
    """Sum every parameter's `.grad` over the group, in place (nothing on a simulated group): each rank's
    backward leaves the share of its own tokens, and their sum is the whole sequence's gradient."""
    if group.is_simulated:
        return
    import torch.distributed as dist

    for param in parameters:
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group.process_group)


def _local_heads(heads: int, group: SequenceGroup) -> int:
    if heads % group.size:
        raise ConfigError(f"{heads} heads do not split over {group.size} sequence-parallel ranks")
    return heads // group.size


def _piece_spans(sizes: list[int], pieces: int, thin: bool = False) -> list[list[tuple[int, int]]]:
    """Per piece, each rank's (start, end) within its block of `sizes` tokens: `pieces` parts of every
    block (fewer when a block is shorter; one when a block is empty), as `shard_sizes` splits (the larger
    parts first); `thin`: only the first and the last piece (`seq_to_heads`)."""
    count = max(1, min(pieces, *sizes))
    parts = [SequenceGroup(size=count, rank=0).shard_sizes(size) for size in sizes]
    spans, done = [], [0] * len(sizes)
    for piece in range(count):
        spans.append([(done[r], done[r] + parts[r][piece]) for r in range(len(sizes))])
        done = [end for _, end in spans[-1]]
    return [spans[0], spans[-1]] if thin and len(spans) > 2 else spans


def _to_heads(parts: Sequence[Tensor], group: SequenceGroup, total_tokens: int, copies: int,
              pieces: int, thin: bool) -> Tensor:
    """`parts_to_heads` without autograd. Real and simulated ranks run the same allocations and copies
    (on meta, the copies move nothing); only the exchange itself is skipped on a simulated group."""
    b, _, heads, _ = parts[0].shape
    local, width = _local_heads(heads * copies, group), sum(part.shape[-1] for part in parts)
    sizes = group.shard_sizes(total_tokens)
    starts = [sum(sizes[:rank]) for rank in range(group.size)]
    out = parts[0].new_empty((b, total_tokens, local, width))
    spans = _piece_spans(sizes, pieces, thin)
    for span in spans:
        first, last = span[group.rank]
        send = out.new_empty((group.size, b, last - first, local, width))
        offset = 0
        for part in parts:
            _fill_send(send[..., offset:offset + part.shape[-1]], part[:, first:last], copies)
            offset += part.shape[-1]
        counts = [b * (end - start) * local * width for start, end in span]
        direct = b == 1 and len(spans) == 1  # the received pieces are the output, in rank order
        recv = out.view(-1) if direct else out.new_empty(sum(counts))
        group.exchange(recv, send.view(-1), counts, [send.numel() // group.size] * group.size)
        if not direct and len(set(sizes)) == 1:  # every rank's piece at the same place in its shard
            start, end = span[0]
            out.unflatten(1, (group.size, sizes[0]))[:, :, start:end].copy_(
                recv.view(group.size, b, end - start, local, width).transpose(0, 1))
        elif not direct:
            _unpack(out, recv, counts, starts, span)
        del send, recv
    return out


def _unpack(out: Tensor, recv: Tensor, counts: list[int], starts: list[int], span: list[tuple[int, int]]
            ) -> None:
    """Copy each rank's piece of `recv` to its place in `out` (B, T, local, w). A function of its own, so
    the pieces (views of `recv`) die with it: a loop variable left holding one would keep `recv` alive
    while the next piece's buffers are made."""
    b, _, local, width = out.shape
    for rank, piece in enumerate(recv.split(counts)):
        start, end = (starts[rank] + at for at in span[rank])
        out[:, start:end].copy_(piece.view(b, end - start, local, width))


def _fill_send(send: Tensor, part: Tensor, copies: int) -> None:
    """Write `part` (B, t, H, w) into `send` (size, B, t, local, w): destination j gets the heads
    j x local .. (j + 1) x local - 1 of the heads repeated `copies` times."""
    size, local = send.shape[0], send.shape[3]
    if copies == 1:
        send.copy_(part.unflatten(2, (size, local)).permute(2, 0, 1, 3, 4))
        return
    for rank in range(size):
        heads = [(rank * local + i) // copies for i in range(local)]
        consecutive = heads == list(range(heads[0], heads[0] + local))
        send[rank].copy_(part.narrow(2, heads[0], local) if consecutive else part[:, :, heads])


def _to_seq(x: Tensor, group: SequenceGroup, total_tokens: int, copies: int, pieces: int, thin: bool
            ) -> Tensor:
    """`heads_to_seq` without autograd; real and simulated ranks allocate alike (`_to_heads`)."""
    b, _, local, width = x.shape
    heads = local * group.size
    if heads % copies:
        raise ConfigError(f"{heads} heads are not {copies} copies of whole heads")
    sizes = group.shard_sizes(total_tokens)
    starts = [sum(sizes[:rank]) for rank in range(group.size)]
    out = x.new_empty((b, sizes[group.rank], heads // copies, width))
    spans = _piece_spans(sizes, pieces, thin)
    for span in spans:
        counts = [b * (end - start) * local * width for start, end in span]
        if b == 1 and len(spans) == 1 and x.is_contiguous():  # each rank's positions in rank order
            send = x.view(-1)
        elif len(set(sizes)) == 1:  # every rank's piece at the same place in its shard
            start, end = span[0]
            send = x.new_empty(sum(counts))
            send.view(group.size, b, end - start, local, width).copy_(
                x.unflatten(1, (group.size, sizes[0]))[:, :, start:end].transpose(0, 1))
        else:
            send = x.new_empty(sum(counts))
            _pack(send, x, counts, starts, span)
        first, last = span[group.rank]
        recv = x.new_empty((group.size, b, last - first, local, width))
        group.exchange(recv.view(-1), send, [recv.numel() // group.size] * group.size, counts)
        _fill_out(out[:, first:last], recv, copies)
        del send, recv
    return out


def _pack(send: Tensor, x: Tensor, counts: list[int], starts: list[int], span: list[tuple[int, int]]) -> None:
    """Copy each rank's part of `x` (B, T, local, w) into its piece of `send` (`_unpack`'s transpose; a
    function of its own for the same reason)."""
    b, _, local, width = x.shape
    for rank, piece in enumerate(send.split(counts)):
        start, end = span[rank]
        piece.view(b, end - start, local, width).copy_(x[:, starts[rank] + start:starts[rank] + end])


def _fill_out(out: Tensor, recv: Tensor, copies: int) -> None:
    """Write `recv` (size, B, t, local, w), the heads of every rank, into `out` (B, t, H, w), summing each
    head's `copies` in order."""
    size, local = recv.shape[0], recv.shape[3]
    if copies == 1:
        out.unflatten(2, (size, local)).copy_(recv.permute(1, 2, 0, 3, 4))
        return
    for head in range(size * local):
        rank, index = divmod(head, local)
        target = out[:, :, head // copies]
        if head % copies:
            target.add_(recv[rank, :, :, index])
        else:
            target.copy_(recv[rank, :, :, index])


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, total_tokens, copies, pieces, thin, *parts):
        ctx.swap = group, total_tokens, copies, pieces, thin
        ctx.widths = [part.shape[-1] for part in parts]
        return _to_heads(parts, *ctx.swap)

    @staticmethod
    def backward(ctx, grad):
        whole = _to_seq(grad, *ctx.swap)
        return (None, None, None, None, None, *whole.split(ctx.widths, dim=-1))


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, total_tokens, copies, pieces, thin):
        ctx.swap = group, total_tokens, copies, pieces, thin
        return _to_seq(x, *ctx.swap)

    @staticmethod
    def backward(ctx, grad):
        return _to_heads([grad], *ctx.swap), None, None, None, None, None


class _GroupSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, group):
        return group.all_reduce_sum(value)

    @staticmethod
    def backward(ctx, grad):
        return grad, None
