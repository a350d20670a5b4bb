"""Model presets and loading: `load_config`, `build_model`, `load_model`, `tiny_config`.

The names are loaded on first use (PEP 562), so `streambp_core.models.config_file`'s checks of a
config.json run without importing torch or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streambp_core.lazy import lazy_attributes

if TYPE_CHECKING:
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

__getattr__, __dir__ = lazy_attributes(__name__, dict.fromkeys(__all__, "streambp_core.models.load"), __all__)
