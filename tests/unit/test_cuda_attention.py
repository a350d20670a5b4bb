"""The CUDA attention kernels' code, run on CPU tensors: kernel choice and its warnings, SDPA with torch's
lower-right bias (also under a memory tracker), and the flash-attn paths (dense and varlen packing)
against a stand-in `flash_attn` module that computes attention by the definition, in float64."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

from streambp_core.engine.attention import cuda as cuda_attention
from streambp_core.engine.attention.prefix import prefix_attention
from streambp_core.measure.tracker import MemoryTracker
from streambp_core.step.run.simulation_mode import SimulationMode
from tests.unit.test_attention import qkv


def dense_lower_right(q, k, v, scale):
    """flash-attn's contract by the definition: (1, S, H, hd) layout, GQA, causal aligned to the end."""
    sq, sk, groups = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    seen = torch.arange(sq)[:, None] + (sk - sq) >= torch.arange(sk)[None, :]
    probs = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def fake_flash_module(calls: list):
    """A stand-in for flash_attn: its two entry points, recording how they were called."""

    def flash_attn_func(q, k, v, softmax_scale, causal):
        calls.append(("dense", causal))
        return dense_lower_right(q, k, v, softmax_scale)

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
        calls.append(("varlen", causal, cu_q.dtype, cu_k.dtype, type(max_q), type(max_k)))
        assert int((cu_q[1:] - cu_q[:-1]).max()) == max_q and int((cu_k[1:] - cu_k[:-1]).max()) == max_k
        rows = [dense_lower_right(q[None, cu_q[i]:cu_q[i + 1]], k[None, cu_k[i]:cu_k[i + 1]],
                                  v[None, cu_k[i]:cu_k[i + 1]], softmax_scale)[0]
                for i in range(len(cu_q) - 1)]
        return torch.cat(rows)

    return types.SimpleNamespace(flash_attn_func=flash_attn_func,
                                 flash_attn_varlen_func=flash_attn_varlen_func)


@pytest.fixture
def fake_flash(monkeypatch):
    """flash-attn 'installed' (the stand-in) and taking float64, so results compare exactly."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_module(calls))
    monkeypatch.setattr(cuda_attention, "flash_attn_available", lambda: True)
    monkeypatch.setattr(cuda_attention, "FLASH_DTYPES", (torch.float64,))
    return calls


def padding(kind: str) -> torch.Tensor:
    """(3, 9) key validity: right padding, left padding, or holes, a different amount per row."""
    valid = torch.ones(3, 9, dtype=torch.bool)
    if kind == "right":
        valid[0, 7:], valid[1, 4:] = False, False
    elif kind == "left":
        valid[0, :2], valid[2, :6] = False, False  # row 2: the chunk's first queries are padding
    else:
        valid[0, [1, 3, 7]], valid[1, 5:8], valid[2, 0] = False, False, False
    return valid


@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_path_matches_and_runs_under_a_tracker(padded):
    """SDPA (lower-right bias when unpadded) gives the custom op's result, also while a memory tracker's
    dispatch modes are active (the bias is a tensor subclass built outside them)."""
    q, k, v = qkv()
    valid = torch.ones(2, 7, dtype=torch.bool) if padded else None
    if padded:
        valid[0, -2:] = False
    expected = prefix_attention(q, k, v, valid, 0.25)
    with MemoryTracker(), SimulationMode(vocab_size=None):
        got = cuda_attention.cuda_attention(q, k, v, valid, 0.25, "sdpa")
        got.sum().backward()
    assert torch.allclose(got, expected, atol=1e-12)
    assert q.grad is not None and k.grad.shape == k.shape


@pytest.mark.parametrize(("dtype", "queries", "kv_heads", "causal"), [
    (torch.bfloat16, 7, 2, True), (torch.bfloat16, 7, 4, True), (torch.bfloat16, 3, 4, False),
    (torch.float32, 7, 4, False)])
def test_a_square_half_precision_chunk_takes_sdpa_s_own_causal_dispatch(monkeypatch, dtype, queries, kv_heads,
                                                                         causal):
    """c = e in float16/bfloat16: `is_causal=True` (the same mask, SDPA's kernel choice for causal
    attention; GQA too); otherwise the lower-right bias. Either way the lower-right attention's result."""
    q, k, v = (t.to(dtype) for t in qkv(queries=queries, keys=7, kv_heads=kv_heads))
    biases, build = [], cuda_attention.lower_right_bias
    monkeypatch.setattr(cuda_attention, "lower_right_bias",
                        lambda *shape: biases.append(shape) or build(*shape))
    got = cuda_attention.sdpa_attention(q, k, v, None, 0.25).double()
    expected = prefix_attention(*(t.double() for t in (q, k, v)), None, 0.25)
    assert biases == ([] if causal else [(queries, 7)])
    assert (got - expected).abs().max() < (2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_flash_dense_path_is_lower_right(fake_flash, kv_heads):
    q, k, v = qkv(kv_heads=kv_heads, queries=3, keys=7)
    got = cuda_attention.cuda_attention(q, k, v, None, 0.3, "flash")
    assert fake_flash == [("dense", True)]
    assert torch.allclose(got, prefix_attention(q, k, v, None, 0.3), atol=1e-13)


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
@pytest.mark.parametrize("queries", [4, 9])
def test_flash_varlen_path_matches_on_real_rows(fake_flash, kind, queries):
    """Packed real tokens through the varlen kernel: outputs and q/k/v gradients equal the exact kernel's
    on real query rows, and padding query rows output zeros."""
    q, k, v = qkv(batch=3, heads=4, kv_heads=2, queries=queries, keys=9)
    valid = padding(kind)
    real_rows = valid[:, -queries:][:, None, :, None]  # (B, 1, c, 1)
    got = cuda_attention.cuda_attention(q, k, v, valid, 0.3, "auto")
    want = prefix_attention(q, k, v, valid, 0.3)
    assert fake_flash == [("varlen", True, torch.int32, torch.int32, int, int)]
    assert torch.allclose(got, want * real_rows, atol=1e-13)
    assert torch.equal(got * ~real_rows, torch.zeros_like(got))
    grad = torch.randn_like(got) * real_rows
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad),
                    strict=True):
        assert torch.allclose(a, b, atol=1e-13)


