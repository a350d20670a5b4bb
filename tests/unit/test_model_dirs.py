"""Malformed model directories fail with one ConfigError line naming the file and the problem."""

from __future__ import annotations

import json

import pytest

from streambp_core.config import ConfigError
from streambp_core.models import build_model, load_config, tiny_config
from streambp_core.models.load import PRESET_DIR


def _tiny_values() -> dict:
    return json.loads((PRESET_DIR / "tiny--qwen3.json").read_text())


def _write(directory, text: str | bytes) -> str:
    directory.mkdir(exist_ok=True)
    target = directory / "config.json"
    target.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(directory)


def _with(**changes) -> str:
    values = {**_tiny_values(), **changes}
    return json.dumps({key: value for key, value in values.items() if value is not ...})


CASES = {
    "truncated": (json.dumps(_tiny_values())[:120], "not valid JSON"),
    "array": ("[1, 2, 3]", "expected a JSON object, got a JSON array"),
    "binary": (b"\xff\xfe\x00\x81config", "not a text file"),
    "no_model_type": (_with(model_type=...), "no model_type"),
    "unknown_model_type": (_with(model_type="no-such-arch"), "unknown model_type 'no-such-arch'"),
    "kv_heads": (_with(num_key_value_heads=3), "not a multiple of num_key_value_heads 3"),
    "zero_layers": (_with(num_hidden_layers=0, layer_types=None), "num_hidden_layers must be a positive"),
    "layer_types": (_with(layer_types=["full_attention", "linear_attention"]), "linear_attention"),
    "layer_count": (_with(layer_types=["full_attention"] * 3), "layer_types"),
    "bad_value": (_with(rope_scaling="yes"), "invalid qwen3 config"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_config_json_is_one_config_error_naming_the_file(tmp_path, case):
    text, problem = CASES[case]
    directory = _write(tmp_path / case, text)
    with pytest.raises(ConfigError) as error:
        build_model(load_config(directory), device="meta")
    message = str(error.value)
    assert "\n" not in message
    assert f"{directory}/config.json" in message
    assert problem in message


def test_architecture_transformers_knows_but_no_path_serves_is_refused(tmp_path):
    directory = _write(tmp_path / "bart", _with(model_type="bart"))
    with pytest.raises(ConfigError, match="architecture 'bart' is not supported: an encoder-decoder"):
        load_config(directory)


def test_config_object_with_inconsistent_heads_is_refused_before_building():
    config = tiny_config("llama")
    config.num_key_value_heads = 3
    with pytest.raises(ConfigError, match="num_key_value_heads 3"):
        build_model(config, device="meta")


def test_well_formed_directory_still_loads(tmp_path):
    directory = _write(tmp_path / "good", _with())
    assert load_config(directory).num_hidden_layers == 2
