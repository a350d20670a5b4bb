"""Presets load offline, have the published sizes, and bad names or families fail on one line."""

from __future__ import annotations

import json

import pytest
import torch

from streambp_core.config import ConfigError
from streambp_core.models import (
    SUPPORTED_MODEL_TYPES,
    build_model,
    count_parameters,
    list_presets,
    load_config,
    tiny_config,
)
from streambp_core.models.catalogue import serving

PUBLISHED_PARAMS_B = {
    "Qwen/Qwen3-0.6B": 0.6,
    "Qwen/Qwen3-1.7B": 1.7,
    "Qwen/Qwen3-4B": 4.0,
    "Qwen/Qwen3-8B": 8.19,
    "Qwen/Qwen3-14B": 14.77,
    "Qwen/Qwen3-32B": 32.76,
    "Qwen/Qwen2.5-7B": 7.62,
    "meta-llama/Llama-3.1-8B": 8.03,
    "meta-llama/Llama-3.2-1B": 1.24,
    "meta-llama/Llama-3.2-3B": 3.21,
    "mistralai/Mistral-7B-v0.3": 7.25,
    "mistralai/Mistral-7B-v0.1": 7.24,
    "mistralai/Mixtral-8x7B-v0.1": 46.7,
    "Qwen/Qwen3-30B-A3B": 30.5,
    # Gemma 3: the language model alone (Gemma 3 technical report, table 1: embedding + non-embedding)
    "google/gemma-3-1b-it": 1.0,
    "google/gemma-3-4b-it": 3.88,
    "google/gemma-3-12b-it": 11.77,
    "google/gemma-3-27b-it": 27.02,
    "ByteDance-Seed/Seed-OSS-36B-Base": 36.15,
    "HuggingFaceTB/SmolLM3-3B": 3.08,
    "ibm-granite/granite-3.3-8b-instruct": 8.17,
    "allenai/OLMo-2-1124-7B-Instruct": 7.30,
    "allenai/Olmo-3-7B-Instruct": 7.30,
    "microsoft/Phi-3-mini-4k-instruct": 3.82,
    "tencent/Hunyuan-7B-Instruct": 7.5,
    "swiss-ai/Apertus-8B-2509": 8.05,
    "baidu/ERNIE-4.5-0.3B-PT": 0.36,
    "LGAI-EXAONE/EXAONE-4.0-1.2B": 1.28,
    "zai-org/GLM-4-9B-0414": 9.4,
    "Qwen/Qwen1.5-MoE-A2.7B": 14.32,
    "zai-org/GLM-4.5-Air": 106.85,
    "deepseek-ai/DeepSeek-V3": 671.03,
    "moonshotai/Moonlight-16B-A3B": 15.96,
    "openai/gpt-oss-20b": 20.91,  # the gpt-oss model card: 20.91B and 116.83B in all
    "openai/gpt-oss-120b": 116.83,
    "google/gemma-2-2b": 2.61,
    "google/gemma-2-9b": 9.24,
    # Llama 4: the language model alone (its text_config; Meta's 109B and 400B count the vision encoder too)
    "meta-llama/Llama-4-Scout-17B-16E": 107.77,
    "meta-llama/Llama-4-Maverick-17B-128E": 400.71,
    "Qwen/Qwen3.5-0.8B": 0.75,  # the language models alone (their config.json's text_config), no vision tower
    "Qwen/Qwen3.5-35B-A3B": 34.66,
    "Qwen/Qwen3-Next-80B-A3B-Instruct": 79.67,  # without its multi-token-prediction layer
}
PUBLISHED_FLOAT32 = {"google/gemma-2-2b", "google/gemma-2-9b"}
"""Published checkpoints whose config.json says float32 (the others bfloat16)."""
TINY = ["tiny/qwen3", "tiny/qwen2", "tiny/llama", "tiny/mistral", "tiny/gemma3", "tiny/qwen3-moe",
        "tiny/mixtral", "tiny/seed-oss", "tiny/smollm3", "tiny/granite", "tiny/olmo2", "tiny/olmo3",
        "tiny/phi3", "tiny/hunyuan", "tiny/apertus", "tiny/ernie4.5", "tiny/exaone4", "tiny/glm4",
        "tiny/qwen2-moe", "tiny/glm4-moe", "tiny/deepseek-v3", "tiny/gpt-oss", "tiny/gemma2", "tiny/llama4",
        "tiny/qwen3.5", "tiny/qwen3.5-moe", "tiny/qwen3-next"]
TINY_OWN_LAYERS = {"tiny/gemma4": "gemma4_text", "tiny/gemma4-moe": "gemma4_text",
                   "tiny/nemotron_h": "nemotron_h", "tiny/qwen4_exp": "qwen4_exp_text",
                   "tiny/glm_moe_dsa": "glm_moe_dsa", "tiny/deepseek_v4": "deepseek_v4",
                   "tiny/minimax_m2": "minimax_m2", "tiny/ministral3": "ministral3",
                   "tiny/glm4_moe_lite": "glm4_moe_lite", "tiny/granitemoehybrid": "granitemoehybrid",
                   "tiny/lfm2": "lfm2"}
"""Test models of the baselines tier (streambp through their own decoder layers), by their model_type."""


