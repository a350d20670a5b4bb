"""A user's local model directory: weights saved by transformers load back exactly; none is an error."""

from __future__ import annotations

import pytest
import torch

from streambp_core.config import ConfigError
from streambp_core.models import build_model, has_weights, load_model, tiny_config


def test_a_saved_directory_loads_with_its_weights(tmp_path) -> None:
    model = build_model(tiny_config("llama"), dtype=torch.float32, seed=3)
    model.save_pretrained(tmp_path)
    assert has_weights(tmp_path)
    loaded = load_model(tmp_path, dtype=torch.float32)
    assert loaded.training
    for (name, saved), (_, back) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(saved, back), name


def test_a_directory_without_weights_is_a_config_error(tmp_path) -> None:
    tiny_config("qwen3").save_pretrained(tmp_path)
    assert not has_weights(tmp_path) and not has_weights(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="no \\*.safetensors weights"):
        load_model(tmp_path)
