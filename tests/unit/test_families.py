"""The one family table (`models.adapters.FAMILIES`) agrees with the shipped tiny presets and with the
modules transformers builds for each family."""

from __future__ import annotations

import json

import pytest

from streambp_core.config import PRESET_DIR
from streambp_core.engine.stream.linear_grads import gated_mlp
from streambp_core.models import build_model, load_config
from streambp_core.models.adapters import FAMILIES, MOE_FAMILIES, SUPPORTED_FAMILIES, TINY_FAMILIES, layer_mlp
from streambp_core.models.catalogue import serving


def test_every_tiny_preset_is_one_familys() -> None:
    """One tiny preset per engine family; the others are test models of the baselines tier (streambp through
    their own decoder layers)."""
    shipped = {path.stem.removeprefix("tiny--"): json.loads(path.read_text())["model_type"]
               for path in PRESET_DIR.glob("tiny--*.json")}
    engine = sorted(name for name, kind in shipped.items() if serving(kind).path == "engine")
    assert engine == sorted(TINY_FAMILIES)
    assert all(serving(kind).path == "baselines" for name, kind in shipped.items()
               if name not in TINY_FAMILIES)
    assert len(set(SUPPORTED_FAMILIES)) == len(FAMILIES) == 27
    assert MOE_FAMILIES == ("qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3", "gpt_oss",
                            "llama4_text", "qwen3_5_moe_text", "qwen3_next")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.model_type)
def test_a_familys_tiny_model_has_its_model_type_and_mlp(family) -> None:
    assert load_config(f"tiny/{family.tiny}").model_type == family.model_type
    mlp = layer_mlp(build_model(f"tiny/{family.tiny}", device="meta").model.layers[0])
    if family.experts:
        assert not gated_mlp(mlp)
    elif family.other_mlp is not None:
        assert type(mlp).__name__ == family.other_mlp and not gated_mlp(mlp)
    else:
        assert type(mlp).__name__ == family.gated_mlp and gated_mlp(mlp)


def test_smollm3s_nope_layers_are_not_rotated() -> None:
    from streambp_core.models.adapters import layer_parts

    layers = build_model("tiny/smollm3", device="meta").model.layers
    assert [layer_parts(layer).rotary for layer in layers] == [True, False]
    assert all(layer_parts(layer).rotary for layer in build_model("tiny/llama", device="meta").model.layers)


def test_seed_oss_residual_dropout_is_refused_in_train_mode() -> None:
    import streambp_core
    from streambp_core.config import ConfigError
    from streambp_core.models.load import tiny_config

    model = build_model(tiny_config("seed-oss", residual_dropout=0.1))
    model.train()
    with pytest.raises(ConfigError, match="residual_dropout"):
        with streambp_core.prepare(model, "streambp"):
            pass


def test_granites_multipliers_reach_the_engine() -> None:
    from streambp_core.models.adapters import decoder_parts, layer_parts

    model = build_model("tiny/granite", device="meta")
    parts = decoder_parts(model)
    assert (parts.embedding_multiplier, parts.logits_scaling) == (12.0, 4.0)
    assert {(layer_parts(layer).residual_multiplier, layer_parts(layer).scaling) for layer in parts.layers} \
        == {(0.22, 0.1)}
    llama = decoder_parts(build_model("tiny/llama", device="meta"))
    assert (llama.embedding_multiplier, llama.logits_scaling) == (1.0, 1.0)


def test_olmo2_norms_after_and_over_every_head() -> None:
    from torch import nn

    from streambp_core.models.adapters import layer_parts

    layer = build_model("tiny/olmo2", device="meta").model.layers[0]
    parts = layer_parts(layer)
    assert isinstance(parts.input_norm, nn.Identity) and isinstance(parts.post_norm, nn.Identity)
    assert (parts.attn_out_norm, parts.mlp_out_norm) == (layer.post_attention_layernorm,
                                                        layer.post_feedforward_layernorm)
    assert parts.qk_norm_whole and parts.q_norm.weight.shape == (parts.num_heads * parts.head_dim,)


