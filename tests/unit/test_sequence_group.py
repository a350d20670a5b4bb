"""The Ulysses all-to-alls: shards of a sequence become this rank's heads over every token and back, with
gradients, on real ranks (gloo) and, shapes only, on a simulated group."""

from __future__ import annotations

import pytest
import torch

from streambp_core.config import ConfigError
from streambp_core.engine.sequence.group import SequenceGroup, heads_to_seq, seq_to_heads
from streambp_core.parallel.launch import available_cpus, run_ranks
from tests.unit import sequence_ranks

two_ranks = pytest.mark.skipif(available_cpus() < 2, reason="needs two CPU cores for two ranks")


@pytest.fixture(scope="module")
def real_ranks() -> list[dict]:
    """Each rank's figures of the real-rank checks below, from one launch of two ranks."""
    return run_ranks(sequence_ranks.every_swap, 2)


@two_ranks
@pytest.mark.parametrize("total_tokens", sequence_ranks.ALL_TO_ALL_TOKENS)  # even shards, one rank longer
def test_real_ranks_swap_layouts_exactly_and_back(real_ranks, total_tokens):
    for rank in real_ranks:
        assert rank["all_to_all"][total_tokens] == {"heads": 0.0, "round_trip": 0.0, "grad": 0.0}


@two_ranks
def test_swaps_in_pieces_with_copies_and_parts_side_by_side_are_exact(real_ranks):
    for rank in real_ranks:
        assert rank["pieces"] == [{"heads": 0.0, "round_trip": 0.0, "grad": 0.0}] * len(sequence_ranks.SWAPS)


@two_ranks
def test_a_simulated_rank_holds_what_a_real_rank_holds_in_each_swap(real_ranks):
    """The tracked peak of one swap each way (send and receive buffers, copies, output) on real rank 0
    equals the simulated rank 0's on meta, to the byte; and the buffers are really there: a swap in
    pieces holds less than in one."""
    real = real_ranks[0]["peaks"]
    simulated = sequence_ranks.swap_peaks(SequenceGroup.simulated(2), "meta")
    assert real == simulated
    outputs = [batch * tokens * heads * copies // 2 * sum(widths) * 8
               for batch, tokens, heads, copies, _, widths in sequence_ranks.SWAPS]
    sends = [batch * -(-tokens // 2) * heads * copies * sum(widths) * 8
             for batch, tokens, heads, copies, _, widths in sequence_ranks.SWAPS]
    assert real[0][0] == outputs[0] + sends[0]  # batch 1, one piece: received straight into the output
    assert real[1][0] == 2 * outputs[1] + sends[1]  # a receive buffer too, copied into the output
    assert real[2][0] < outputs[2] + sends[2]  # in pieces: the buffers of one piece at a time


def test_a_thinned_swap_peaks_as_the_whole_swap():
    """A thinned swap (simulation only) runs its first piece, the largest, and its last: each way, its peak
    equals that of every piece, swaps of 3 and 4 unequal pieces included."""
    group = SequenceGroup.simulated(2)
    assert any(pieces > 2 and tokens % (2 * pieces) for _, tokens, _, _, pieces, _ in sequence_ranks.SWAPS)
    assert sequence_ranks.swap_peaks(group, "meta", thin=True) == sequence_ranks.swap_peaks(group, "meta")


def test_shards_cover_the_sequence_and_differ_by_at_most_one():
    sizes = SequenceGroup(size=3, rank=0).shard_sizes(10)
    assert sizes == [4, 3, 3]
    assert [SequenceGroup(size=3, rank=r).shard_bounds(10) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]


def test_simulated_group_allocates_the_real_shapes_on_meta():
    group = SequenceGroup.simulated(4)
    x = torch.empty(1, 25, 8, 16, device="meta", requires_grad=True)
    heads = seq_to_heads(x, group, 100)
    assert heads.shape == (1, 100, 2, 16) and heads.device.type == "meta"
    assert heads_to_seq(heads, group, 100).shape == (1, 25, 8, 16)
    heads.sum().backward()
    assert x.grad.shape == x.shape


def test_heads_that_do_not_split_over_the_ranks_are_refused():
    with pytest.raises(ConfigError, match="6 heads do not split over 4"):
        seq_to_heads(torch.empty(1, 2, 6, 4, device="meta"), SequenceGroup.simulated(4), 8)


@pytest.mark.parametrize("size,rank", [(0, 0), (2, 2), (2, -1)])
def test_a_group_outside_its_ranks_is_refused(size, rank):
    with pytest.raises(ConfigError):
        SequenceGroup(size=size, rank=rank)
