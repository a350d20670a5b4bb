"""A published Qwen3.5 directory (the multimodal `Qwen3_5Config`, whose `text_config` is a qwen3_5_text
model) loads wherever a model name does, as its text model; its weights (`model.language_model.*`, the
vision model's and the multi-token-prediction layer's left out) load into the text model exactly; the
multimodal model a user builds from the same config is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import streambp_core
from streambp_core.config import PRESET_DIR, ConfigError
from streambp_core.models.load import build_model, load_config, load_model
from tests.unit.test_exactness import assert_matches_plain, batch

pytestmark = pytest.mark.usefixtures("one_thread")

VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
          "patch_size": 14}
"""A vision model small enough to build in a test."""


def wrapper_values() -> dict:
    text = json.loads((PRESET_DIR / "tiny--qwen3.5.json").read_text())
    text.pop("architectures", None)
    tied = text.setdefault("tie_word_embeddings", True)  # published: the same at both levels
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": text, "vision_config": VISION, "tie_word_embeddings": tied}


@pytest.fixture
def wrapper_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(wrapper_values()))
    return tmp_path


def multimodal_model(config_dir):
    """The multimodal model of the wrapper's config (what its published checkpoint holds)."""
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    return Qwen3_5ForConditionalGeneration._from_config(AutoConfig.from_pretrained(config_dir),
                                                        dtype=torch.float64)


def test_a_qwen3_5_directory_loads_as_its_text_model(wrapper_dir) -> None:
    config = load_config(str(wrapper_dir))
    assert config.model_type == "qwen3_5_text"
    assert config.layer_types == load_config("tiny/qwen3.5").layer_types
    assert type(build_model(str(wrapper_dir), device="meta")).__name__ == "Qwen3_5ForCausalLM"


def test_verify_all_methods_on_a_qwen3_5_directory(wrapper_dir) -> None:
    from streambp_bench.cli import app

    result = CliRunner().invoke(app, ["verify", "-m", str(wrapper_dir), "--dtype", "float64",
                                      "--method", "all", "--ps", "8", "--ps-head", "8"])
    assert result.exit_code == 0, result.output
    assert "all methods match plain" in result.output


def test_the_users_causal_lm_of_the_directory_matches_plain(wrapper_dir) -> None:
    """AutoModelForCausalLM of the composite config is already the text model: the user's path runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(wrapper_dir), dtype=torch.float64)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    ids, mask = batch(model.config.vocab_size, 2, 40, "right")
    assert_matches_plain(model, ids, mask, partition_size=8, head_partition_size=8)


def test_the_multimodal_qwen3_5_is_refused_by_name(wrapper_dir) -> None:
    with pytest.raises(ConfigError) as refused:
        streambp_core.prepare(multimodal_model(wrapper_dir), "streambp")
    message = str(refused.value)
    assert "\n" not in message and "multimodal" in message
    assert "Qwen3_5ForCausalLM(config.text_config)" in message


@pytest.fixture
def saved_wrapper(wrapper_dir):
    """The wrapper directory with the multimodal model's weights as transformers saves them, plus a
    multi-token-prediction weight as the published checkpoints carry one."""
    from safetensors.torch import load_file, save_file

    model = multimodal_model(wrapper_dir)
    model.save_pretrained(wrapper_dir)
    file = next(wrapper_dir.glob("*.safetensors"))
    state = load_file(file)
    assert any(key.startswith("model.visual.") for key in state)
    save_file({**state, "mtp.fc.weight": torch.zeros(2, 2)}, file)
    return wrapper_dir, model


def test_qwen3_5_weights_load_into_the_text_model_exactly(saved_wrapper) -> None:
    path, multimodal = saved_wrapper
    text = load_model(path, dtype=torch.float64)
    assert type(text).__name__ == "Qwen3_5ForCausalLM"
    for name, param in text.model.named_parameters():
        assert torch.equal(param, multimodal.model.language_model.get_parameter(name)), name
    assert torch.equal(text.lm_head.weight, multimodal.lm_head.weight)
    ids, mask = batch(text.config.vocab_size, 2, 40, "left")
    assert_matches_plain(text, ids, mask, partition_size=8, head_partition_size=8)


def test_an_unknown_qwen3_5_weight_is_refused(saved_wrapper) -> None:
    from safetensors.torch import load_file, save_file

    path = saved_wrapper[0]
    file = next(path.glob("*.safetensors"))
    save_file({**load_file(file), "audio_tower.weight": torch.zeros(2)}, file)
    with pytest.raises(ConfigError, match="audio_tower.weight"):
        load_model(path)
