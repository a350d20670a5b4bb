"""The one family table (`models.adapters.FAMILIES`) agrees with the shipped tiny presets and with the
modules transformers builds for each family."""

from __future__ import annotations

import pytest

from streambp_core.config import PRESET_DIR
from streambp_core.engine.stream.linear_grads import gated_mlp
from streambp_core.models import build_model, load_config
from streambp_core.models.adapters import FAMILIES, MOE_FAMILIES, SUPPORTED_FAMILIES, TINY_FAMILIES


def test_every_tiny_preset_is_one_familys() -> None:
    shipped = sorted(path.stem.removeprefix("tiny--") for path in PRESET_DIR.glob("tiny--*.json"))
    assert shipped == sorted(TINY_FAMILIES)
    assert len(set(SUPPORTED_FAMILIES)) == len(FAMILIES) == 20
    assert MOE_FAMILIES == ("qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.model_type)
def test_a_familys_tiny_model_has_its_model_type_and_mlp(family) -> None:
    assert load_config(f"tiny/{family.tiny}").model_type == family.model_type
    mlp = build_model(f"tiny/{family.tiny}", device="meta").model.layers[0].mlp
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
