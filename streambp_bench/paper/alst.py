"""`reproduce alst`: Arctic Long Sequence Training's ladder for Llama-3.1-8B, simulated for its recipe and
for StreamBP under the same protocol, beside ALST's published lengths; its figure and README part.

- Cells (arXiv 2506.13996, Llama-3.1-8B, bf16, batch 1, SFT, AdamW): one H100 80GB and one H200 141GB
  under its single-GPU protocol (weights and optimizer on the host, tiled MLP and loss, checkpoint
  offload: `--offload checkpoints,optimizer,params`), and 8, 16 and 32 H100s under its multi-GPU one
  (Ulysses SP = GPUs, ZeRO-3, optimizer on the host, the same tiling and checkpoint offload:
  `--gpus N --sp N --shard zero3 --offload checkpoints,optimizer`).
- Each cell for the ALST recipe (mst: tiled MLP + tiled loss, with every tier of its protocol) and for
  streambp, a max-length search (simulated, confirmed at full depth) bounded by the device (the GPU's
  whole memory in GiB, as `host_tiers.GPUS_GIB`) and by the host: 1.9 TB per node (the machine ALST ran
  on), each rank's share 1/8 of it on 8-GPU nodes, the whole of it for one GPU.
- Each cell's estimated step time at its max length (`step.estimate.sequence_time.estimate_sequence_step`: the
  roofline of the rank's step as it runs, all-to-alls at NVLink and InfiniBand datasheet bandwidths) is a
  `step_time` row of the same cell.
Rows go to `alst.csv`, the figure (max length vs GPUs, log scale) to `alst-maxlen.png`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from streambp_bench.paper import plots
from streambp_bench.paper.host_tiers import GPUS_GIB
from streambp_bench.paper.prose import prose
from streambp_bench.paper.shared import Settings, k_tokens, print_nothing
from streambp_core.config import StepSpec
from streambp_core.measure.units import GIB
from streambp_core.tiers import ALL_TIERS

MODEL = "meta-llama/Llama-3.1-8B"
METHODS = ("mst", "streambp")
HOST_NODE_GIB = 1.9e12 / GIB
"""ALST's nodes: 1.9 TB of host memory each (1,769.5 GiB)."""
GPUS_PER_NODE = 8
MULTI_GPU_TIERS = "checkpoints,optimizer"
CELLS = (("H100 80GB", 1), ("H200 141GB", 1), ("H100 80GB", 8), ("H100 80GB", 16), ("H100 80GB", 32))
"""(GPU, GPUs) of every cell of ALST's ladder."""
PUBLISHED = {("H100 80GB", 1): 500_000, ("H200 141GB", 1): 1_200_000, ("H100 80GB", 8): 3_700_000,
             ("H100 80GB", 16): 8_000_000, ("H100 80GB", 32): 15_000_000}
"""ALST's published max lengths (tokens) per cell."""
STREAMBP_TARGETS = {8: 6_500_000, 32: 25_000_000}
"""streambp on N H100s: the length to reach."""
ALST_TOLERANCE = 0.25
"""The simulated ALST recipe on 8 H100s should land within this fraction of ALST's 3.7M."""
QUICK = {"model": "tiny/llama", "budget_gib": 0.01, "host_node_gib": 0.5, "cells": (("tiny", 1), ("tiny", 2))}


def cell_spec(method: str, gpus: int, model: str = MODEL, **sizes: int) -> StepSpec:
    """The step of one cell: ALST's single-GPU protocol on one GPU, its multi-GPU protocol on more."""
    if gpus == 1:
        return StepSpec.of(model=model, method=method, optimizer="adamw", offload=ALL_TIERS, **sizes)
    return StepSpec.of(model=model, method=method, optimizer="adamw", offload=MULTI_GPU_TIERS, gpus=gpus,
                       sp=gpus, shard="zero3", **sizes)


def host_share_gib(gpus: int, node_gib: float = HOST_NODE_GIB) -> float:
    """One rank's share of a node's host memory: the node's 1/min(8, gpus)."""
    return node_gib / min(gpus, GPUS_PER_NODE)


