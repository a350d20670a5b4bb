"""Model presets and loading: `load_config`, `build_model`, `load_model`, `tiny_config`."""

from streambp_core.models.load import (
    SUPPORTED_MODEL_TYPES,
    build_model,
    check_supported,
    count_parameters,
    has_weights,
    list_presets,
    load_config,
    load_model,
    tiny_config,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "build_model",
    "check_supported",
    "count_parameters",
    "has_weights",
    "list_presets",
    "load_config",
    "load_model",
    "tiny_config",
]