def test_presets_cover_the_published_models_and_tiny_ones():
    assert set(list_presets()) == set(PUBLISHED_PARAMS_B) | set(TINY) | set(TINY_OWN_LAYERS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_B))
def test_real_preset_has_published_parameter_count(name):
    model = build_model(name, device="meta")
    params_b = count_parameters(model) / 1e9
    assert params_b == pytest.approx(PUBLISHED_PARAMS_B[name], rel=0.02)
    assert all(param.is_meta for param in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_B))
def test_real_preset_is_bf16_and_in_a_supported_family(name):
    config = load_config(name)
    assert config.model_type in SUPPORTED_MODEL_TYPES
    assert config.dtype == (torch.float32 if name in PUBLISHED_FLOAT32 else torch.bfloat16)


def test_qwen3_8b_matches_its_published_config():
    config = load_config("Qwen/Qwen3-8B")
    shape = (config.hidden_size, config.intermediate_size, config.num_hidden_layers)
    assert shape == (4096, 12288, 36)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert (config.vocab_size, config.tie_word_embeddings) == (151936, False)


@pytest.mark.parametrize(
    ("name", "tied"),
    [("Qwen/Qwen3-0.6B", True), ("Qwen/Qwen3-4B", True), ("Qwen/Qwen3-14B", False), ("tiny/llama", False)],
)
def test_tied_embeddings_follow_the_published_configs(name, tied):
    assert load_config(name).tie_word_embeddings is tied


def test_llama_3_presets_use_llama3_rope_scaling():
    for name in ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-3B"):
        assert load_config(name).rope_parameters["rope_type"] == "llama3"


def test_preset_names_are_case_insensitive():
    assert load_config("qwen/qwen3-8b").hidden_size == 4096


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_builds_a_small_trainable_model(name):
    model = build_model(name, dtype=torch.float64)
    assert model.training
    assert count_parameters(model) < 200_000
    assert all(param.dtype == torch.float64 and param.device.type == "cpu" for param in model.parameters())
    if model.config.model_type != "deepseek_v3":  # latent attention: one latent for every head, no GQA
        assert model.config.num_key_value_heads < model.config.num_attention_heads


@pytest.mark.parametrize("name", sorted(TINY_OWN_LAYERS))
def test_tiny_own_layer_preset_builds_a_small_baselines_model(name):
    model = build_model(name, dtype=torch.float64)
    assert model.config.model_type == TINY_OWN_LAYERS[name]
    assert serving(model.config.model_type).path == "baselines"
    assert (model.config.hidden_size, model.config.vocab_size) == (64, 512)
    assert count_parameters(model) < 2_000_000


def test_tiny_qwen2_has_qkv_bias_and_tiny_qwen3_head_dim_differs_from_hidden_over_heads():
    attention = build_model("tiny/qwen2").model.layers[0].self_attn
    assert attention.q_proj.bias is not None and attention.o_proj.bias is None
    config = load_config("tiny/qwen3")
    assert config.head_dim != config.hidden_size // config.num_attention_heads


def test_same_seed_gives_same_weights_and_other_seed_differs():
    first, again, other = (build_model("tiny/llama", seed=seed) for seed in (3, 3, 4))
    pairs = list(zip(first.parameters(), again.parameters(), other.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b, _ in pairs)
    assert not all(torch.equal(a, c) for a, _, c in pairs)


def test_build_model_keeps_the_configured_dropout():
    model = build_model(tiny_config("llama", attention_dropout=0.5))
    assert model.config.attention_dropout == 0.5  # trained as configured (streambp/mst refuse it by name)


def test_tiny_config_applies_overrides():
    config = tiny_config("mistral", num_hidden_layers=3, tie_word_embeddings=True)
    assert (config.num_hidden_layers, config.tie_word_embeddings, config.model_type) == (3, True, "mistral")


def test_tiny_config_rejects_unknown_family_and_keys():
    with pytest.raises(ConfigError, match="gpt2"):
        tiny_config("gpt2")
    with pytest.raises(ConfigError, match="num_layerz"):
        tiny_config("llama", num_layerz=3)


def test_unknown_name_error_is_one_line_listing_the_presets():
    with pytest.raises(ConfigError) as error:
        load_config("Qwen/Qwen3-9000B")
    message = str(error.value)
    assert "\n" not in message
    assert "Qwen/Qwen3-9000B" in message
    assert all(name in message for name in list_presets())


def test_local_directory_with_config_json_loads(tmp_path):
    values = json.loads(json.dumps(load_config("tiny/llama").to_dict()))
    (tmp_path / "config.json").write_text(json.dumps({**values, "num_hidden_layers": 3}))
    config = load_config(str(tmp_path))
    assert (config.model_type, config.num_hidden_layers) == ("llama", 3)
    assert count_parameters(build_model(str(tmp_path), device="meta")) > 0


def test_directory_without_config_json_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_config(str(tmp_path))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bart", "decoder_layers": 2}))
    with pytest.raises(ConfigError) as error:
        load_config(str(tmp_path))
    message = str(error.value)
    assert "'bart' is not supported: an encoder-decoder" in message and "\n" not in message
    assert all(family in message for family in SUPPORTED_MODEL_TYPES)
