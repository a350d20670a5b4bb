"""A gemma3 wrapper directory (the multimodal `Gemma3Config`, whose `text_config` is a gemma3_text model)
loads wherever a model name does, as its text model; its weights (named `language_model.*`) load into the
text model; the multimodal model a user builds from the same config is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import streambp_core
from streambp_core.config import PRESET_DIR, ConfigError
from streambp_core.models.load import build_model, load_config, load_model
from streambp_core.models.precision import norms_in_at_least_float32
from tests.unit.test_exactness import assert_matches_plain, batch

VISION = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
"""A vision tower small enough to build in a test (the wrapper's default is SigLIP's 400M)."""


def text_values() -> dict:
    values = json.loads((PRESET_DIR / "tiny--gemma3.json").read_text())
    values.pop("architectures")
    return values


def wrapper_values(**top) -> dict:
    return {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
            "text_config": text_values(), "vision_config": VISION, "mm_tokens_per_image": 4, **top}


@pytest.fixture
def wrapper_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(wrapper_values()))
    return tmp_path


def user_model(config_dir, dtype=torch.float64):
    """The model a user gets from transformers for the wrapper's config (the multimodal class)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=dtype)


def test_a_wrapper_directory_loads_as_its_text_model(wrapper_dir) -> None:
    config = load_config(str(wrapper_dir))
    tiny = load_config("tiny/gemma3")
    assert config.model_type == "gemma3_text" and config.tie_word_embeddings
    tiny.architectures = None
    assert config.to_diff_dict() == tiny.to_diff_dict()
    assert type(build_model(str(wrapper_dir), device="meta")).__name__ == "Gemma3ForCausalLM"
    untied = wrapper_dir / "untied"
    untied.mkdir()
    (untied / "config.json").write_text(json.dumps(wrapper_values(tie_word_embeddings=False)))
    assert not load_config(str(untied)).tie_word_embeddings  # the wrapper's head untied: the text model's too


def test_a_wrapper_config_object_builds_its_text_model(wrapper_dir) -> None:
    from transformers import AutoConfig

    model = build_model(AutoConfig.from_pretrained(wrapper_dir), device="meta")
    assert type(model).__name__ == "Gemma3ForCausalLM"


@pytest.mark.parametrize("broken, message", [
    ({"text_config": None}, "needs a text_config"),
    ({"text_config": {**text_values(), "model_type": "llama"}}, "must be gemma3_text"),
])
def test_a_wrapper_without_its_text_model_is_refused(tmp_path, broken, message) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**wrapper_values(), **broken}))
    with pytest.raises(ConfigError, match=message):
        load_config(str(tmp_path))


@pytest.mark.slow
def test_verify_all_methods_on_a_wrapper_directory(wrapper_dir) -> None:
    from streambp_bench.cli import app

    result = CliRunner().invoke(app, ["verify", "-m", str(wrapper_dir), "--dtype", "float64",
                                      "--method", "all", "--ps", "8", "--ps-head", "8"])
    assert result.exit_code == 0, result.output
    assert "all methods match plain" in result.output
    for method in ("plain", "checkpoint", "mst", "streambp"):
        assert method in result.output


def test_the_users_multimodal_model_is_refused_by_name(wrapper_dir) -> None:
    model = user_model(wrapper_dir)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    with pytest.raises(ConfigError) as refused:
        streambp_core.prepare(model, "streambp")
    message = str(refused.value)
    assert "\n" not in message and "multimodal" in message
    assert "Gemma3ForCausalLM(config.text_config)" in message


@pytest.fixture
def saved_wrapper(tmp_path):
    """A wrapper directory with the multimodal model's weights, as transformers saves them."""
    model = user_model_from_values(wrapper_values())
    model.save_pretrained(tmp_path)
    return tmp_path, model


def user_model_from_values(values, dtype=torch.float64):
    from transformers import AutoModelForCausalLM, Gemma3Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Gemma3Config.from_dict(values), dtype=dtype)


def test_wrapper_weights_load_into_the_text_model_exactly(saved_wrapper) -> None:
    path, multimodal = saved_wrapper
    text = load_model(path, dtype=torch.float64)
    assert type(text).__name__ == "Gemma3ForCausalLM" and text.training
    language = multimodal.model.language_model
    for name, param in text.model.named_parameters():
        assert torch.equal(param, language.get_parameter(name)), name
    assert torch.equal(text.lm_head.weight, multimodal.lm_head.weight)
    ids, mask = batch(text.config.vocab_size, 2, 24, "right")
    norms_in_at_least_float32(multimodal)  # as every float64 model the package builds (models.precision)
    multimodal.eval(), text.eval()
    with torch.no_grad():
        assert torch.equal(text(ids, attention_mask=mask).logits, multimodal(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("padding", ["left", "right"])
def test_the_loaded_text_model_matches_plain(saved_wrapper, padding) -> None:
    text = load_model(saved_wrapper[0], dtype=torch.float64)
    ids, mask = batch(text.config.vocab_size, 2, 40, padding)
    assert_matches_plain(text, ids, mask, partition_size=8, head_partition_size=8)


def test_weights_of_an_unknown_name_are_refused(saved_wrapper) -> None:
    from safetensors.torch import load_file, save_file

    path = saved_wrapper[0]
    file = next(path.glob("*.safetensors"))
    state = load_file(file)
    state["audio_tower.weight"] = torch.zeros(2)
    save_file(state, file)
    with pytest.raises(ConfigError, match="audio_tower.weight"):
        load_model(path)


def test_missing_text_weights_are_refused(saved_wrapper) -> None:
    from safetensors.torch import load_file, save_file

    path = saved_wrapper[0]
    file = next(path.glob("*.safetensors"))
    state = load_file(file)
    del state["language_model.model.norm.weight"]
    save_file(state, file)
    with pytest.raises(ConfigError, match="lacks model.norm.weight"):
        load_model(path)