def test_olmo3s_sliding_layers_have_their_window_and_rope_table() -> None:
    from streambp_core.models.adapters import layer_parts

    layers = build_model("tiny/olmo3", device="meta").model.layers
    assert all(layer_parts(layer).qk_norm_whole for layer in layers)
    assert [(layer_parts(layer).sliding_window, layer_parts(layer).rope_key) for layer in layers] == [
        (16, "sliding_attention"), (None, "full_attention")]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_olmo2s_float32_rope_tables_rotate_as_transformers_in_every_precision(dtype) -> None:
    """OLMo 2 and 3 keep their RoPE tables in float32: the rotation and its transpose take the wider type
    and round back to the activations', bit for bit as transformers' rotation and its autograd backward."""
    import torch
    from transformers.models.olmo2 import modeling_olmo2 as hf

    from streambp_core.engine.stream.rope import Rope, rope_transpose, rotate

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 8, generator=gen).to(getattr(torch, dtype)).requires_grad_()
    angles = torch.randn(2, 5, 4, generator=gen)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q_hf, _ = hf.apply_rotary_pos_emb(q, q.detach(), cos, sin)
    grad = torch.randn(q.shape, generator=gen).to(q.dtype)
    (grad_hf,) = torch.autograd.grad(q_hf, q, grad)
    rope = Rope.of(cos, sin)
    assert rotate(q.detach(), rope).dtype == q.dtype
    assert torch.equal(rotate(q.detach(), rope), q_hf) and torch.equal(rope_transpose(grad, rope), grad_hf)


def test_phi3s_fused_qkv_is_read_as_its_rows() -> None:
    from streambp_core.engine.stream.linear_grads import plain_linear
    from streambp_core.models.adapters import FusedRows, layer_parts

    layer = build_model("tiny/phi3", device="meta").model.layers[0]
    parts = layer_parts(layer)
    projections = (parts.q_proj, parts.k_proj, parts.v_proj)
    assert all(isinstance(p, FusedRows) and p.fused is layer.self_attn.qkv_proj for p in projections)
    assert all(plain_linear(p) for p in projections)
    assert [(p.start, p.end) for p in projections] == [(0, 64), (64, 96), (96, 128)]


def test_each_familys_layer_parts_follow_its_transformers_layer() -> None:
    """HunYuan's norms after RoPE, EXAONE 4's missing pre-norms and NoPE global layer, GLM-4's sandwich
    norms and interleaved partial RoPE, ERNIE 4.5's float32 interleaved RoPE, Apertus' norm names."""
    from torch import nn

    from streambp_core.models.adapters import layer_parts

    def parts(name: str, index: int = 0):
        return layer_parts(build_model(f"tiny/{name}", device="meta").model.layers[index])

    hunyuan = parts("hunyuan")
    assert hunyuan.qk_norm_after_rope and hunyuan.k_norm is not None and hunyuan.q_norm is not None
    exaone_local, exaone_global = parts("exaone4", 0), parts("exaone4", 1)
    assert all(isinstance(norm, nn.Identity) for norm in (exaone_local.input_norm, exaone_local.post_norm))
    assert exaone_local.attn_out_norm is not None and exaone_local.mlp_out_norm is not None
    assert (exaone_local.rotary, exaone_local.sliding_window) == (True, 16)
    assert (exaone_global.rotary, exaone_global.sliding_window) == (False, None)
    glm = parts("glm4")
    assert glm.rope_interleaved and not glm.rope_in_float32
    assert glm.attn_out_norm is not None and glm.mlp_out_norm is not None
    ernie = parts("ernie4.5")
    assert ernie.rope_interleaved and ernie.rope_in_float32 and ernie.attn_out_norm is None
    apertus = parts("apertus")
    assert type(apertus.input_norm).__name__ == "ApertusRMSNorm" and apertus.q_norm is not None


def test_glm4_moes_float32_router_is_transformers_and_float64_in_a_float64_model() -> None:
    """GLM-4.5's router: transformers' forward bit for bit in float32 (the at-least-float32 one, applied
    to a float32 router); a float64 model's router has a float64 weight and float64 logits, a float32
    model's is transformers' own; its config's `output_router_logits` adds no loss (the model has none)."""
    import torch

    from streambp_core.engine.stream.router import router_aux
    from streambp_core.models.load import tiny_config
    from streambp_core.models.precision import _router_in_at_least_float32

    wide = build_model("tiny/glm4-moe", dtype=torch.float64).model.layers[1].mlp.gate
    plain = build_model("tiny/glm4-moe", dtype=torch.float32).model.layers[1].mlp.gate
    assert wide.weight.dtype == torch.float64 and "forward" in vars(wide)
    assert plain.weight.dtype == torch.float32 and "forward" not in vars(plain)
    torch.nn.init.normal_(plain.weight)
    hidden = torch.randn(7, plain.hidden_dim, generator=torch.Generator().manual_seed(0))
    expected = plain(hidden)
    ours = _router_in_at_least_float32(plain, hidden)
    assert all(torch.equal(a, b) for a, b in zip(ours, expected, strict=True))
    assert wide(hidden.double())[0].dtype == torch.float64
    assert router_aux(tiny_config("glm4-moe", output_router_logits=True)) is None


