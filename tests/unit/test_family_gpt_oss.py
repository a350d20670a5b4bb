"""gpt-oss: attention sinks, sliding and full layers, q/k/v/o biases, YaRN RoPE on half tables and the
routed MLP (biased router, top-k softmax, interleaved fused gate_up, clamped SwiGLU), exact in float64."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.gpt_oss import modeling_gpt_oss as hf

from streambp_core.engine.attention.cuda import plan_kernel
from streambp_core.engine.attention.hf import engine_attention_forward
from streambp_core.engine.attention.prefix import prefix_attention
from streambp_core.engine.chunks import allowed_mask
from streambp_core.engine.stream.rope import Rope, rotate
from streambp_core.models.adapters import decoder_parts, layer_parts
from streambp_core.models.load import build_model, tiny_config
from tests.unit.test_exactness import GRAD_RTOL, assert_matches_plain, batch, step

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ_LEN = 24
"""Tokens per row: four chunks of 6, past the tiny preset's window of 16."""


def model_of(**overrides):
    return build_model(tiny_config("gpt-oss", **overrides), dtype=torch.float64, seed=0)


def with_strong_sinks(model):
    """Sinks of about +-2 (the init's 0.02 spread barely moves them off 0) so each one's weight in the
    denominators differs per head and matters."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 2.0, layer.self_attn.sinks.numel()))
    return model


def _rel(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("padding", ["right", "left"])
def test_gpt_oss_matches_plain_with_padding(padding) -> None:
    """Every method, every parameter within 1e-12 of plain, with rows of different padding."""
    model = with_strong_sinks(model_of())
    ids, mask = batch(model.config.vocab_size, 2, SEQ_LEN, padding)
    assert_matches_plain(model, ids, mask, partition_size=6, head_partition_size=6)


@pytest.mark.parametrize("partition_size", [2, 7, SEQ_LEN], ids=["two", "not_a_divisor", "one_chunk"])
def test_the_sinks_gradient_is_exact_whatever_the_chunks(partition_size) -> None:
    """Each query row takes its head's sink once, in whichever chunk it is: the sinks' own gradient (not
    floored by the largest gradient's norm, as the whole-model comparison is) equals plain's to 1e-12."""
    model = with_strong_sinks(model_of())
    ids, mask = batch(model.config.vocab_size, 2, SEQ_LEN, "left")
    _, ref = step(model, "plain", ids, mask)
    for method in ("streambp", "mst"):
        _, grads = step(model, method, ids, mask, partition_size=partition_size, head_partition_size=5)
        for name in (n for n in ref if n.endswith("sinks")):
            assert ref[name].abs().min() > 0, name
            assert _rel(grads[name], ref[name]) <= GRAD_RTOL, f"{method}: {name}"


def test_a_model_the_user_builds_with_transformers_matches_plain() -> None:
    """AutoModelForCausalLM.from_config as a user calls it (float64 needs transformers' per-expert loop:
    grouped matmuls take no float64), with the router's load-balancing loss in the loss."""
    config = tiny_config("gpt-oss", output_router_logits=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation="eager")
    model = with_strong_sinks(model.train())
    ids, mask = batch(config.vocab_size, 2, SEQ_LEN, "right")
    assert_matches_plain(model, ids, mask, methods=("streambp", "checkpoint"), partition_size=6,
                         head_partition_size=6)


def _eager(q, k, v, sinks, allowed):
    """transformers' gpt-oss eager attention (B, c, H, hd) under the boolean mask `allowed` (B, c, e)."""
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = sinks, q.shape[1] // k.shape[1]
    mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
    out, _ = hf.eager_attention_forward(module, q, k, v, mask[:, None], scaling=0.3)
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_prefix_attention_with_sinks_is_transformers_eager(window) -> None:
    """The engine's op with sinks against transformers' eager attention: a chunk of 5 queries, the last
    of 9 keys, GQA, left padding (a row whose first queries see no key: sink only, output 0), a window;
    output and gradients of q, k, v and the sinks to 1e-12."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    sinks = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :6] = False
    grad_out = torch.randn(2, 5, 4, 8, generator=gen, dtype=torch.float64)
    ours = prefix_attention(q, k, v, valid, 0.3, window=window, sinks=sinks).transpose(1, 2)
    theirs = _eager(q, k, v, sinks, allowed_mask(5, valid, 9, window))
    assert (ours[1, 0] == 0).all() and _rel(ours, theirs) <= 1e-13
    got = torch.autograd.grad(ours, (q, k, v, sinks), grad_out)
    want = torch.autograd.grad(theirs, (q, k, v, sinks), grad_out)
    for g, w in zip(got, want, strict=True):
        assert _rel(g, w) <= 1e-12


@pytest.mark.parametrize("window", [None, 4])
def test_the_blocked_kernels_sink_folding_is_the_ops_math(window) -> None:
    """The CUDA blocked kernel's steps with sinks, on CPU: its sink-less forward's output and log-sum-exp
    folded with the sinks give the op's with them; its tile backward from those, and the sinks' gradient
    from the rows' D, give the op's gradients (float64, tiles of 3 keys over 11)."""
    from streambp_core.engine.attention.blocked import reference_blocked_backward
    from streambp_core.engine.attention.sinks import fold_sinks, sink_grad

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 11, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    sinks = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 4, 5, 8, generator=gen, dtype=torch.float64)
    plain_out, plain_lse = torch.ops.streambp.prefix_attn_fwd(q, k, v, None, 0.3, window)
    out, lse = fold_sinks(plain_out.detach().transpose(1, 2), plain_lse.detach(), sinks.detach())
    out = out.transpose(1, 2)
    want_out, want_lse = torch.ops.streambp.prefix_attn_fwd(q, k, v, None, 0.3, window, sinks)
    assert _rel(out, want_out) <= 1e-14 and _rel(lse, want_lse) <= 1e-14
    got = (*reference_blocked_backward(grad_out, q, k, v, out, lse, None, 0.3, window, 3),
           sink_grad(grad_out, out, lse, sinks))
    want = torch.autograd.grad(want_out, (q, k, v, sinks), grad_out)
    for g, w in zip(got, want, strict=True):
        assert _rel(g, w) <= 1e-12


def test_the_baselines_engine_attention_takes_the_sinks() -> None:
    """transformers passes the sinks as `s_aux`: the engine attention a simulated (meta) baseline runs
    gives eager's output with them, not without."""
    full_layer = model_of().model.layers[1].self_attn
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 8, generator=gen, dtype=torch.float64)
    k, v = torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64), torch.randn(1, 2, 6, 8, generator=gen,
                                                                                  dtype=torch.float64)
    sinks = torch.tensor([-2.0, 0.0, 1.0, 3.0], dtype=torch.float64)
    out, _ = engine_attention_forward(full_layer, q, k, v, None, scaling=0.3, s_aux=sinks)
    assert _rel(out, _eager(q, k, v, sinks, allowed_mask(6, None, 6))) <= 1e-13