def cells(quick: bool) -> list[tuple[StepSpec, float, float]]:
    """(spec, device budget GiB, host budget GiB of one rank) of every cell and method."""
    if quick:
        sizes = {"partition_size": 32, "head_partition_size": 16}
        return [(cell_spec(method, gpus, QUICK["model"], **sizes), QUICK["budget_gib"],
                 host_share_gib(gpus, QUICK["host_node_gib"]))
                for _, gpus in QUICK["cells"] for method in METHODS]
    return [(cell_spec(method, gpus), GPUS_GIB[gpu], host_share_gib(gpus))
            for gpu, gpus in CELLS for method in METHODS]


def simulated_device(gpu: str) -> str:
    """The device_name of a cell's simulated row: the meta device, at `gpu`'s budget (a row's key holds no
    budget, so one H100's and one H200's rows of the same step would otherwise replace each other)."""
    return f"meta ({gpu} budget)"


def cell_rows(spec: StepSpec, budget_gib: float, host_gib: float, model=None, estimate: bool = True,
              note=print_nothing) -> list:
    """The max_len row of one cell (simulated search bounded by both pools) and, with `estimate`, the
    step_time row estimated at that length on the cell's GPU."""
    from streambp_bench.maxlen.report import max_len_row
    from streambp_bench.results import ResultRow, provenance, spec_fields
    from streambp_core.step.estimate.roofline import gpu_model
    from streambp_core.step.estimate.sequence_time import estimate_sequence_step
    from streambp_core.step.search.probe import max_len

    note(f"max length: {spec.method} on {spec.gpus} GPU(s)")
    search = max_len(spec, int(budget_gib * GIB), "sim", model, host_budget_bytes=int(host_gib * GIB))
    gpu = _gpu(budget_gib)
    rows = [max_len_row(spec, search, provenance("simulated", simulated_device(gpu)))]
    if estimate and search.max_len_tokens >= 2:
        note(f"step time: {spec.method} on {spec.gpus} GPU(s)")
        at, device = spec.at(search.max_len_tokens), gpu_model(gpu.split()[0].lower())
        step = estimate_sequence_step(at, device, model)  # any sp, 1 too
        rows.append(ResultRow(**spec_fields(at), **provenance("estimated", device.name),
                              metric="step_time", value=step.step_time_ms, budget_gib=budget_gib))
    return rows


def run(settings: Settings) -> list[Path]:
    """Search every cell (side by side on the settings' workers), write the CSV and the figure."""
    from streambp_bench.workers import Task, run_tasks
    from streambp_core.registry import method_class
    from streambp_core.step.parts.resolved import ResolvedModel

    grid = cells(settings.quick)
    model = ResolvedModel(grid[0][0].model)
    tasks = [Task(f"{spec.method} x{spec.gpus}", cell_rows, (spec, budget, host, model, not settings.quick),
                  method_class(spec.method).search_cost + spec.gpus) for spec, budget, host in grid]
    found = run_tasks(tasks, settings.jobs, settings.context, settings.note)
    results = settings.csv("alst")
    new_rows = [row for rows in found for row in rows]
    results.replace_many(new_rows, _stale_estimate(new_rows))
    return [plots.save(figure(results.load()), settings.out_dir / "alst-maxlen.png")]


def _stale_estimate(new_rows: list) -> Callable[[object], bool]:
    """Whether a row on file is a step-time estimate of a re-run cell (same model, method, GPUs, GPU) at
    another length: the cell's search moved, so its old estimate answers nothing the README shows."""
    cells_run = {_estimate_cell(row) for row in new_rows if row.metric == "step_time"}
    return lambda row: row.metric == "step_time" and _estimate_cell(row) in cells_run


def _estimate_cell(row) -> tuple:
    return row.model, row.method, row.gpus, row.sp, row.device_name, row.offload, row.shard


def _gpu(budget_gib: float) -> str:
    """The cell's GPU from its budget (nearest of `GPUS_GIB`; "tiny" for a quick run's)."""
    if budget_gib < 1:
        return "tiny"
    return min(GPUS_GIB, key=lambda name: abs(GPUS_GIB[name] - budget_gib))


def _lengths(frame: pd.DataFrame) -> pd.DataFrame:
    """max_len rows with their GPU named, one per (gpus, GPU, method)."""
    data = frame[frame["metric"] == "max_len"].copy()
    data["gpu"] = data["budget_gib"].map(_gpu)
    return data.sort_values(["gpus", "gpu", "method"])


