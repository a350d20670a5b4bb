"""Rank bodies for the sequence-parallel all-to-all tests (a light module: spawned ranks import it)."""

from __future__ import annotations

import torch

SWAPS = (  # (batch, tokens, heads, copies, pieces, widths of the parts side by side)
    (1, 7, 4, 1, 1, (3,)),  # batch 1 in one piece: received straight into the output
    (2, 7, 4, 1, 1, (3,)),
    (1, 37, 4, 1, 4, (3, 2)),  # keys and values side by side, in pieces
    (1, 37, 1, 2, 4, (3, 2)),  # one head over two ranks: a copy on each
    (2, 37, 2, 2, 3, (3,)),  # two copies of two heads: each rank two (repeated) heads
    (2, 8, 4, 1, 1, (3,)),  # equal shards from here: each rank's part at the same place, one copy
    (1, 36, 4, 1, 4, (3, 2)),
    (2, 36, 2, 2, 3, (3,)),
)
"""The swaps both tests run: each rank's layouts and their peaks."""


def full_sequence(batch: int, tokens: int, heads: int, width: int) -> torch.Tensor:
    """The same float64 sequence on every rank."""
    return torch.arange(batch * tokens * heads * width, dtype=torch.float64).view(batch, tokens, heads, width)


def swapped_exactly(rank: int, world: int) -> list[dict[str, float]]:
    """Per swap of `SWAPS`, the errors of this rank's head layout, of the round trip back (each head's
    copies summed) and of the gradient, against the same tensors sliced by hand."""
    from streambp_core.engine.sequence.group import SequenceGroup, heads_to_seq, parts_to_heads

    group = SequenceGroup.of_process_group()
    errors = []
    for batch, tokens, heads, copies, pieces, widths in SWAPS:
        full = full_sequence(batch, tokens, heads, sum(widths))
        start, end = group.shard_bounds(tokens)
        mine = full[:, start:end].clone().requires_grad_(True)
        parts = mine.split(list(widths), dim=-1)
        swapped = parts_to_heads(parts, group, tokens, copies=copies, pieces=pieces)
        local = heads * copies // world
        expected = full.repeat_interleave(copies, dim=2)[:, :, rank * local:(rank + 1) * local]
        back = heads_to_seq(swapped, group, tokens, copies=copies, pieces=pieces)
        weights = torch.linspace(-1, 1, swapped.numel(), dtype=torch.float64).view_as(swapped)
        (swapped * weights).sum().backward()
        every = torch.cat([weights] * world, dim=2)  # every rank weights its heads alike
        summed = every.view(batch, tokens, heads, copies, -1).sum(dim=3)
        errors.append({"heads": float((swapped - expected).abs().max()),
                       "round_trip": float((back - copies * mine).abs().max()),
                       "grad": float((mine.grad - summed[:, start:end]).abs().max())})
    return errors


def swap_peaks(group, device: str, thin: bool = False) -> list[tuple[int, int]]:
    """Per swap of `SWAPS`, the tracked peak bytes of one `parts_to_heads` and of one `heads_to_seq` on
    rank `group.rank` (inputs made before the tracker, so only what the swap allocates counts); `thin`:
    the swaps' own (simulation only)."""
    from streambp_core.engine.sequence.group import heads_to_seq, parts_to_heads
    from streambp_core.measure.tracker import MemoryTracker

    peaks = []
    for batch, tokens, heads, copies, pieces, widths in SWAPS:
        shard = full_sequence(batch, group.shard_sizes(tokens)[group.rank], heads, sum(widths)).to(device)
        with torch.no_grad():
            parts = shard.split(list(widths), dim=-1)
            with MemoryTracker(device=device) as to_heads:
                swapped = parts_to_heads(parts, group, tokens, copies=copies, pieces=pieces, thin=thin)
            with MemoryTracker(device=device) as to_seq:
                heads_to_seq(swapped, group, tokens, copies=copies, pieces=pieces, thin=thin)
        peaks.append((to_heads.result().peak_bytes, to_seq.result().peak_bytes))
    return peaks


def real_swap_peaks(rank: int, world: int) -> list[tuple[int, int]]:
    """`swap_peaks` of this real rank (gloo, CPU), counting what the engine allocates around the exchange.
    The exchange runs outside the tracker on untracked copies of the engine's buffers: gloo's worker
    thread drops its references to the tensors it exchanged a moment after the call returns, so with
    the engine's own buffers the tracker saw them freed late in some runs and not in others (the
    backend's timing, not what the swap holds)."""
    from dataclasses import dataclass

    from torch.utils._python_dispatch import _disable_current_modes

    from streambp_core.engine.sequence.group import SequenceGroup

    @dataclass(frozen=True)
    class UntrackedExchange(SequenceGroup):
        def exchange(self, recv, send, recv_counts, send_counts) -> None:
            with _disable_current_modes():
                received = recv.clone()
                super().exchange(received, send.clone(), recv_counts, send_counts)
                recv.copy_(received)

    group = SequenceGroup.of_process_group()
    return swap_peaks(UntrackedExchange(size=group.size, rank=group.rank, process_group=group.process_group),
                      "cpu")


ALL_TO_ALL_TOKENS = (8, 7)
"""The plain all-to-all's total lengths: even shards, and one rank a token longer."""


def every_swap(rank: int, world: int) -> dict[str, object]:
    """The real-rank checks of test_sequence_group.py on one launch of ranks: `real_swap_peaks` (first,
    in a fresh process as it ran alone), `swapped_exactly`, and the plain all-to-all's errors per total
    length of `ALL_TO_ALL_TOKENS`."""
    from tests.unit.parallel_ranks import sequence_all_to_all

    return {"peaks": real_swap_peaks(rank, world), "pieces": swapped_exactly(rank, world),
            "all_to_all": {tokens: sequence_all_to_all(rank, world, tokens) for tokens in ALL_TO_ALL_TOKENS}}
