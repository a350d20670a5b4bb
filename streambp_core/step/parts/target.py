"""Where steps run and what they must fit in: the device (sim, cpu, cuda), its name and the budget."""

from __future__ import annotations

import platform
from dataclasses import dataclass

from streambp_core.config import DEVICES, SOURCES, ConfigError, check_budget_gib, require_choice
from streambp_core.measure.cuda import cuda_available, device_info
from streambp_core.measure.units import GIB

DEFAULT_BUDGET_GIB = 80.0
"""Budget without a GPU to take it from (the paper's A800-80GB)."""


@dataclass(frozen=True, kw_only=True)
class Target:
    """Resolved device ('sim', 'cpu' or 'cuda'), its name, and the memory budget in GiB (None: none)."""

    device: str
    device_name: str
    budget_gib: float | None

    @property
    def source(self) -> str:
        """How figures from this device are obtained: simulated, measured-cpu or measured-cuda."""
        return SOURCES[self.device]

    @property
    def budget_bytes(self) -> int | None:
        return None if self.budget_gib is None else int(self.budget_gib * GIB)


def resolve_target(device: str, budget_gib: float | None = None, *, cpu_budget: bool = True) -> Target:
    """'auto' -> cuda when present, else sim; the device's name; the budget: as given, else the GPU's
    memory, else `DEFAULT_BUDGET_GIB` (on cpu only when `cpu_budget`, else no budget)."""
    require_choice("device", device, ("auto", *DEVICES))
    check_budget_gib(budget_gib)
    if device == "auto":
        device = "cuda" if cuda_available() else "sim"
    if device == "cuda":
        if not cuda_available():
            raise ConfigError("--device cuda: no CUDA device is available; use --device sim to simulate")
        info = device_info()
        return Target(device="cuda", device_name=info.name, budget_gib=budget_gib or info.total_gib)
    if device == "cpu":
        budget = budget_gib if budget_gib is not None or not cpu_budget else DEFAULT_BUDGET_GIB
        return Target(device="cpu", device_name=platform.processor() or platform.machine(), budget_gib=budget)
    return Target(device="sim", device_name="meta", budget_gib=budget_gib or DEFAULT_BUDGET_GIB)
