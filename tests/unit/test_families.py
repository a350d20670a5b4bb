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
    assert len(set(SUPPORTED_FAMILIES)) == len(FAMILIES) == 13
    assert MOE_FAMILIES == ("qwen3_moe", "mixtral")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.model_type)
def test_a_familys_tiny_model_has_its_model_type_and_mlp(family) -> None:
    assert load_config(f"tiny/{family.tiny}").model_type == family.model_type
    mlp = build_model(f"tiny/{family.tiny}", device="meta").model.layers[0].mlp
    if family.experts:
        assert not gated_mlp(mlp)
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
