"""The attention kernels' own buffers in a simulated step: the sizes from the kernels' source, the path
each chunk would take on a GPU, and the `kernel_workspace` category a meta backward files them under."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from streambp_core.engine.attention import blocked as blocked_attention
from streambp_core.engine.attention import cuda as cuda_attention
from streambp_core.engine.attention.cuda import plan_kernel
from streambp_core.engine.attention.prefix import prefix_attention
from streambp_core.engine.attention.workspace import (
    backward_workspace_bytes,
    blocked_backward_bytes,
    cudnn_backward_bytes,
    flash_backward_bytes,
)
from streambp_core.measure.tags import KERNEL_WORKSPACE
from streambp_core.measure.tracker import MemoryTracker

MIB, GIB = 2**20, 2**30
QWEN3_8B = {"heads": 32, "kv_heads": 8, "head_dim": 128}


def test_flash_backward_expands_dk_dv_to_every_query_head():
    """mha_bwd's buffers: with GQA 2 x e x H x d bf16 (16 KiB a key on Qwen3-8B), plus fp32 softmax_d
    and dq_accum over the queries rounded up to 128; without GQA only the two fp32 buffers."""
    keys = 166_472
    gqa = flash_backward_bytes(1, 32, 8, 500, keys, 128, 2)
    fp32_rows = 4 * 512 * 32 + 4 * 512 * 32 * 128
    assert gqa == 16 * 1024 * keys + fp32_rows
    assert 2.5 * GIB < gqa < 2.6 * GIB
    assert flash_backward_bytes(1, 32, 32, 500, keys, 128, 2) == fp32_rows


def test_cudnn_estimate_matches_the_one_measurement():
    """~97 MiB measured inside cuDNN attention at 16 heads (8 KV heads) x 8k tokens, bf16, d = 128."""
    assert cudnn_backward_bytes(1, 16, 8, 8192, 8192, 128, 2) / MIB == pytest.approx(96.5)


@pytest.mark.parametrize("queries", [500, 4096, 20_000])
def test_the_blocked_backward_is_bounded_whatever_the_prefix(queries):
    """The blocked path's buffers do not grow with the keys, and stay under 2 GiB on Qwen3-8B."""
    sizes = {blocked_backward_bytes(1, 32, 8, queries, keys, 128, 2, None, blocked_attention.BLOCK_TOKENS)
             for keys in (100_000, 400_000, 1_700_000, 3_000_000)}
    assert len(sizes) == 1 and sizes.pop() <= 2 * GIB
    unblocked = flash_backward_bytes(1, 32, 8, queries, 1_700_000, 128, 2)
    assert unblocked > 20 * GIB


def _every_tile_bytes(batch, heads, kv_heads, queries, keys, head_dim, element_bytes, window, block_tokens):
    """The blocked backward's figure over every tile of `attention_tiles` (what `blocked_backward_bytes`
    gives from the widest tiles only)."""
    largest = 0
    for tile in blocked_attention.attention_tiles(queries, keys, window, block_tokens):
        rows, cols = tile.q_stop - tile.q_start, tile.k_stop - tile.k_start
        shares = (batch * rows * heads + 2 * batch * cols * kv_heads) * head_dim * element_bytes
        kernel = flash_backward_bytes(batch, heads, kv_heads, rows, cols, head_dim, element_bytes)
        largest = max(largest, kernel + shares + 4 * batch * heads * rows)
    return 4 * batch * queries * heads * head_dim + largest


def test_the_blocked_figure_from_the_widest_tiles_is_every_tiles():
    """Equal to the byte to the maximum over every tile, over random shapes, windows and block sizes,
    prefixes shorter and longer than a block, GQA and not."""
    rng = random.Random(0)
    for _ in range(300):
        block = rng.choice([7, 64, 1000])
        queries = rng.randint(1, 5 * block)
        keys = queries + rng.choice([0, rng.randint(1, 3 * block), rng.randint(1, 40 * block)])
        window = rng.choice([None, None, rng.randint(1, 3 * block)])
        heads, kv_heads = rng.choice([(4, 4), (8, 2), (32, 8)])
        head_dim = rng.choice([64, 128, 256])
        shape = (rng.randint(1, 3), heads, kv_heads, queries, keys, head_dim, 2, window, block)
        assert blocked_backward_bytes(*shape) == _every_tile_bytes(*shape), shape


def _meta(heads, kv_heads, queries, keys, dim=128, dtype=torch.bfloat16):
    make = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta", requires_grad=True)  # noqa: E731
    return make(1, heads, queries, dim), make(1, kv_heads, keys, dim), make(1, kv_heads, keys, dim)