def test_deepseek_v3s_latent_attention_reaches_the_engine() -> None:
    """DeepSeek-V3's MLA: the tiny preset's queries go through q_a/q_b, its keys through a 16-wide latent
    and an 8-wide rotary key, interleaved, and its scale carries YaRN's mscale (not qk_head_dim ** -0.5)."""
    from streambp_core.models.adapters import layer_parts

    layers = build_model("tiny/deepseek-v3", device="meta").model.layers
    parts = [layer_parts(layer) for layer in layers]
    mla = parts[0].mla
    assert mla is not None and mla.q_proj is None and mla.q_a_proj is not None and mla.q_b_proj is not None
    sizes = (mla.latent_dim, mla.rope_dim, mla.nope_dim, mla.v_dim, mla.rope_interleave)
    assert sizes == (16, 8, 8, 16, True)
    assert parts[0].scaling != pytest.approx(16 ** -0.5) and parts[0].scaling == layers[0].self_attn.scaling
    assert parts[0].router is None and parts[1].router is not None  # first_k_dense_replace 1
    assert layer_parts(build_model("tiny/llama", device="meta").model.layers[0]).mla is None


@pytest.mark.parametrize("overrides", [{"q_lora_rank": None}, {"rope_interleave": False}],
                         ids=["one-q-proj", "rope-halves"])
def test_deepseek_v3s_variants_match_plain(overrides) -> None:
    """The variants the tiny preset does not take: one q_proj (Moonlight), RoPE on halves."""
    import torch

    from streambp_core.models.load import tiny_config
    from tests.unit.test_exactness import assert_matches_plain, batch

    model = build_model(tiny_config("deepseek-v3", **overrides), dtype=torch.float64, seed=0)
    ids, mask = batch(model.config.vocab_size, 2, 11, "right")
    assert_matches_plain(model, ids, mask, methods=("streambp",), partition_size=4, head_partition_size=4)


def test_deepseek_v3s_rope_is_transformers_bit_for_bit() -> None:
    import torch
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from streambp_core.engine.stream.mla import rotate_mla

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=gen), torch.randn(2, 1, 5, 8, generator=gen)
    angles = torch.randn(2, 5, 4, generator=gen)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    for interleave, apply in ((True, hf.apply_rotary_pos_emb_interleave), (False, hf.apply_rotary_pos_emb)):
        q_hf, k_hf = apply(q, k, cos, sin)
        assert torch.equal(rotate_mla(q, cos[:, None], sin[:, None], interleave), q_hf)
        assert torch.equal(rotate_mla(k, cos[:, None], sin[:, None], interleave), k_hf)


def test_deepseek_v3s_wrapped_kv_b_proj_is_refused() -> None:
    from torch import nn

    from streambp_core.config import ConfigError
    from streambp_core.models.adapters import layer_parts

    layer = build_model("tiny/deepseek-v3", device="meta").model.layers[0]
    layer.self_attn.kv_b_proj = nn.Sequential(layer.self_attn.kv_b_proj)
    with pytest.raises(ConfigError, match="kv_b_proj"):
        layer_parts(layer)


def test_deepseek_v3s_stored_prefix_is_the_latent() -> None:
    """Simulated: a streamed MLA layer's K/V (and their gradients) are one latent + rotary key per position,
    2 x T x (kv_lora_rank + qk_rope_head_dim) values, not heads x (qk + v head dims) per position."""
    from streambp_core.config import StepSpec
    from streambp_core.step.simulation.simulate import simulate

    tokens, width, bf16 = 128, 16 + 8, 2
    result = simulate(StepSpec.of(model="tiny/deepseek-v3", method="streambp", seq_len_tokens=tokens,
                                  partition_size=32, head_partition_size=16, dtype="bfloat16"))
    assert result.breakdown_bytes["kv"] == 2 * tokens * width * bf16
    per_head = 2 * tokens * 4 * (16 + 16) * bf16
    assert result.breakdown_bytes["kv"] < per_head / 5
