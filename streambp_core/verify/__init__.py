"""Exactness checks: every method's loss and gradients against plain backprop's on one model.

- `methods`: `verify_methods` / `verify_spec` (a `VerifySpec` -> a `VerifyReport`), the criterion and
  tolerances;
- `compare`: gradient errors in float64 (relative and absolute, as `torch.testing.assert_close`);
- `ram`: the RAM a verify run needs on a CPU, checked before the model is built;
- across ranks: `sharded` (FSDP2), `sequence` (Ulysses sequence parallelism), `deepspeed` (ZeRO-1/2/3);
- through trainers: `trainer_parity` (a trainer's updates with and without `stream_trainer`),
  `trainer_setup` (the model, data and trainer a parity run builds), `trainer_sharded` (the same on ranks).

Public names load on first use, so importing one submodule stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streambp_core.lazy import lazy_attributes

if TYPE_CHECKING:
    from streambp_core.verify.methods import (
        CRITERION,
        MethodResult,
        VerifyReport,
        VerifySpec,
        run_step,
        verify_methods,
        verify_spec,
    )

__all__ = [
    "CRITERION", "MethodResult", "VerifyReport", "VerifySpec", "run_step", "verify_methods", "verify_spec"
]

_LAZY = dict.fromkeys(__all__, "streambp_core.verify.methods")
"""Public names imported from their module on first access."""


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