def test_simulated_paths_follow_the_cuda_choice(monkeypatch):
    """auto is simulated as sdpa: a square chunk cuDNN, a longer prefix torch's flash kernel, padding the
    masked path; past BLOCKED_MIN_KEYS the blocked path; flash-attn when asked for, whether or not it is
    importable where the simulation runs."""
    short_q, short_k, _ = _meta(32, 8, 500, 8000)
    long_q, long_k, _ = _meta(32, 8, 500, blocked_attention.BLOCKED_MIN_KEYS + 1)
    square_q, square_k, _ = _meta(32, 8, 8000, 8000)
    valid = torch.ones(1, 8000, dtype=torch.bool, device="meta")
    assert plan_kernel("auto", square_q, square_k, None, None, simulated=True) == "sdpa-cudnn"
    assert plan_kernel("auto", short_q, short_k, None, None, simulated=True) == "sdpa-flash"
    assert plan_kernel("auto", short_q, short_k, valid, None, simulated=True) == "sdpa-masked"
    assert plan_kernel("auto", long_q, long_k, None, None, simulated=True) == "blocked"
    assert plan_kernel("auto", long_q, long_k, None, 4096, simulated=True) == "blocked"
    for importable in (False, True):
        monkeypatch.setattr(cuda_attention, "flash_attn_available", lambda: importable)  # noqa: B023
        assert plan_kernel("auto", short_q, short_k, None, None, simulated=True) == "sdpa-flash"
        assert plan_kernel("flash", short_q, short_k, None, None, simulated=True) == "flash"
        assert plan_kernel("flash", short_q, short_k, valid, None, simulated=True) == "flash-varlen"


@pytest.mark.parametrize("attn", ["auto", "sdpa", "flash"])
def test_a_soft_capped_chunk_is_charged_per_kernel_choice(attn):
    """Gemma 2's capped scores: flash-attn >= 2.6 caps in its kernel, so --attn flash is charged its
    buffers; auto and sdpa (torch SDPA on the GPU, no cap) the custom ops' score-sized ones; the words
    say which."""
    from streambp_core.engine.attention.cuda import softcap_charge
    from streambp_core.engine.attention.workspace import softcap_math_backward_bytes

    q, k, _ = _meta(8, 4, 500, 8000)
    kernel = plan_kernel(attn, q, k, None, None, simulated=True, softcap=50.0)
    charged = backward_workspace_bytes(kernel, q, k, None)
    if attn == "flash":
        assert kernel == "flash" and charged == flash_backward_bytes(1, 8, 4, 500, 8000, 128, 2)
        assert "flash-attn >= 2.6" in softcap_charge(attn)
    else:
        assert kernel == "softcap-math" and charged == softcap_math_backward_bytes(1, 8, 4, 500, 8000, 128, 2)
        assert "score-sized" in softcap_charge(attn) and f"attn {attn}" in softcap_charge(attn)
    assert flash_backward_bytes(1, 8, 4, 500, 8000, 128, 2) < softcap_math_backward_bytes(
        1, 8, 4, 500, 8000, 128, 2) / 4


@pytest.mark.parametrize(("release", "caps"), [("2.5.9", False), ("2.6.0", True), ("2.8.3", True)])
def test_a_gpu_run_caps_in_flash_attn_from_2_6(monkeypatch, release, caps):
    """On a GPU a capped chunk takes flash-attn only where the installed one takes `softcap=` (2.6 on);
    an older one leaves it to the custom ops, never an uncapped kernel or a TypeError."""
    import sys
    import types

    from streambp_core.engine.attention.cuda import flash_caps, flash_softcap_available

    monkeypatch.setattr(cuda_attention, "flash_attn_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__=release))
    q = torch.empty(1, 8, 64, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 4, 64, 128, dtype=torch.bfloat16)
    assert flash_softcap_available() is caps and flash_caps("flash", q, None, None) is caps
    assert plan_kernel("flash", q, k, None, None, softcap=50.0) == ("flash" if caps else "softcap-math")


@pytest.mark.parametrize("keys", [8000, blocked_attention.BLOCKED_MIN_KEYS + 500])
def test_a_meta_backward_holds_the_workspace_under_its_category(keys):
    """On meta the backward holds the planned path's buffers, under kernel_workspace, while it allocates
    the gradients: the peak has them, the end of the step does not."""
    q, k, v = _meta(32, 8, 500, keys)
    expected = backward_workspace_bytes(plan_kernel("auto", q, k, None, None, simulated=True), q, k, None)
    assert expected > 0
    with MemoryTracker(device="meta") as tracker:
        out = prefix_attention(q, k, v, None, 0.1, "auto")
        out.backward(torch.empty_like(out))
    result = tracker.result()
    assert result.peak_breakdown_bytes[KERNEL_WORKSPACE] == expected
    assert result.end_breakdown_bytes[KERNEL_WORKSPACE] == 0
    gradients = sum(x.numel() * x.element_size() for x in (q, k, v))
    assert result.peak_bytes >= expected + gradients


def test_results_have_a_column_per_category():
    """The results CSV names every device category, kernel_workspace included (`<category>_gib`)."""
    from streambp_bench.results import CATEGORY_COLUMNS, ResultRow
    from streambp_core.measure.tags import CATEGORIES

    assert CATEGORY_COLUMNS == tuple(f"{name}_gib" for name in CATEGORIES)
    assert "kernel_workspace_gib" in {field.name for field in dataclasses.fields(ResultRow)}
