"""`reproduce offload`, host tiers: full fine-tuning with AdamW on one GPU, each method with each tier set,
beside Arctic Long Sequence Training's published single-GPU lengths; its README part.

- Max length (simulated search, confirmed at full depth) of Llama-3.1-8B and Qwen3-8B, full parameters,
  AdamW (its moments resident, gradients made by the step), bf16, batch 1, SFT, ps 500, ps-head 100, on
  one H100 80GB and one H200 141GB (the devices' whole memory in GiB, as nvidia-smi reports it), for
  every method and every tier set a step with an optimizer can run (params needs the optimizer tier;
  plain takes the optimizer tier only).
- The host memory each answer needs (the host pool's peak at the max length) is reported, not bounded.
- ALST's recipe is mst with every tier (tiled MLP, tiled loss, checkpoint offload, ZeRO-3 weight and
  optimizer offload); its published lengths: 500k tokens on one H100, 1.2M on one H200 (arXiv
  2506.13996). The tiers here are this project's own (`streambp_core.tiers`); DeepSpeed's ZeRO-3 offload
  engine is not run.
Rows go to one CSV per GPU, `offload-tiers-h100.csv` and `offload-tiers-h200.csv` (`offload-tiers-tiny.csv`
when quick): a row's key holds no budget, so two GPUs' rows of one step would replace each other.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd

from streambp_bench.paper.prose import prose
from streambp_bench.paper.shared import Settings, frame_of, max_len_row
from streambp_bench.specs import spec_label
from streambp_core.config import METHODS, StepSpec
from streambp_core.step.parts.resolved import ResolvedModel
from streambp_core.tiers import ALL_TIERS, OFFLOAD_MODES, Tiers, tier_problem

GPUS_GIB = {"H100 80GB": 81_559 / 1024, "H200 141GB": 143_771 / 1024}
"""Each GPU's whole memory in GiB (nvidia-smi's MiB totals: 81,559 and 143,771)."""
QUICK_GPUS_GIB = {"tiny budget": 0.005}
CSV_NAMES = {"H100 80GB": "offload-tiers-h100", "H200 141GB": "offload-tiers-h200",
             "tiny budget": "offload-tiers-tiny"}
"""The CSV (item name) of each GPU's rows."""
MODELS = ("meta-llama/Llama-3.1-8B", "Qwen/Qwen3-8B")
TIER_SETS = ("none", "checkpoints", "optimizer", "checkpoints,optimizer", "optimizer,params", ALL_TIERS)
"""Every tier set a step with an optimizer can run (`tiers.tier_problem`)."""
QUICK_TIER_SETS = ("none", "optimizer", ALL_TIERS)
ALST_TOKENS = {("meta-llama/Llama-3.1-8B", "H100 80GB"): 500_000,
               ("meta-llama/Llama-3.1-8B", "H200 141GB"): 1_200_000}
"""ALST's published single-GPU lengths (tokens)."""
TARGETS = {"H100 80GB": 2_000_000, "H200 141GB": 4_000_000}
"""streambp with every tier on Llama-3.1-8B: the length to reach per GPU."""
ALST_TOLERANCE = 0.25
"""The simulated ALST recipe should land within this fraction of ALST's published length."""


def cells(quick: bool) -> list[tuple[StepSpec, float]]:
    """(spec, budget GiB) of every cell: model x GPU x method x tier set (tiny ones when `quick`)."""
    models = ("tiny/llama",) if quick else MODELS
    sizes = {"partition_size": 32, "head_partition_size": 16} if quick else {}
    gpus, tier_sets = (QUICK_GPUS_GIB, QUICK_TIER_SETS) if quick else (GPUS_GIB, TIER_SETS)
    return [(StepSpec.of(model=model, method=method, optimizer="adamw", offload=tiers, **sizes), budget)
            for model in models for budget in gpus.values() for method in METHODS for tiers in tier_sets
            if tier_problem(method, Tiers.of(tiers), "adamw") is None]


def run(settings: Settings, select: Callable[[StepSpec], bool] | None = None) -> None:
    """Search every cell (side by side on the settings' workers) and write each GPU's CSV; `select`: only
    the cells whose spec it accepts, their rows replacing the same cells' rows in the CSVs (the others
    stay as they are), to rerun the cells a change touches."""
    from streambp_bench.workers import Task, run_tasks
    from streambp_core.registry import method_class

    grid = [(spec, budget) for spec, budget in cells(settings.quick) if select is None or select(spec)]
    models = {name: ResolvedModel(name) for name in dict.fromkeys(spec.model for spec, _ in grid)}
    tasks = [Task(spec_label(spec), max_len_row, (spec, budget, models[spec.model]),
                  method_class(spec.method).search_cost + max(0, len(spec.offload.names) - 1))
             for spec, budget in grid]
    rows = run_tasks(tasks, settings.jobs, settings.context, settings.note)
    for name in {CSV_NAMES[_gpu(budget)] for _, budget in grid}:
        settings.csv(name).append_many(row for row in rows if CSV_NAMES[_gpu(row.budget_gib)] == name)


