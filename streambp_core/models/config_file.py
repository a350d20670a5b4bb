"""Reading a model's config.json and checking its geometry, with one-line errors naming the file.

A malformed model directory (config.json that is not JSON or not an object, no or an unknown
`model_type`, head counts that do not divide, layer types the engine has no kernel for) raises
ConfigError here, before a model is built, instead of a traceback from deep inside transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from streambp_core.config import ConfigError

try:
    from huggingface_hub.errors import StrictDataclassError

    _VALIDATION_ERRORS: tuple[type[Exception], ...] = (StrictDataclassError,)
except ImportError:  # huggingface_hub before strict dataclasses: transformers raises ValueError/TypeError
    _VALIDATION_ERRORS = ()

ENGINE_LAYER_TYPES = ("full_attention", "sliding_attention")
"""`config.layer_types` entries the engine has an attention for (which windows a family may use is
decided by `streambp_core.models.adapters`)."""

POSITIVE_SIZES = (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
)  # fmt: skip
"""Config sizes that must be positive integers when present."""


def read_config_file(path: Path) -> dict:
    """The JSON object in `path`, or ConfigError naming the file and what is wrong with it."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (config.json must be JSON)") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror or error}") from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        where = f"line {error.lineno}, column {error.colno}"
        raise ConfigError(f"{path}: not valid JSON ({error.msg} at {where})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a JSON object, got a JSON {_json_kind(values)}")
    return values


def _json_kind(value: object) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return kinds.get(type(value), "null")


def config_from_values(values: dict, source: str) -> PretrainedConfig:
    """A transformers config from config.json's values, or ConfigError naming `source` and the problem."""
    model_type = values.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: no model_type (config.json must name its architecture)")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{source}: unknown model_type {model_type!r} (no architecture of that name)")
    try:
        config = CONFIG_MAPPING[model_type].from_dict(values)
    except (TypeError, ValueError, KeyError, AttributeError, *_VALIDATION_ERRORS) as error:
        raise ConfigError(f"{source}: invalid {model_type} config: {' '.join(str(error).split())}") from None
    check_geometry(config, source)
    return config


def check_geometry(config: PretrainedConfig, source: str) -> None:
    """ConfigError unless sizes are positive, query heads are a multiple of K/V heads and every layer type
    has a kernel (transformers' own validation covers the rest, e.g. hidden size vs heads)."""
    for name in POSITIVE_SIZES:
        value = getattr(config, name, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ConfigError(f"{source}: {name} must be a positive integer, got {value!r}")
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads and (not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads):
        raise ConfigError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads!r}"
        )
    _check_layer_types(config, source)


def _check_layer_types(config: PretrainedConfig, source: str) -> None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return
    unknown = sorted({str(kind) for kind in layer_types} - set(ENGINE_LAYER_TYPES))
    if unknown:
        raise ConfigError(
            f"{source}: layer_types {', '.join(unknown)} not supported by the engine "
            f"(it runs {' and '.join(ENGINE_LAYER_TYPES)})"
        )
