"""Memory the CUDA attention kernels allocate inside themselves in backward, per path and shape: what a
simulated step adds under the `kernel_workspace` category (`attention.py`), as no tracker can see it.

Each figure is what one backward call holds besides its inputs and the gradients it returns, while it
runs. From the kernels' source (torch 2.11's copies of them; flash-attn's `csrc/flash_attn/flash_api.cpp`
is the same code), with r(x, m) = x rounded up to a multiple of m, B batch, H query heads, Hkv KV heads,
c queries, e keys, d head dim, s bytes per element of the inputs:

- flash (`mha_bwd`, `aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp`; torch's flash
  SDPA kernel and flash-attn's `flash_attn_func` both run it):
  softmax_d, fp32 (B, H, r(c, 128)); dq_accum, fp32 (B, r(c, 128), H, d_r) with d_r = r(d, 32) for
  d <= 128 else r(d, 64); with GQA (H != Hkv) dk_expanded and dv_expanded, (B, e, H, d) in the input
  dtype each: 2 * B * e * H * d * s, the term that grows with the prefix.
- flash-varlen (`mha_varlen_bwd`, same file): softmax_d fp32 (H, total_q + 128 B); dq_accum fp32
  (total_q + 128 B, H, d_r); with GQA dk/dv expanded (total_k, H, d). A simulation's padding mask has
  no values, so total_q = B c and total_k = B e (every token real): an upper bound.
- blocked (`blocked_attention.py`, this engine): per tile, flash's buffers above at the tile's m rows and
  n keys, the tile's returned shares (dq (B, m, H, d), dk and dv (B, n, Hkv, d), input dtype) and its
  contiguous log-sum-exp rows (fp32 (B, H, m)); the largest tile's, plus the chunk's float32 dq
  accumulator (B, c, H, d). Bounded by the tile size, whatever the prefix.
- sdpa-cudnn (estimated: cuDNN's kernels are closed source): an fp32 dQ accumulator (B, H, c, d), fp32
  softmax statistics (B, H, c), and with GQA dK/dV for the query heads beyond the KV heads,
  2 * B * e * (H - Hkv) * d * s. Fitted to the one measurement there is: ~97 MiB inside cuDNN attention
  at 16 heads (8 KV heads) x 8k tokens, bf16, d = 128 (H200, torch 2.11), which this gives as 96.5 MiB.
- sdpa-masked (estimated; padded or banded chunks through SDPA with a boolean mask): what this path
  holds that the simulated op does not, K and V expanded to the query heads and their gradients
  (4 * B * e * H * d * s with GQA), the mask's additive form (B, 1, c, r(e, 16)) in the input dtype, and
  the memory-efficient kernel's fp32 buffers (`kernel_backward.h`: delta (B, H, c) and the dQ
  accumulator (B, H, r(c, 64), d); its dK/dV accumulators are not needed for d <= 128).
- sinks-math (a chunk with attention sinks that the blocked kernel does not take: padded, packed rows or
  float32; the engine op's exact math): the op's backward holds the chunk's probabilities, their gradient,
  the scores' gradient and one temporary, (B, H, c, e) each in at least float32, and the mask's boolean
  (B, c, e).
- softcap-math (a soft-capped chunk flash-attn does not take: the engine's custom ops on the GPU,
  `prefix.math_attention`): its backward's score-sized tensors, in at least float32: the probabilities,
  the cap's slope, dP and dS, 4 * B * H * c * e * max(s, 4) (the forward holds fewer at once).
- sdpa-other (SDPA outside half precision): not modelled, 0.
Forward buffers are left out: FlashAttention-2's split-KV forward (`set_params_splitkv`) allocates
fp32 partial outputs only when B * H * ceil(c / 64) is under 0.8 x twice the SM count, bounded by about
2 * SMs * 64 * (d_r + 1) * 4 bytes (~9 MiB on an H200 at d = 128).
"""

from __future__ import annotations

from torch import Tensor

from streambp_core.dtypes import FLOAT32_BYTES
from streambp_core.engine.attention import blocked
from streambp_core.engine.chunks import chunk_bounds


