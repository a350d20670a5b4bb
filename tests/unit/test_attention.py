"""The chunk-against-prefix attention: lower-right causal alignment, key padding, GQA, fully masked
rows and its fake kernels on the meta device (the CUDA kernels: tests/unit/test_cuda_attention.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streambp_core.engine.attention.prefix import allowed_mask, prefix_attention
from streambp_core.measure.tracker import MemoryTracker


def qkv(batch=2, heads=4, kv_heads=2, queries=3, keys=7, dim=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()  # noqa: E731
    kv_shape = (batch, kv_heads, keys, dim)
    return make(batch, heads, queries, dim), make(*kv_shape), make(*kv_shape)


def reference(q, k, v, key_valid, scale):
    """Dense SDPA with K/V expanded to the query heads and an explicit lower-right mask."""
    groups = q.shape[1] // k.shape[1]
    mask = allowed_mask(q.shape[2], key_valid, k.shape[2])[:, None]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=mask, scale=scale)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("padded", [False, True])
def test_custom_op_matches_dense_sdpa(kv_heads, padded):
    q, k, v = qkv(kv_heads=kv_heads)
    valid = None
    if padded:
        valid = torch.ones(2, 7, dtype=torch.bool)
        valid[1, :5] = False  # row 1: the first query sees only padding -> a fully masked row
    out = prefix_attention(q, k, v, valid, 0.3)
    ref = reference(q, k, v, valid, 0.3)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    assert torch.allclose(out, ref, atol=1e-13)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-13)
    if padded:
        assert torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0]))


def test_lower_right_is_not_top_left():
    """With fewer queries than keys, query i sees keys up to e - c + i (not up to i)."""
    mask = allowed_mask(2, None, 5)[0]
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_fake_kernels_allocate_output_and_lse_only():
    """On meta, forward+backward allocate q/k/v-sized gradients, the output and a float32 LSE: never a
    (queries x keys) score matrix."""
    tensors = qkv(dtype=torch.bfloat16, queries=64, keys=4096)
    q, k, v = (t.detach().to("meta").requires_grad_() for t in tensors)
    with MemoryTracker(device="meta") as tracker:
        out = prefix_attention(q, k, v, None, 0.1)
        out.backward(torch.empty_like(out))
    scores_bytes = q.shape[0] * q.shape[1] * 64 * 4096 * 4
    assert tracker.result().peak_bytes < scores_bytes / 4
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_baselines_take_the_kernel_choice(monkeypatch):
    """`attn` reaches the baselines' engine attention: the registered function carries the backend."""
    import streambp_core
    from streambp_core.engine.attention import hf as hf_attention
    from streambp_core.models.load import build_model, tiny_config

    seen = []
    real = hf_attention.prefix_attention

    def spy(q, k, v, key_valid, scale, backend="auto", window=None, **kwargs):
        seen.append(backend)
        return real(q, k, v, key_valid, scale, backend, window, **kwargs)

    monkeypatch.setattr(hf_attention, "prefix_attention", spy)
    model = build_model(tiny_config("llama"), dtype=torch.float64)
    with streambp_core.prepare(model, "checkpoint", attn="sdpa", baseline_attention="engine") as run:
        assert model.config._attn_implementation == "streambp_prefix_torch"
        run.loss(torch.randint(0, 512, (1, 12))).backward()
    assert seen and set(seen) == {"sdpa"}
    assert model.config._attn_implementation == "sdpa"


def test_no_kernel_choice_registers_a_name_transformers_acts_on():
    """transformers runs its SDPA support check on a name containing "sdpa" (and loads a flash kernel for
    one containing "flash"), which gpt-oss and Gemma 2 fail: the engine's names contain none of them."""
    from streambp_core.config import ATTN_BACKENDS
    from streambp_core.engine.attention.hf import TRANSFORMERS_MARKERS, register_engine_attention

    names = [register_engine_attention(backend) for backend in ATTN_BACKENDS]
    assert len(set(names)) == len(ATTN_BACKENDS)
    assert not [name for name in names for marker in TRANSFORMERS_MARKERS if marker in name]


@pytest.mark.parametrize(("family", "attn"), [
    pytest.param(family, attn, marks=() if (family, attn) in (("gpt-oss", "sdpa"), ("gemma2", "flash"))
                 else pytest.mark.slow)
    for family in ("gemma2", "gpt-oss") for attn in ("auto", "sdpa", "flash")])  # one a family by default
def test_eager_only_families_take_every_kernel_choice_through_the_engine_attention(family, attn):
    """gpt-oss and Gemma 2 are built with eager attention (transformers gives them no SDPA): under the engine
    attention, with any kernel choice, checkpoint's gradients are those of the model's own attention, and
    the model's own attention is back after the run."""
    import streambp_core
    from streambp_core.models.load import build_model

    model = build_model(f"tiny/{family}", dtype=torch.float64, seed=0)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    own, grads = model.config._attn_implementation, []
    for baseline in ("model", "engine"):
        with streambp_core.prepare(model, "checkpoint", attn=attn, baseline_attention=baseline) as run:
            run.loss(ids).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    assert model.config._attn_implementation == own and "eager" in own
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize(("dtype", "window"), [
    pytest.param(dtype, window, marks=() if (dtype, window) == (torch.float64, 3) else pytest.mark.slow)
    for window in (None, 3) for dtype in (torch.float64, torch.bfloat16)])  # a window by default
def test_the_custom_ops_real_and_fake_kernels_agree(dtype, window):
    """torch's own op check (schema, fake vs real kernel metadata, autograd registration) on the inputs the
    engine passes: queries transposed from (B, c, H, hd), keys and values views of a longer cache."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 4, 8, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 2, 9, 8, generator=gen, dtype=dtype)[:, :, :7].requires_grad_()
    v = torch.randn(2, 2, 9, 8, generator=gen, dtype=dtype)[:, :, 2:].requires_grad_()
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, :2] = False
    for key_valid in (None, valid):
        args = (q, k, v, key_valid, 0.3, window)
        torch.library.opcheck(torch.ops.streambp.prefix_attn_fwd.default, args)
        out, _ = torch.ops.streambp.prefix_attn_fwd(*args)
        backward = (torch.ones_like(out), q.detach(), k.detach(), v.detach(), out.detach(), key_valid, 0.3,
                    window)
        torch.library.opcheck(torch.ops.streambp.prefix_attn_bwd.default, backward)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_narrower_values_come_out_in_the_layout_transformers_reshapes_without_a_copy(device):
    """Latent attention (values narrower than queries and keys): the output (B, H, c, hd_v) lies (B, c, H,
    hd_v) in memory, as torch SDPA's memory-efficient kernel returns it, on CPU and in simulation alike."""
    q = torch.zeros(2, 4, 5, 12, dtype=torch.float64, device=device)
    k = torch.zeros(2, 4, 7, 12, dtype=torch.float64, device=device)
    v = torch.zeros(2, 4, 7, 8, dtype=torch.float64, device=device)
    out = prefix_attention(q, k, v, None, 0.3)
    assert out.shape == (2, 4, 5, 8) and out.transpose(1, 2).is_contiguous()
    assert prefix_attention(q, k, k, None, 0.3).is_contiguous()
