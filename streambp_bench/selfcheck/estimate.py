"""How long each item of the GPU plan should take on an H200, estimated from the committed H200 rows.

Basis: `results/gpu/selfcheck-h200.csv`, the one H200 run so far (Qwen3-1.7B, bf16, batch 1):
- a step's time: the measured median step time of checkpoint and streambp at 8k and 16k tokens fitted
  as a * T + b * T^2 (linear layers, and causal attention's quadratic term) per method, so a step at T
  tokens is extrapolated from its own method's rows; plain reads checkpoint's curve less its recompute
  (x 3/4: one forward of four passes), mst streambp's; a model of other size scales with its parameters
  (the linear term) and its layers x query width (the quadratic term);
- fixed costs: the bf16 check's nine rows took 3 s; building a model and starting a process take the
  seconds `OVERHEAD_S` names;
- a simulation on the CPU: `SIM_S` (the committed run simulated its twelve 4k-16k steps in 5 s on the
  H200 host; on a loaded 2-core CPU one simulated Qwen3-1.7B streambp step took 0.9-2.2 s from 16k to
  256k tokens).
Counts of steps per item come from the plan itself (`selfcheck.plan`), so the estimate follows the plan.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from streambp_core.config import ConfigError

COMMITTED_ROWS = Path(__file__).resolve().parents[2] / "results" / "gpu" / "selfcheck-h200.csv"
"""The committed H200 rows the estimate is fitted to (in the checkout this package runs from)."""
FIT_MODEL = "Qwen/Qwen3-1.7B"
FIT_LENGTHS = (8192, 16384)
"""Lengths of the fit: at 4k a step is launch-bound (streambp 522 ms at 4k vs 639 ms at 8k)."""
OVERHEAD_S = {"model": 2.0, "process": 6.0, "pytest": 8.0}
"""Seconds to build a model with random weights on the GPU (the committed run built Qwen3-1.7B and ran a
tracked 4k step in the 2 s between its last bf16 row and its first memory row), to start a process that
imports torch and transformers and makes a CUDA context, and for pytest to start and collect as well
(these two are not in the committed rows: the usual on a 16-core host with a local disk)."""
SIM_S = 1.0
"""Seconds of CPU per simulated step (meta tensors) on the H200 host."""
BUDGET_MINUTES = 8.0
"""What the whole plan may take on an H200."""
PARAMS_B = {"Qwen/Qwen3-0.6B": 0.6, "Qwen/Qwen3-1.7B": 1.7}
"""Parameters (billions) of the plan's models, for scaling the linear term."""
ATTENTION_WIDTH = {"Qwen/Qwen3-0.6B": 28 * 2048, "Qwen/Qwen3-1.7B": 28 * 2048}
"""Layers x query width (heads x head size) of the plan's models, for scaling the quadratic term."""


@dataclass(frozen=True)
class StepCurve:
    """A method's step time on the fit model, a * T + b * T^2 milliseconds."""

    ms_per_token: float
    ms_per_token2: float

    def ms(self, seq_len_tokens: int, model: str = FIT_MODEL) -> float:
        linear = self.ms_per_token * seq_len_tokens * PARAMS_B[model] / PARAMS_B[FIT_MODEL]
        width = ATTENTION_WIDTH[model] / ATTENTION_WIDTH[FIT_MODEL]
        quadratic = self.ms_per_token2 * seq_len_tokens**2 * width
        return linear + quadratic


def fitted_curves(path: Path = COMMITTED_ROWS) -> dict[str, StepCurve]:
    """checkpoint's and streambp's curves fitted to the committed step times (module doc); ConfigError
    when the file is missing or lacks a row of the fit."""
    if not path.is_file():
        raise ConfigError(f"the plan's estimates are fitted to {path}, which is not here (a checkout has it)")
    with path.open(newline="", encoding="utf-8") as handle:
        times = {(row["method"], int(row["seq_len_tokens"])): float(row["value"])
                 for row in csv.DictReader(handle)
                 if row["metric"] == "step_time" and row["model"] == FIT_MODEL}
    curves = {}
    for method in ("checkpoint", "streambp"):
        (t1, t2), (y1, y2) = FIT_LENGTHS, [_time(times, method, t, path) for t in FIT_LENGTHS]
        b = (y2 - y1 * t2 / t1) / (t2 * t2 - t1 * t2)  # y = a t + b t^2 through both points
        curves[method] = StepCurve(ms_per_token=(y1 - b * t1 * t1) / t1, ms_per_token2=b)
    return curves


def _time(times: dict, method: str, seq_len: int, path: Path) -> float:
    if (method, seq_len) not in times:
        raise ConfigError(f"{path} has no {method} step_time row at {seq_len} tokens to fit")
    return times[method, seq_len]


def step_seconds(curves: dict[str, StepCurve], method: str, seq_len_tokens: int, model: str = FIT_MODEL
                 ) -> float:
    """One step's estimated seconds (module doc: plain is checkpoint's curve x 3/4, mst streambp's)."""
    curve = curves["checkpoint" if method in ("plain", "checkpoint") else "streambp"]
    scale = 0.75 if method == "plain" else 1.0
    return scale * curve.ms(seq_len_tokens, model) / 1e3
