"""What `streambp-bench reproduce ITEM` runs: one function per paper item, each writing `<item>.csv` (+ PNG).

Memory items (fig3, fig5 memory, table3) are simulated on meta tensors everywhere (80 GiB, the paper's
A800); time items (table1, fig5 time) need a GPU: on CUDA they measure Qwen3-4B, on a CPU they measure a
tiny model's step time instead (a streambp/checkpoint ratio, not the paper's seconds). `quick` swaps in
tiny models, budgets and lengths so the tests can drive every item in seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from streambp_bench import experiments as exp
from streambp_bench import paper, plots
from streambp_bench.precision import precision_rows
from streambp_bench.results import ResultRow, ResultsFile, provenance, rows_to_frame
from streambp_core.config import StepSpec
from streambp_core.measure.units import GIB
from streambp_core.step.resolved import ResolvedModel
from streambp_core.step.target import DEFAULT_BUDGET_GIB, Target, resolve_target

FIG3_METHODS = ("plain", "checkpoint", "streambp")


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
    from streambp_bench.max_len_report import max_len_row as row_of
    from streambp_core.step.probe import max_len

    note(f"max length: {spec.method} {spec.model}" + (f" LoRA r{spec.lora_rank}" if spec.lora_rank else "")
         + ("" if spec.objective == "sft" else f" {spec.objective}"))

    search = max_len(spec, int(budget_gib * GIB), "sim", model)
    return row_of(spec, search, provenance("simulated", "meta"))


def max_len_rows(specs: Sequence[StepSpec], settings: Settings) -> list[ResultRow]:
    """`max_len_row` of each spec at the item's budget, in the order given (started costliest first, as
    `max-len` starts them): side by side on the settings' workers when it has them (each worker with its
    own memo: the memo changes no figure), else here one after another sharing each model's memo (each
    model resolved once). Their progress reaches `settings.note`."""
    from streambp_bench.max_len import SEARCH_COST
    from streambp_bench.workers import Task, run_tasks

    models = {name: ResolvedModel(name) for name in dict.fromkeys(spec.model for spec in specs)}
    tasks = [Task(spec.method, max_len_row, (spec, settings.budget_gib(), models[spec.model]),
                  SEARCH_COST.get(spec.method, 0)) for spec in specs]
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
            rows = exp.run_point(point, target)
            results.append_many(rows)
            if rows[0].status != "ok":
                break


def fig3(settings: Settings) -> list[Path]:
    """Fig. 3: BP-only max length (simulated search) and memory-vs-length curves, plain/ckpt/streambp."""
    models = {"tiny": ("tiny/llama", 0)} if settings.quick else paper.FIG3_MODELS
    lengths = (64, 256, 1024) if settings.quick else (1024, 2048, *range(4096, 131072 + 1, 8192))
    results, budget = settings.csv("fig3"), settings.budget_gib()
    sizes = {"partition_size": 32, "head_partition_size": 16} if settings.quick else {}
    rows = max_len_rows([StepSpec.of(model=model, method=method, lora_rank=rank, **sizes)
                         for model, rank in models.values() for method in FIG3_METHODS], settings)
    results.append_many(rows)
    target = resolve_target("sim", budget)
    points = [
        StepSpec.of(method=method, model=model, seq_len_tokens=length, lora_rank=rank, **sizes)
        for model, rank in models.values()
        for method in FIG3_METHODS
        for length in lengths
    ]
    memory_curve(points, target, results, settings)
    frame = results.load()
    paper_frame = pd.DataFrame(
        [
            {
                "model": models[label][0],
                "lora_rank": models[label][1] or None,
                "method": method,
                "value": k * 1000,
            }
            for label, values in paper.FIG3_MAX_LEN_K.items()
            if label in models
            for method, k in values.items()
        ]
    )
    return [
        plots.save(plots.memory_vs_length(frame), settings.out_dir / "fig3-memory.png"),
        plots.save(
            plots.max_length_bars(frame, paper_frame if len(paper_frame) else None),
            settings.out_dir / "fig3-maxlen.png",
        ),
    ]


def fig5(settings: Settings) -> list[Path]:
    """Fig. 5 memory: streambp on Qwen3-8B at layer partitions 500/1k/2k/5k (simulated)."""
    model = "tiny/llama" if settings.quick else "Qwen/Qwen3-8B"
    sizes = (16, 32) if settings.quick else paper.FIG5_PARTITION_SIZES
    lengths = (64, 128) if settings.quick else (4096, *range(16384, 131072 + 1, 16384))
    results = settings.csv("fig5")
    target = resolve_target("sim", settings.budget_gib() if settings.quick else None)
    points = exp.expand_grid(
        methods=("streambp",),
        models=(model,),
        seq_lens=lengths,
        partition_sizes=sizes,
        head_partition_size=16 if settings.quick else 100,
    )
    exp.run_points(points, target, results, force=True, on_point=settings.on_point)
    return [plots.save(plots.partition_ablation(results.load()), settings.out_dir / "fig5-memory.png")]


def table1(settings: Settings) -> list[Path]:
    """Table 1 step time: Qwen3-4B on CUDA (paper lengths, capped), else a tiny model on the CPU."""
    if settings.device == "cuda":
        model, dtype, lengths, methods = "Qwen/Qwen3-4B", "bfloat16", (6144, 9216, 12288), paper.TABLE1_TIME_S
        target = resolve_target("cuda")
    else:
        model, dtype, methods = "tiny/llama", "float32", ("checkpoint", "streambp")
        lengths = (64, 128) if settings.quick else (1024, 2048, 4096)
        target = resolve_target("cpu", cpu_budget=False)
    points = [
        StepSpec.of(method=method, model=model, seq_len_tokens=length, dtype=dtype,
                    partition_size=max(length // 3, 1), head_partition_size=100)
        for method in methods
        for length in lengths
    ]
    results = settings.csv("table1")
    exp.run_points(points, target, results, force=True, on_point=settings.on_point)
    frame = results.load().assign(partition_size=pd.NA)  # ps = T/3 varies with T: one line per method
    return [plots.save(plots.time_vs_length(frame), settings.out_dir / "table1-time.png")]


def table3(settings: Settings) -> list[Path]:
    """Table 3: simulated max length with AdamW for SFT, GRPO (group 8) and DPO on the paper's cells, under
    the trl protocol (the baselines' GRPO and DPO losses as TRL 0.17's trainers, which the paper ran)."""
    cells = (
        {"tiny full": ("tiny/llama", 0), "tiny LoRA": ("tiny/llama", 4)}
        if settings.quick
        else paper.TABLE3_CELLS
    )
    sizes = {"partition_size": 32, "head_partition_size": 16} if settings.quick else {}
    group = 2 if settings.quick else paper.TABLE3_GROUP_SIZE
    results = settings.csv("table3")
    specs = [StepSpec.of(model=model, method=method, objective=objective, lora_rank=rank, optimizer="adamw",
                         batch_size=batch, protocol="trl", **sizes)
             for objective, batch in (("sft", 1), ("grpo", group), ("dpo", 1))
             for model, rank in cells.values()
             for method in FIG3_METHODS]
    results.append_many(max_len_rows(specs, settings))
    frame = results.load()
    paper_frame = pd.DataFrame(
        [
            {
                "model": cells[cell][0],
                "lora_rank": cells[cell][1] or None,
                "objective": objective,
                "optimizer": "adamw",
                "method": method,
                "value": k * 1000,
            }
            for (objective, method, cell), k in paper.TABLE3_MAX_LEN_K.items()
            if k and cell in cells
        ]
    )
    written = []
    for objective in ("sft", "grpo", "dpo"):
        part = frame[frame["objective"] == objective]
        fig = plots.max_length_bars(part, paper_frame if len(paper_frame) else None)
        written.append(plots.save(fig, settings.out_dir / f"table3-{objective}.png"))
    return written


def offload(settings: Settings) -> list[Path]:
    """Every method with and without offloaded checkpoints: max lengths and memory curves (simulated;
    `offload_item`)."""
    from streambp_bench import offload_item

    return offload_item.run(settings)


def table6(settings: Settings) -> list[Path]:
    """Table 6: gradient precision of streambp vs references (see `precision.precision_rows`)."""
    rows = precision_rows("tiny/llama", seq_len=128 if settings.quick else 1024, partition_size=100)
    results = settings.csv("table6")
    results.append_many(rows)
    return [results.path]


def table4(settings: Settings) -> list[Path]:
    """Table 4: simulated max length per rank across GPUs (see `streambp_bench.table4`)."""
    from streambp_bench.table4 import run

    return run(settings)


ITEMS: dict[str, Callable[[Settings], list[Path]]] = {
    "fig3": fig3,
    "fig5": fig5,
    "table1": table1,
    "table3": table3,
    "table4": table4,
    "table6": table6,
    "offload": offload,
}
"""Every item."""


def frame_of(path: Path) -> pd.DataFrame | None:
    """The rows of a results CSV, or None when it does not exist."""
    return rows_to_frame(ResultsFile(path).rows()) if path.exists() else None