def test_gpt_oss_rope_is_transformers_bit_for_bit() -> None:
    """Its rotary embedding's half tables (YaRN-scaled), repeated by `rope_tables`, rotate Q and K exactly
    as transformers' `apply_rotary_pos_emb` (first * cos - second * sin, second * cos + first * sin)."""
    model = model_of()
    parts = decoder_parts(model)
    positions = torch.arange(SEQ_LEN)[None]
    hidden = torch.zeros(1, SEQ_LEN, 64, dtype=torch.float64)
    cos, sin = parts.rope_tables(hidden, positions)[None]
    half_cos, half_sin = model.model.rotary_emb(hidden, positions)
    assert cos.shape[-1] == 16 == 2 * half_cos.shape[-1] and model.model.rotary_emb.attention_scaling != 1.0
    q = torch.randn(1, 4, SEQ_LEN, 16, dtype=torch.float64)
    k = torch.randn(1, 2, SEQ_LEN, 16, dtype=torch.float64)
    q_hf, k_hf = hf.apply_rotary_pos_emb(q, k, half_cos, half_sin)
    rope = Rope.of_layer(cos, sin, layer_parts(model.model.layers[0]))
    assert torch.equal(rotate(q, rope), q_hf) and torch.equal(rotate(k, rope), k_hf)


def test_its_layers_reach_the_engine() -> None:
    """Sliding (16) then full attention, biases on q/k/v/o, its sinks, the router `router`, and the tiny
    preset's SwiGLU clamp reached by random inputs (so the checks above run through it)."""
    model = model_of()
    parts = [layer_parts(layer) for layer in model.model.layers]
    assert [p.sliding_window for p in parts] == [16, None]
    assert all(p.sinks is layer.self_attn.sinks for p, layer in zip(parts, model.model.layers, strict=True))
    assert all(p.q_proj.bias is not None and p.o_proj.bias is not None for p in parts)
    assert parts[0].router is model.model.layers[0].mlp.router and parts[0].mlp_pair
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(256, 64, dtype=torch.float64)
    gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > experts.limit).float().mean() > 0.1
    assert layer_parts(build_model("tiny/llama", device="meta").model.layers[0]).sinks is None


def test_a_float64_models_norms_stay_float64() -> None:
    """gpt-oss's RMSNorm rounds to float32 in transformers; a float64 model's computes in float64 (so
    plain itself is float64-accurate), a bfloat16 model's is transformers' bit for bit."""
    norm = model_of().model.layers[0].input_layernorm
    x = torch.randn(3, 64, dtype=torch.float64) * 1e3 + 1.0 / 3
    want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    assert torch.equal(norm(x), want) and not torch.equal(hf.GptOssRMSNorm.forward(norm, x), want)
    low = build_model("tiny/gpt-oss", dtype=torch.bfloat16).model.norm
    y = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(low(y), hf.GptOssRMSNorm.forward(low, y))


def test_the_simulator_runs_the_sinks_on_meta() -> None:
    """On meta tensors the sinks path runs forward and backward (the sinks' gradient (H,) included), and
    the kernel a CUDA chunk with sinks would take is named: the blocked flash kernel unpadded in half
    precision, the exact op's math otherwise (never flash-attn or SDPA, which take no sinks)."""
    q = torch.empty(1, 4, 8, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(1, 2, 24, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    sinks = torch.empty(4, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = prefix_attention(q, k, k, None, 0.25, "auto", 16, sinks=sinks)
    (d_sinks,) = torch.autograd.grad(out.sum(), (sinks,))
    assert d_sinks.shape == (4,) and d_sinks.is_meta
    assert plan_kernel("flash", q, k, None, None, simulated=True, sinks=sinks) == "blocked"
    valid = torch.ones(1, 24, dtype=torch.bool, device="meta")
    assert plan_kernel("flash", q, k, valid, None, simulated=True, sinks=sinks) == "sinks-math"
    assert plan_kernel("flash", q.float(), k.float(), None, None, simulated=True, sinks=sinks) == "sinks-math"


def test_a_simulated_streambp_step_of_gpt_oss_answers() -> None:
    from streambp_core.config import StepSpec
    from streambp_core.step.simulation.simulate import simulate

    result = simulate(StepSpec.of(model="tiny/gpt-oss", method="streambp", seq_len_tokens=128,
                                  partition_size=32, head_partition_size=16, dtype="bfloat16"))
    assert result.breakdown_bytes["kv"] > 0
