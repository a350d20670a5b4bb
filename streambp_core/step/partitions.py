"""Partition sizes chosen, not guessed: the largest layer and LM-head partitions whose step fits.

The paper's advice is the largest partition that fits the memory: fewer, larger chunks mean fewer
kernel launches and GEMMs that reach the GPU's peak. `auto_partitions` takes the check as a callable,
`fits(partition_size, head_partition_size) -> bool` (typically: the simulated peak of the step is within
the budget), so it serves the simulator, a measured probe or a test alike.

Candidates: the layer partition splits the sequence into k equal chunks (ceil(T / k) for k = 1, 2, 3, 4,
6, 8, 12, 16, ...: the paper's T/3 is among them); the head partition is T or a power of two from
`min_head` up. Peaks grow with each partition and the two act in different phases of the step (layer
backward vs LM head), so the layer partition is chosen first with the smallest head partition, then the
largest head partition that still fits with it; each by bisection over its sorted candidates. The largest
pair is tried first, so a step that fits whole costs one check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from streambp_core.config import ConfigError

Fits = Callable[[int, int], bool]


def layer_candidates(seq_len: int, min_partition: int = 64) -> list[int]:
    """Layer partitions ceil(T / k), ascending, for k in 1, 2, 3, 4, 6, 8, 12, 16, ... (x1.5 / x4/3
    steps), none below `min_partition` unless T itself is smaller."""
    splits, k = [], 1
    while -(-seq_len // k) >= min_partition or k == 1:
        splits.append(k)
        k = k + 1 if k < 4 else (k * 3 // 2 if k % 4 == 0 else k * 4 // 3)
    return sorted({-(-seq_len // k) for k in splits})


def head_candidates(seq_len: int, min_head: int = 64) -> list[int]:
    """Head partitions, ascending: powers of two from `min_head` below T, then T."""
    sizes, size = [], min_head
    while size < seq_len:
        sizes.append(size)
        size *= 2
    return [*sizes, seq_len]


def largest_fitting(candidates: Sequence[int], fits: Callable[[int], bool]) -> int | None:
    """The largest of ascending `candidates` for which `fits` holds, assuming it holds up to some size and
    fails beyond; None when even the smallest fails. log2(len) + 1 calls of `fits`."""
    low, high = 0, len(candidates) - 1
    if not fits(candidates[low]):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if fits(candidates[mid]):
            low = mid
        else:
            high = mid - 1
    return candidates[low]


def auto_partitions(seq_len: int, fits: Fits, *, partition_size: int | None = None,
                    head_partition_size: int | None = None, min_partition: int = 64,
                    min_head: int = 64) -> tuple[int, int]:
    """(partition_size, head_partition_size): the largest that fit; a size given is kept as it is.

    Raises ConfigError when nothing fits even at the smallest candidates.
    """
    heads = [head_partition_size] if head_partition_size else head_candidates(seq_len, min_head)
    layers = [partition_size] if partition_size else layer_candidates(seq_len, min_partition)
    if fits(layers[-1], heads[-1]):  # the common case on a large GPU: one call
        return layers[-1], heads[-1]
    layer = largest_fitting(layers, lambda size: fits(size, heads[0]))
    if layer is None:
        raise ConfigError(f"no partition fits at {seq_len} tokens, not even partition {layers[0]} with "
                          f"head partition {heads[0]}")
    head = largest_fitting(heads, lambda size: fits(layer, size))
    return layer, head
