"""The ranks that share one sequence under Ulysses sequence parallelism, and the all-to-alls between them.

Each of the group's `size` ranks holds a contiguous shard of the sequence (`shard_bounds`: the first
`T mod size` ranks one token more). Attention needs every position of a head, so Ulysses swaps layouts
with one all-to-all: sequence-sharded (B, T_r, H, hd), all heads of this rank's tokens, becomes
head-sharded (B, T, H / size, hd), this rank's heads over every token (`seq_to_heads`), and back
(`heads_to_seq`). Both are differentiable: each one's backward is the other on the gradient.

A group is real (a torch.distributed process group; gloo on CPU, nccl on CUDA) or simulated: one rank of
`size` on the meta device, whose all-to-alls allocate the output a real one would and move nothing, so a
simulated step of one rank sees that rank's memory through the same code path.
"""

from __future__ import annotations

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

    def all_reduce_sum(self, value: Tensor) -> Tensor:
        """The sum of `value` over the group's ranks (no autograd; e.g. a global count of valid tokens).
        Simulated: `value` times the group size, the sum of identical ranks."""
        if self.is_simulated:
            return value * self.size
        import torch.distributed as dist

        total = value.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.process_group)
        return total


def seq_to_heads(x: Tensor, group: SequenceGroup, total_tokens: int) -> Tensor:
    """(B, T_r, H, hd) of this rank's tokens -> (B, T, H / size, hd) of this rank's heads. H % size == 0.

    The ranks' token counts are `shard_sizes(total_tokens)`: any counts that differ by at most one, the
    larger on the lower ranks (e.g. every rank's i-th chunk of its shard), are those of their sum."""
    return _SeqToHeads.apply(x, group, total_tokens)


def heads_to_seq(x: Tensor, group: SequenceGroup, total_tokens: int) -> Tensor:
    """(B, T, H / size, hd) of this rank's heads -> (B, T_r, H, hd) of this rank's tokens."""
    return _HeadsToSeq.apply(x, group, total_tokens)


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


def _check_heads(heads: int, group: SequenceGroup) -> None:
    if heads % group.size:
        raise ConfigError(f"{heads} heads do not split over {group.size} sequence-parallel ranks")


def _seq_to_heads(x: Tensor, group: SequenceGroup, total_tokens: int) -> Tensor:
    b, t_rank, heads, hd = x.shape
    _check_heads(heads, group)
    local = heads // group.size
    if group.is_simulated:
        return x.new_empty((b, total_tokens, local, hd))
    sizes = group.shard_sizes(total_tokens)
    send = x.reshape(b, t_rank, group.size, local, hd).permute(2, 0, 1, 3, 4).contiguous()
    recv = x.new_empty(b * total_tokens * local * hd)
    per = b * local * hd
    _all_to_all(recv, send.view(-1), [per * s for s in sizes], [per * t_rank] * group.size, group)
    pieces = recv.split([per * s for s in sizes])
    return torch.cat([p.view(b, s, local, hd) for p, s in zip(pieces, sizes, strict=True)], dim=1)


def _heads_to_seq(x: Tensor, group: SequenceGroup, total_tokens: int) -> Tensor:
    b, t, local, hd = x.shape
    start, end = group.shard_bounds(total_tokens)
    t_rank = end - start
    if group.is_simulated:
        return x.new_empty((b, t_rank, local * group.size, hd))
    sizes = group.shard_sizes(total_tokens)
    send = torch.cat([p.reshape(-1) for p in x.split(sizes, dim=1)])
    recv = x.new_empty(group.size * b * t_rank * local * hd)
    per = b * local * hd
    _all_to_all(recv, send, [per * t_rank] * group.size, [per * s for s in sizes], group)
    return recv.view(group.size, b, t_rank, local, hd).permute(1, 2, 0, 3, 4).reshape(
        b, t_rank, local * group.size, hd)  # explicit heads: a rank's chunk may be empty (t_rank 0)


def _all_to_all(recv: Tensor, send: Tensor, recv_sizes: list[int], send_sizes: list[int],
                group: SequenceGroup) -> None:
    import torch.distributed as dist

    dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                           group=group.process_group)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, total_tokens):
        ctx.group, ctx.total_tokens = group, total_tokens
        return _seq_to_heads(x, group, total_tokens)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group, ctx.total_tokens), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, total_tokens):
        ctx.group, ctx.total_tokens = group, total_tokens
        return _heads_to_seq(x, group, total_tokens)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group, ctx.total_tokens), None, None


class _GroupSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, group):
        return group.all_reduce_sum(value)

    @staticmethod
    def backward(ctx, grad):
        return grad, None
