"""Sharded training on existing engines: torch FSDP2 (`fsdp.py`), DeepSpeed (`deepspeed.py`), ranks on
one machine (`launch.py`), collective counts (`comms.py`) and one rank of N measured on CPU ranks
(`memory.py`, `deepspeed_memory.py`). Exactness across ranks is checked in `streambp_core.verify`; one
rank of N in the simulator is `streambp_core.step.parts.shards`, and a unit's work runs as its forward through
`streambp_core.engine.engines.fsdp_unit`. Public names load on first use, so importing one submodule
stays light."""

from __future__ import annotations

from streambp_core.lazy import lazy_attributes

_LAZY = {
    "SHARD_STAGES": "streambp_core.parallel.fsdp",
    "shard_model": "streambp_core.parallel.fsdp",
    "sharded_forward": "streambp_core.engine.engines.fsdp_unit",
    "full_gradients": "streambp_core.parallel.fsdp",
    "run_ranks": "streambp_core.parallel.launch",
    "RankError": "streambp_core.parallel.launch",
    "CollectiveLog": "streambp_core.parallel.comms",
    "measure_ranks": "streambp_core.parallel.memory",
    "RankMemory": "streambp_core.parallel.memory",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
