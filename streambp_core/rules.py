"""The rules a step's settings are checked by, each stated once and raised as `ConfigError`: a choice among
its values, a positive size, a tier set a method can run, a known method, packed rows and sequence
parallelism under DeepSpeed. `StreamConfig` and `StepSpec` validate with them; commands refuse input with
the same words before torch is imported."""

from __future__ import annotations

from streambp_core.errors import ConfigError
from streambp_core.registry import method_class
from streambp_core.tiers import TierError, Tiers, tier_problem


def check_offload(method: str, offload: Tiers, optimizer: str | None = None) -> None:
    """ConfigError when `method` cannot run with the tier set `offload` (and `optimizer`, when known):
    the one rule, `tiers.tier_problem` (plain keeps no checkpoints and streams no layers; params with an
    optimizer needs the optimizer tier; the optimizer tier needs an optimizer)."""
    if (problem := tier_problem(method, offload, optimizer)) is not None:
        raise ConfigError(problem)


def require_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ConfigError unless `value` is one of `choices` (the message lists them)."""
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def offload_choice(value) -> Tiers:
    """The tier set `value` names (`Tiers.of`), or ConfigError naming the unknown tier."""
    try:
        return Tiers.of(value)
    except TierError as err:
        raise ConfigError(str(err)) from None


SP_UNDER_DEEPSPEED = ("sequence parallelism does not run under DeepSpeed ZeRO; its weights are whole on each "
                      "rank or sharded with FSDP2")
"""Why a step refuses sequence parallelism with a DeepSpeed shard stage (every command says it the same)."""


def packing_problem(objective: str, sp: int = 1) -> str | None:
    """Why packed rows (`--packing`) cannot run with `objective` on `sp` ranks per sequence, in one line;
    None when they can: packed rows train the sft objective on whole (unsplit) rows."""
    if objective != "sft":
        return f"--packing: packed rows train the sft objective, not {objective}"
    if sp > 1:
        return "--packing with sequence parallelism: packed rows run unsplit (without --sp)"
    return None


def require_positive(name: str, value: int) -> None:
    """Raise ConfigError unless `value` is a positive integer (bools are not integers here)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def check_method(method: str) -> str:
    """Return `method` if it names a known method (`registry.method_class`), else raise ConfigError
    listing them."""
    try:
        method_class(method)
    except KeyError as err:
        raise ConfigError(err.args[0]) from None
    return method
