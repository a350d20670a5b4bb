"""streambp_core: exact, memory-efficient backpropagation (StreamBP), its baselines and memory measurement.

    import streambp_core
    run = streambp_core.prepare(model, "streambp", partition_size=500, head_partition_size=100)
    loss = run.loss(input_ids, attention_mask=attention_mask, labels=labels)
    loss.backward()
    run.close()
"""

from streambp_core.config import METHODS, OBJECTIVES, ConfigError, StreamConfig
from streambp_core.methods import Run, prepare

__version__ = "0.1.0"

__all__ = ["METHODS", "OBJECTIVES", "ConfigError", "Run", "StreamConfig", "prepare", "__version__"]
