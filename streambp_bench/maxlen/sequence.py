"""`max-len --sp N`: Ulysses sequence parallelism, one rank simulated, and the per-node host budget.

The checks that need no model run before anything is imported (`sequence_fields`); the one that reads
the model's heads runs once its config is resolved (`check_heads`), still before any search.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from streambp_core.config import ConfigError, sequence_group_problem, simulated_ranks_problem

SpOption = Annotated[
    int | None,
    typer.Option("--sp", min=1, help="Ulysses sequence parallelism: N of the --gpus ranks share each "
                 "sequence (SP ranks are also the ranks the model state is sharded over, as Arctic Long "
                 "Sequence Training runs them). One rank is simulated: its T/N tokens, its H/N heads over "
                 "all T tokens, the all-to-all buffers, its shards and gathered layers. Needs --gpus."),
]
GpusPerNodeOption = Annotated[
    int,
    typer.Option("--gpus-per-node", min=1, help="GPUs of one node: with --gpus, --host-budget-gib is one "
                 "node's host memory, and each rank's share is 1/min(this, --gpus) of it."),
]
DEFAULT_GPUS_PER_NODE = 8


def sequence_fields(sp: int | None, gpus: int | None, device: str) -> dict[str, int]:
    """StepSpec fields of `--sp` (ConfigError, one line, before any work): it needs --gpus and divides it;
    it is simulated; on --device cpu it could be no more ranks than cores."""
    if sp is None:
        return {}
    cores = os.cpu_count() or 1
    if device == "cpu" and sp > cores:
        raise ConfigError(f"--sp {sp} on --device cpu needs {sp} rank processes, one per core; this machine "
                          f"has {cores} cores (verify sp checks the ranks on CPU)")
    if (problem := simulated_ranks_problem(device, sp=sp)) is not None:
        raise ConfigError(problem)
    if gpus is None:
        raise ConfigError(f"--sp {sp} needs --gpus N: the sequence-parallel ranks are among the GPUs")
    if (problem := sequence_group_problem(sp, gpus)) is not None:
        raise ConfigError(problem)
    return {"sp": sp}


def ranks_per_node(gpus: int | None, gpus_per_node: int) -> int:
    """Ranks sharing one node's host memory: min(--gpus-per-node, --gpus); 1 without --gpus."""
    return 1 if gpus is None else min(gpus, gpus_per_node)


def check_heads(specs, model) -> None:
    """ConfigError (one line) when the model's heads cannot be split over the specs' sp ranks."""
    from streambp_core.step.simulation.sequence_layout import check_sequence_parallel

    for spec in specs:
        check_sequence_parallel(spec, model.config)