def figure(frame: pd.DataFrame) -> Figure:
    """Max length (M tokens, log) vs GPUs (log 2): ALST's published lengths, its recipe and streambp
    simulated; H100 lines, the one-GPU H200 cells as separate markers."""
    data = _lengths(frame)
    fig = Figure(figsize=(6.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels = {"mst": "ALST recipe (mst + offload), simulated", "streambp": "streambp, simulated"}
    for method, label in labels.items():
        rows = data[(data["method"] == method) & (data["gpu"] != "H200 141GB")]
        ax.plot(rows["gpus"], rows["value"] / 1e6, "o-", color=plots.METHOD_COLORS[method], label=label)
        h200 = data[(data["method"] == method) & (data["gpu"] == "H200 141GB")]
        ax.plot(h200["gpus"], h200["value"] / 1e6, "s", color=plots.METHOD_COLORS[method], fillstyle="none",
                label=f"{method}, one H200 (simulated)" if len(h200) else None)
    published = [(gpus, tokens) for (gpu, gpus), tokens in PUBLISHED.items() if gpu == "H100 80GB"]
    if not data.empty and data["model"].iloc[0] == MODEL:
        gpus, tokens = zip(*published, strict=True)
        ax.plot(gpus, [t / 1e6 for t in tokens], "k^--", label="ALST published (H100)")
        ax.plot([1], [PUBLISHED[("H200 141GB", 1)] / 1e6], "kv", label="ALST published (H200)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs (Ulysses SP = GPUs beyond one)")
    ax.set_ylabel("max sequence length (M tokens, M = 10^6)")
    ax.set_title(f"{data['model'].iloc[0] if len(data) else MODEL}: max length vs GPUs (simulated)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def section(frame: pd.DataFrame) -> list[str]:
    """The README part: every cell beside ALST's published length, the step times, the targets."""
    data = _lengths(frame)
    times = frame[frame["metric"] == "step_time"]
    lines = ["## ALST's ladder — Llama-3.1-8B, one to 32 GPUs (simulated)", "",
             prose("alst-protocol", host_gib=HOST_NODE_GIB, share_gib=host_share_gib(GPUS_PER_NODE)), "",
             "| GPUs | GPU | method | max length | device GiB | host GiB (one rank) | est. step | ALST |",
             "|---|---|---|---|---|---|---|---|"]
    for _, row in data.iterrows():
        published = PUBLISHED.get((row["gpu"], row["gpus"]))
        label = "ALST recipe (mst + offload)" if row["method"] == "mst" else "streambp + offload"
        lines.append(f"| {row['gpus']} | {row['gpu']} | {label} | {k_tokens(row['value'])} | "
                     f"{row['peak_allocated_gib']:.1f} | {row['host_peak_gib']:.1f} | "
                     f"{_step(times, row)} | {'' if published is None else k_tokens(published)} |")
    return [*lines, "", *_target_lines(data), "", prose("alst-differences"), ""]


def _step(times: pd.DataFrame, row: pd.Series) -> str:
    """The estimated step time of a max_len row's cell at its length ('–' when none)."""
    match = times[(times["method"] == row["method"]) & (times["gpus"] == row["gpus"])
                  & (times["seq_len_tokens"] == row["value"]) & (times["budget_gib"] == row["budget_gib"])]
    if match.empty:
        return "–"
    seconds = match["value"].iloc[0] / 1e3
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds:,.0f} s"


def _target_lines(data: pd.DataFrame) -> list[str]:
    """Whether the ALST recipe lands near 3.7M on 8 H100s and streambp reaches its lengths."""
    h100 = data[data["gpu"] == "H100 80GB"]
    lines = []
    recipe = h100[(h100["method"] == "mst") & (h100["gpus"] == 8)]
    if len(recipe):
        ratio = recipe["value"].iloc[0] / PUBLISHED[("H100 80GB", 8)]
        within = "yes" if abs(ratio - 1) <= ALST_TOLERANCE else "no"
        lines.append(f"- ALST recipe on 8 H100s: {recipe['value'].iloc[0]:,.0f} tokens, {ratio:.2f}x ALST's "
                     f"3,700,000 (within ±{ALST_TOLERANCE:.0%}: {within})")
    for gpus, tokens in STREAMBP_TARGETS.items():
        found = h100.loc[(h100["method"] == "streambp") & (h100["gpus"] == gpus), "value"]
        if len(found):
            lines.append(f"- streambp on {gpus} H100s: {found.iloc[0]:,.0f} tokens (target >= {tokens:,}: "
                         f"{'met' if found.iloc[0] >= tokens else 'not met'})")
    return ["Targets:", "", *lines] if lines else []
