"""Checks of what a user names before any work: the shipped presets' names (a name is matched to one by
`models.catalogue.model_file`), a memory budget in GiB, and the CPU cores this process may use. Cheap: no
torch or transformers import."""

from __future__ import annotations

import math
import os
import re
from functools import cache
from pathlib import Path

from streambp_core.errors import ConfigError

PRESET_DIR = Path(__file__).parent / "models" / "presets"
"""The shipped model presets: `<org>--<name>.json` for `<org>/<name>`."""


@cache
def preset_names() -> tuple[str, ...]:
    """The shipped presets' names: real models by their hub name first (numbers compared as numbers:
    0.6B < 4B < 14B), then the `tiny/*` test models. Cheap: no transformers import."""
    names = [path.stem.replace("--", "/") for path in PRESET_DIR.glob("*.json")]
    return tuple(sorted(names, key=_natural_key))


def _natural_key(name: str) -> tuple:
    """Sort key: tiny presets last, then by name with numbers compared as numbers."""
    parts = re.split(r"(\d+(?:\.\d+)?)", name.lower())
    return (name.startswith("tiny/"), [float(part) if i % 2 else part for i, part in enumerate(parts)])


def available_cpus() -> int:
    """CPU cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


MAX_BUDGET_GIB = 2.0**20
"""The largest budget taken, in GiB (1 PiB, far above any device or host): a larger one (1e308) has no byte
count (inf) and is refused by name, not an OverflowError where it is first counted in bytes."""


def check_budget_gib(budget_gib: float | None, option: str = "--budget-gib") -> float | None:
    """`budget_gib` if None or a finite positive number up to `MAX_BUDGET_GIB`, else ConfigError."""
    if budget_gib is not None and (not math.isfinite(budget_gib) or not 0 < budget_gib <= MAX_BUDGET_GIB):
        raise ConfigError(f"{option} must be a finite positive number of GiB, at most {MAX_BUDGET_GIB:,.0f} "
                          f"(1 PiB), got {budget_gib:g}")
    return budget_gib


def sequence_group_problem(sp: int, ranks: int, ranks_flag: str = "--gpus") -> str | None:
    """Why `sp` sequence-parallel ranks cannot group `ranks` ranks (`ranks_flag`: the option that gives
    them), in one line; None when they can. The one statement of the rule: sp divides the ranks, which form
    groups of sp, each group sharing its sequences."""
    if ranks % sp:
        return (f"--sp {sp} does not divide {ranks_flag} {ranks}: the ranks form groups of sp, each group "
                "sharing its sequences")
    return None


def simulated_ranks_problem(device: str, *, gpus: int | None = None, sp: int | None = None,
                            shard: str | None = None) -> str | None:
    """Why a step of one rank among several (`gpus`, `sp` per sequence, model state held as `shard`; None
    or 1 or "none": not given) cannot run on `device` (cpu or cuda: measured), in one line; None when it
    can. The one statement of
    the rule: such a rank is simulated only (meta tensors), as measured on cpu or cuda it would be one
    unsharded GPU."""
    given = [f"--{name} {value}" for name, value in (("gpus", gpus), ("sp", sp), ("shard", shard))
             if value not in (None, 1, "none")]
    if device not in ("cpu", "cuda") or not given:
        return None
    return (f"{' '.join(given)}: one rank of N GPUs is simulated only (on meta tensors); it does not apply "
            f"to --device {device}: use --device sim")
