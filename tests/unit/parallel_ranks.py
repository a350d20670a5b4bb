"""Rank bodies for the multi-process tests (a light module: spawned ranks import it)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank_and_sum(rank: int, world: int) -> tuple[int, float]:
    """Each rank returns its rank and the all-reduced sum of ranks."""
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, float(total)


def rank_one_raises(rank: int, world: int) -> None:
    """Rank 1 raises while rank 0 waits in a collective."""
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def rank_one_dies(rank: int, world: int) -> None:
    """Rank 1 exits hard (no error record) while rank 0 waits in a collective."""
    if rank == 1:
        os._exit(3)
    dist.barrier()
