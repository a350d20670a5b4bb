"""Sharded training on existing engines: torch FSDP2 (`fsdp.py`), ranks on one machine (`launch.py`),
collective counts (`comms.py`), exactness across ranks (`verify.py`), one rank of N in the simulator
(`simulate.py`) and measured on CPU ranks (`memory.py`). Public names load on first use, so importing one
submodule stays light."""

from __future__ import annotations

from streambp_core.lazy import lazy_attributes

_LAZY = {
    "SHARD_STAGES": "streambp_core.dist.fsdp",
    "shard_model": "streambp_core.dist.fsdp",
    "sharded_forward": "streambp_core.dist.fsdp",
    "full_gradients": "streambp_core.dist.fsdp",
    "run_ranks": "streambp_core.dist.launch",
    "RankError": "streambp_core.dist.launch",
    "CollectiveLog": "streambp_core.dist.comms",
    "measure_ranks": "streambp_core.dist.memory",
    "RankMemory": "streambp_core.dist.memory",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