def test_flash_varlen_chunk_of_padding_only(fake_flash):
    """A chunk whose queries are all padding (right padding, last chunk) outputs zeros."""
    q, k, v = qkv(batch=2, queries=2, keys=9)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[:, 6:] = False
    got = cuda_attention.cuda_attention(q, k, v, valid, 0.3, "flash")
    assert torch.equal(got, torch.zeros_like(got))


def test_streambp_through_the_varlen_path_is_exact(fake_flash, monkeypatch):
    """StreamBP with every chunk attending through the flash varlen path (right and left padding, uneven
    chunks) gives plain backprop's gradients: padding rows' zeros reach no loss term."""
    from streambp_core.engine.stream import layer
    from streambp_core.models.load import build_model, tiny_config
    from tests.unit.test_exactness import assert_matches_plain, batch

    def through_flash(q, k, v, valid, scale, backend, window, blocking=True, sinks=None, softcap=None):
        assert sinks is None and softcap is None  # qwen3 has neither
        return cuda_attention.cuda_attention(q, k, v, valid, scale, "flash", window)

    monkeypatch.setattr(layer, "prefix_attention", through_flash)
    model = build_model(tiny_config("qwen3"), dtype=torch.float64, seed=0)
    for side in ("right", "left"):
        ids, mask = batch(512, 3, 23, side)
        assert_matches_plain(model, ids, mask, methods=("streambp",), partition_size=5, head_partition_size=7)
    assert {call[0] for call in fake_flash} == {"varlen"}


def test_kernel_choice_and_its_warnings(monkeypatch):
    """sdpa stays sdpa silently; flash/auto without a usable flash-attn fall back to SDPA with the reason,
    shown once per process by Python's default warning filter."""
    bf16 = torch.empty(1, 2, 3, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(cuda_attention, "flash_attn_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error")
        assert cuda_attention.choose_kernel("sdpa", bf16) == "sdpa"
    assert not caught
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        assert [cuda_attention.choose_kernel("flash", bf16) for _ in range(3)] == ["sdpa"] * 3
    assert len(caught) == 1 and "flash-attn is not importable" in str(caught[0].message)
    monkeypatch.setattr(cuda_attention, "flash_attn_available", lambda: True)
    assert cuda_attention.choose_kernel("auto", bf16) == "flash"
    with pytest.warns(UserWarning, match="float16/bfloat16, not float32"):
        assert cuda_attention.choose_kernel("flash", bf16.float()) == "sdpa"
    with pytest.warns(UserWarning, match="not 36"):
        assert cuda_attention.choose_kernel("auto", torch.empty(1, 2, 3, 36, dtype=torch.bfloat16)) == "sdpa"