def _round(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _head_rounded(head_dim: int) -> int:
    return _round(head_dim, 32 if head_dim <= 128 else 64)


def flash_backward_bytes(batch: int, heads: int, kv_heads: int, queries: int, keys: int, head_dim: int,
                         element_bytes: int) -> int:
    """FlashAttention-2 `mha_bwd`'s own buffers (module docstring)."""
    q_rounded = _round(queries, 128)
    softmax_d = FLOAT32_BYTES * batch * heads * q_rounded
    dq_accum = FLOAT32_BYTES * batch * q_rounded * heads * _head_rounded(head_dim)
    expanded = 0 if heads == kv_heads else 2 * batch * keys * heads * head_dim * element_bytes
    return softmax_d + dq_accum + expanded


def flash_varlen_backward_bytes(batch: int, heads: int, kv_heads: int, queries: int, keys: int,
                                head_dim: int, element_bytes: int) -> int:
    """FlashAttention-2 `mha_varlen_bwd`'s own buffers, every token taken as real (module docstring)."""
    rows = batch * queries + 128 * batch
    expanded = 0 if heads == kv_heads else 2 * batch * keys * heads * head_dim * element_bytes
    return FLOAT32_BYTES * heads * rows + FLOAT32_BYTES * rows * heads * _head_rounded(head_dim) + expanded


def blocked_backward_bytes(batch: int, heads: int, kv_heads: int, queries: int, keys: int, head_dim: int,
                           element_bytes: int, window: int | None, block_tokens: int) -> int:
    """`BlockedFlashAttention`'s backward: its largest tile's buffers plus the float32 dq accumulator.

    A tile's buffers never shrink as its rows or keys grow, so the largest is, per query block, the
    one with the most keys (`widest_tiles`): a few blocks per chunk, not one tile per block of the prefix.
    """
    largest = 0
    for rows, cols in widest_tiles(queries, keys, window, block_tokens):
        shares = (batch * rows * heads + 2 * batch * cols * kv_heads) * head_dim * element_bytes
        lse_rows = FLOAT32_BYTES * batch * heads * rows
        kernel = flash_backward_bytes(batch, heads, kv_heads, rows, cols, head_dim, element_bytes)
        largest = max(largest, kernel + shares + lse_rows)
    return FLOAT32_BYTES * batch * queries * heads * head_dim + largest


def widest_tiles(queries: int, keys: int, window: int | None, block_tokens: int) -> list[tuple[int, int]]:
    """(rows, keys) of the widest of `blocked_attention.attention_tiles` in each query block, without
    listing the others: unbanded, a block's tiles are `block_tokens` keys wide except the one that
    reaches key 0, and its first (causal) tile is min(keys it sees, `block_tokens`) wide; banded, a block
    has one tile."""
    if window is not None:
        return [(t.q_stop - t.q_start, t.k_stop - t.k_start)
                for t in blocked.attention_tiles(queries, keys, window, block_tokens)]
    offset = keys - queries
    return [(stop - start, min(offset + stop, block_tokens))
            for start, stop in chunk_bounds(queries, block_tokens) if offset + stop > 0]


def cudnn_backward_bytes(batch: int, heads: int, kv_heads: int, queries: int, keys: int, head_dim: int,
                         element_bytes: int) -> int:
    """cuDNN attention's backward buffers, estimated (module docstring)."""
    dq_accum = FLOAT32_BYTES * batch * heads * queries * head_dim
    stats = FLOAT32_BYTES * batch * heads * queries
    extra_heads = 2 * batch * keys * (heads - kv_heads) * head_dim * element_bytes
    return dq_accum + stats + extra_heads


def sdpa_masked_backward_bytes(batch: int, heads: int, kv_heads: int, queries: int, keys: int,
                               head_dim: int, element_bytes: int) -> int:
    """SDPA's boolean-mask path: expanded K/V and gradients, additive mask, efficient kernel's fp32
    buffers, estimated (module docstring)."""
    expanded = 0 if heads == kv_heads else 4 * batch * keys * heads * head_dim * element_bytes
    bias = batch * queries * _round(keys, 16) * element_bytes
    efficient = FLOAT32_BYTES * batch * heads * (queries + _round(queries, 64) * head_dim)
    return expanded + bias + efficient


def sinks_math_backward_bytes(batch: int, heads: int, kv_heads: int, queries: int, keys: int,
                              head_dim: int, element_bytes: int) -> int:
    """The engine op's backward with attention sinks: four (B, H, c, e) score-sized buffers in at least
    float32 and the boolean mask (module docstring)."""
    return 4 * max(FLOAT32_BYTES, element_bytes) * batch * heads * queries * keys + batch * queries * keys
def softcap_math_backward_bytes(batch: int, heads: int, kv_heads: int, queries: int, keys: int,
                                head_dim: int, element_bytes: int) -> int:
    """The engine's custom ops' score-sized buffers in a soft-capped backward (module docstring)."""
    return 4 * batch * heads * queries * keys * max(element_bytes, FLOAT32_BYTES)


_PER_KERNEL = {
    "flash": flash_backward_bytes,
    "flash-varlen": flash_varlen_backward_bytes,
    "sdpa-flash": flash_backward_bytes,
    "sdpa-cudnn": cudnn_backward_bytes,
    "sdpa-masked": sdpa_masked_backward_bytes,
    "sinks-math": sinks_math_backward_bytes,
    "softcap-math": softcap_math_backward_bytes,
}


def backward_workspace_bytes(kernel: str, q: Tensor, k: Tensor, window: int | None) -> int:
    """Bytes the `kernel` path (`cuda_attention.plan_kernel`) allocates inside the backward of queries
    q (B, H, c, d) against keys k (B, Hkv, e, d); 0 for a path not modelled ('sdpa-other')."""
    batch, heads, queries, head_dim = q.shape
    shape = (batch, heads, k.shape[1], queries, k.shape[2], head_dim, q.element_size())
    if kernel == "blocked":
        return blocked_backward_bytes(*shape, window, blocked.BLOCK_TOKENS)
    sizer = _PER_KERNEL.get(kernel)
    return 0 if sizer is None else sizer(*shape)
