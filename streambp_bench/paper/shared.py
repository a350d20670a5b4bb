"""What the paper's items share: their settings, max-length rows searched side by side, memory curves
that stop at the first OOM, reading an item's CSV, and how a README cell writes a length.

Memory items (fig3, fig5 memory, table3, table4, offload) are simulated on meta tensors everywhere (80
GiB, the paper's A800); time items (table1) need a GPU: on CUDA they measure Qwen3-4B, on a CPU they
measure a tiny model's step time instead (a streambp/checkpoint ratio, not the paper's seconds). `quick`
swaps in tiny models, budgets and lengths so the tests can drive every item in seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from streambp_bench.results import ResultRow, ResultsFile, provenance, rows_to_frame
from streambp_bench.sweep import grid
from streambp_core.config import StepSpec
from streambp_core.measure.units import GIB
from streambp_core.step.parts.resolved import ResolvedModel
from streambp_core.step.parts.target import DEFAULT_BUDGET_GIB, Target

METHODS = ("plain", "checkpoint", "streambp")
"""The methods of Fig. 3 and Table 3."""


def print_nothing(_text: str) -> None:
    """The default `Settings.note`: no progress display."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Where results go, whether to run the tiny variants, and the resolved device for measured items."""

    out_dir: Path
    quick: bool = False
    device: str = "sim"
    """'cuda' when a GPU is present, else 'sim' (time items then measure on the CPU)."""
    note: Callable[[str], None] = print_nothing
    """Hears what an item runs now (a point, a search), for a progress display."""
    jobs: int = 1
    """Worker processes for an item's independent max-length searches (`max_len_rows`)."""
    context: Any = None
    """The fork-server context of those workers (`workers.start_server`); None: searches run here."""

    def on_point(self, point: StepSpec, rows: object = None) -> None:
        """`note` a point (a `run_points` callback)."""
        self.note(f"{point.method} {point.model} T={point.seq_len_tokens:,}"
                  + (f" ps={point.stream.partition_size}" if point.partitioned else ""))

    def budget_gib(self) -> float:
        return 0.005 if self.quick else DEFAULT_BUDGET_GIB

    def csv(self, item: str) -> ResultsFile:
        return ResultsFile(self.out_dir / f"{item}.csv")


def max_len_row(spec: StepSpec, budget_gib: float, model: ResolvedModel | None = None,
                note: Callable[[str], None] = print_nothing) -> ResultRow:
    """Search the simulated max length of `spec` within `budget_gib` (confirmed at full depth) and return
    it as a max_len row; `model`: the spec's model resolved once (None: resolved here)."""
    from streambp_bench.maxlen.report import max_len_row as row_of
    from streambp_core.step.search.probe import max_len

    note(f"max length: {spec.method} {spec.model}" + (f" LoRA r{spec.lora_rank}" if spec.lora_rank else "")
         + ("" if spec.objective == "sft" else f" {spec.objective}"))

    search = max_len(spec, int(budget_gib * GIB), "sim", model)
    return row_of(spec, search, provenance("simulated", "meta"))


def max_len_rows(specs: Sequence[StepSpec], settings: Settings) -> list[ResultRow]:
    """`max_len_row` of each spec at the item's budget, in the order given (started costliest first, as
    `max-len` starts them): side by side on the settings' workers when it has them (each worker with its
    own memo: the memo changes no figure), else here one after another sharing each model's memo (each
    model resolved once). Their progress reaches `settings.note`."""
    from streambp_bench.workers import Task, run_tasks
    from streambp_core.registry import method_class

    models = {name: ResolvedModel(name) for name in dict.fromkeys(spec.model for spec in specs)}
    tasks = [Task(spec.method, max_len_row, (spec, settings.budget_gib(), models[spec.model]),
                  method_class(spec.method).search_cost) for spec in specs]
    return run_tasks(tasks, settings.jobs, settings.context, settings.note)


def memory_curve(points: list[StepSpec], target: Target, results: ResultsFile,
                 settings: Settings | None = None) -> None:
    """Run each (method, model, ps) series in increasing length, stopping after its first OOM."""
    series: dict[tuple, list[StepSpec]] = {}
    for point in points:
        key = (point.method, point.model, point.stream.partition_size, point.lora_rank, point.stream.offload)
        series.setdefault(key, []).append(point)
    for members in series.values():
        for point in sorted(members, key=lambda p: p.seq_len_tokens):
            if settings is not None:
                settings.on_point(point)
            rows = grid.run_point(point, target)
            results.append_many(rows)
            if rows[0].status != "ok":
                break


def frame_of(path: Path) -> pd.DataFrame | None:
    """The rows of a results CSV, or None when it does not exist."""
    return rows_to_frame(ResultsFile(path).rows()) if path.exists() else None


def k_tokens(tokens: float | None) -> str:
    """A length as a README cell writes it: thousands of tokens (k = 1000), two decimals below 1k; '–'
    when there is none."""
    if tokens is None or pd.isna(tokens):
        return "–"
    return f"{tokens / 1000:.1f}k" if tokens >= 1000 else f"{tokens / 1000:.2f}k"


def sources(rows: pd.DataFrame) -> str:
    """The sources of `rows`' numbers, as a section's heading names them."""
    return ", ".join(sorted(set(rows["source"])))
