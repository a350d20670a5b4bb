"""streambp_core: exact, memory-efficient backpropagation (StreamBP), its baselines and memory measurement.

    import streambp_core
    run = streambp_core.prepare(model, "streambp", partition_size=500, head_partition_size=100)
    loss = run.loss(input_ids, attention_mask=attention_mask, labels=labels)
    loss.backward()
    run.close()

`prepare` and `Run` are loaded on first use (PEP 562), so importing a light submodule such as
`streambp_core.config` does not import torch or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streambp_core.config import METHODS, OBJECTIVES, ConfigError, StreamConfig
from streambp_core.lazy import lazy_attributes

if TYPE_CHECKING:
    from streambp_core.methods import Run, prepare

__version__ = "0.1.0"

__all__ = ["METHODS", "OBJECTIVES", "ConfigError", "Run", "StreamConfig", "prepare", "__version__"]

_LAZY = {"Run": "streambp_core.methods", "prepare": "streambp_core.methods"}
"""Public names imported from their module on first access."""


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