def _gpu(budget_gib: float) -> str:
    names = {**GPUS_GIB, **QUICK_GPUS_GIB}
    return min(names, key=lambda name: abs(names[name] - budget_gib))


def readme_lines(out_dir: Path) -> list[str]:
    """The README section of every GPU's CSV in `out_dir` together (none when there is none)."""
    frames = [frame for name in CSV_NAMES.values()
              if (frame := frame_of(out_dir / f"{name}.csv")) is not None and len(frame)]
    return section(pd.concat(frames, ignore_index=True)) if frames else []


def refused(methods: tuple[str, ...] = METHODS) -> list[tuple[tuple[str, ...], Tiers, str]]:
    """(methods, tier set, why) of every tier set some of `methods` cannot run with AdamW, as
    `tiers.tier_problem` refuses it (so does `max-len`): the grid's cells not run, the methods sharing
    one reason together."""
    grouped: dict[tuple[Tiers, str], list[str]] = {}
    for tiers in map(Tiers.of, OFFLOAD_MODES):
        for method in methods:
            if (problem := tier_problem(method, tiers, "adamw")) is not None:
                grouped.setdefault((tiers, problem), []).append(method)
    return [(tuple(names), tiers, why) for (tiers, why), names in grouped.items()]


def section(frame: pd.DataFrame) -> list[str]:
    """The README section: max length per model, GPU, method and tier set (in the grid's order), host GiB
    needed, the ratio to ALST's published length; the cells refused by name; the targets."""
    data = frame[frame["metric"] == "max_len"].assign(gpu=lambda f: f["budget_gib"].map(_gpu))
    gpus = " or one ".join(sorted(set(data["gpu"])))
    lines = [f"## Host tiers — full fine-tuning with AdamW on one {gpus} (simulated)", "",
             prose("host-tiers-protocol"), "",
             "| model | GPU | method | tiers | max length | device GiB | host GiB | "
             "copied GiB to host / to device | x ALST |", "|---|---|---|---|---|---|---|---|---|"]
    for _, row in sorted(data.iterrows(), key=lambda item: _grid_order(item[1])):
        alst = ALST_TOKENS.get((row["model"], row["gpu"]))
        ratio = "–" if alst is None else f"{row['value'] / alst:.2f}"
        lines.append(f"| {row['model']} | {row['gpu']} | {row['method']} | {row['offload']} | "
                     f"{row['value']:,.0f} | {_gib(row['peak_allocated_gib'])} | "
                     f"{_gib(row['host_peak_gib'])} | "
                     f"{_gib(row['to_host_gib'])} / {_gib(row['to_device_gib'])} | "
                     f"{ratio} |")
    refusals = [f"- {', '.join(names)} + offload {tiers}: {why}"
                for names, tiers, why in refused(tuple(m for m in METHODS if m in set(data["method"])))]
    if refusals:
        lines += ["", "Not run (refused by name, as `max-len --offload` refuses them):", "", *refusals]
    targets = _target_lines(data)
    return [*lines, "", *targets, *([""] if targets else [])]


def _grid_order(row: pd.Series) -> tuple:
    """A row's place: model, GPU budget, method and tier set in the grid's order."""
    models = [*MODELS, row["model"]]
    tiers = [*TIER_SETS, *QUICK_TIER_SETS, row["offload"]]
    methods = [*METHODS, row["method"]]
    return (models.index(row["model"]), row["budget_gib"], methods.index(row["method"]),
            tiers.index(row["offload"]))


def _target_lines(data: pd.DataFrame) -> list[str]:
    """Whether streambp with every tier reaches its lengths, and the ALST recipe lands near ALST's."""
    lines = ["Targets (Llama-3.1-8B, every tier):", ""]
    every = data[(data["model"] == MODELS[0]) & (data["offload"] == ALL_TIERS)]
    for gpu, tokens in TARGETS.items():
        found = every.loc[(every["gpu"] == gpu) & (every["method"] == "streambp"), "value"]
        if len(found):
            lines.append(f"- streambp on one {gpu}: {found.iloc[0]:,.0f} tokens (target >= {tokens:,}: "
                         f"{'met' if found.iloc[0] >= tokens else 'not met'})")
        alst = ALST_TOKENS[(MODELS[0], gpu)]
        recipe = every.loc[(every["gpu"] == gpu) & (every["method"] == "mst")]
        if len(recipe):
            ratio = recipe["value"].iloc[0] / alst
            lines.append(f"- ALST recipe (mst + every tier) on one {gpu}: {recipe['value'].iloc[0]:,.0f} "
                         f"tokens, {ratio:.2f}x ALST's {alst:,} (within ±{ALST_TOLERANCE:.0%}: "
                         f"{'yes' if abs(ratio - 1) <= ALST_TOLERANCE else 'no'})")
    return lines if len(lines) > 2 else []


def _gib(value: float) -> str:
    return "–" if pd.isna(value) else f"{value:.1f}"
