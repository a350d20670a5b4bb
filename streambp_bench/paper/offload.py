"""`reproduce offload`: every method with and without checkpoints in host memory; its figure and README part.

- Max length (simulated search, confirmed at full depth) of plain, checkpoint, mst and streambp, each
  without and (but plain) with offload, for Qwen3-8B, Qwen3-14B and Qwen3-32B LoRA r32 at 80 GiB: bf16,
  batch 1, gradients resident, no optimizer, ps 500, ps-head 100 (Fig. 3's protocol).
- Memory vs tokens up to 2M on Qwen3-8B, each series stopping after its first length over the budget:
  device GiB (left axis) and the host pool's GiB (right axis).
Rows go to `offload.csv`; the figure to `offload-memory.png`; `section` writes the README part.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from streambp_bench.paper import host_tiers, plots, published
from streambp_bench.paper.prose import prose
from streambp_bench.paper.shared import Settings, max_len_rows, memory_curve
from streambp_bench.specs import with_offload
from streambp_core.config import METHODS, StepSpec
from streambp_core.step.parts.target import resolve_target

CURVE_TOKENS = (32_000, 64_000, 128_000, 256_000, 512_000, 768_000, 1_000_000, 1_250_000, 1_500_000,
                1_750_000, 2_000_000)
"""Lengths of the memory-vs-tokens curves (Qwen3-8B)."""
CURVE_MODEL = "Qwen/Qwen3-8B"
TARGETS = {("Qwen/Qwen3-8B", None): 1_500_000, ("Qwen/Qwen3-14B", None): 500_000}
"""streambp + offload's length to reach (tokens) per (model, LoRA rank)."""
SLOPE_TARGET_GIB_PER_K = 0.035
"""streambp + offload's device slope to stay under on Qwen3-8B (GiB per 1000 tokens)."""

def _labels(frame: pd.DataFrame) -> pd.Series:
    return frame["method"] + np.where(frame["offload"] == "checkpoints", " + offload", "")


def run(settings: Settings) -> list[Path]:
    """Search every method with and without offload per model, then the memory curves; write CSV + PNG."""
    models = {"tiny": ("tiny/llama", 0)} if settings.quick else published.FIG3_MODELS
    sizes = {"partition_size": 32, "head_partition_size": 16} if settings.quick else {}
    budget, results = settings.budget_gib(), settings.csv("offload")
    specs = with_offload(tuple(StepSpec.of(model=model, method=method, lora_rank=rank, **sizes)
                               for model, rank in models.values() for method in METHODS), "both")
    results.append_many(max_len_rows(specs, settings))
    curve_model = "tiny/llama" if settings.quick else CURVE_MODEL
    lengths = (256, 1024, 4096) if settings.quick else CURVE_TOKENS
    points = [spec.at(length) for spec in specs if spec.model == curve_model for length in lengths]
    memory_curve(points, resolve_target("sim", budget), results, settings)
    host_tiers.run(settings)  # full fine-tuning with every tier set, one CSV per GPU
    return [plots.save(memory_figure(results.load()), settings.out_dir / "offload-memory.png")]


def memory_figure(frame: pd.DataFrame) -> Figure:
    """Device GiB (solid, left axis) and host GiB (dotted, right axis) vs tokens, one colour per method;
    an x at each series' first length over the budget."""
    data = frame[frame["metric"] == "peak_memory"].assign(label=_labels)
    fig = Figure(figsize=(9.0, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    host_ax = ax.twinx()
    for label, rows in sorted(data.groupby("label"), key=lambda item: _rank(item[0])):
        color = plots.METHOD_COLORS.get(rows["method"].iloc[0], "black")
        style = "--" if label.endswith("offload") else "-"
        ok = rows[rows["status"] == "ok"].sort_values("seq_len_tokens")
        x = ok["seq_len_tokens"] / plots.TOKENS_PER_K
        ax.plot(x, ok["value"], style, marker="o", markersize=3, color=color, label=f"{label}: device")
        if label.endswith("offload"):
            host_ax.plot(x, ok["host_peak_gib"], ":", marker=".", color=color, label=f"{label}: host")
        over = rows.loc[rows["status"] == "oom", "seq_len_tokens"]
        if len(over):
            ax.scatter([over.min() / plots.TOKENS_PER_K], [rows["budget_gib"].iloc[0]], marker="x", s=60,
                       color=color, zorder=3)
    budget = data["budget_gib"].iloc[0]
    ax.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"budget {budget:g} GiB")
    ax.set(xlabel=plots.LENGTH_LABEL, ylabel="device memory at the peak (GiB)", xlim=(0, None),
           ylim=(0, budget * 1.1), title=f"{data['model'].iloc[0]}: device and host memory (simulated)")
    host_ax.set(ylabel="host memory, offloaded (GiB)", ylim=(0, None))
    ax.grid(alpha=0.3)
    handles = [*ax.get_legend_handles_labels()[0], *host_ax.get_legend_handles_labels()[0],
               Line2D([], [], color="black", marker="x", linestyle="none", label="first length over budget")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.16, 1.0))
    return fig


def _rank(label: str) -> tuple[int, bool]:
    method, order = label.split(" ")[0], plots.METHOD_ORDER
    return (order.index(method) if method in order else len(order), label.endswith("offload"))


def slopes(frame: pd.DataFrame) -> dict[str, float]:
    """Device GiB per 1000 tokens (linear fit over the ok points) per row label of the curve."""
    data = frame[(frame["metric"] == "peak_memory") & (frame["status"] == "ok")].assign(label=_labels)
    return {label: float(np.polyfit(rows["seq_len_tokens"] / 1000, rows["value"], 1)[0])
            for label, rows in data.groupby("label") if len(rows) >= 2}


def section(frame: pd.DataFrame) -> list[str]:
    """The README section: max length per method with and without offload, the gap to streambp + offload,
    the curve's slopes and the targets."""
    data = frame[frame["metric"] == "max_len"].assign(label=_labels)
    budget = data["budget_gib"].max()
    lines = [f"## Host-memory tier — every method with and without offload (simulated, {budget:g} GiB)", "",
             prose("offload-protocol"), "", prose("offload-rows"), "",
             "| model | method | max length | device GiB | host GiB | copied GiB each way | "
             "x streambp + offload |", "|---|---|---|---|---|---|---|"]
    for (model, rank), rows in data.groupby(["model", "lora_rank"], dropna=False, sort=False):
        best = rows.loc[rows["label"] == "streambp + offload", "value"]
        for _, row in sorted(rows.iterrows(), key=lambda item: _rank(item[1]["label"])):
            ratio = f"{row['value'] / best.iloc[0]:.3f}" if len(best) and best.iloc[0] else "–"
            lines.append(f"| {_model(model, rank)} | {row['label']} | {row['value']:,.0f} | "
                         f"{_cell(row['peak_allocated_gib'])} | {_cell(row['host_peak_gib'])} | "
                         f"{_cell(row['to_host_gib'])} | {ratio} |")
    return lines + ["", *_slope_lines(frame), "", *_target_lines(data, frame), "", "![](offload-memory.png)",
                    ""]


def _model(model: str, rank: object) -> str:
    return model if pd.isna(rank) else f"{model} LoRA r{int(rank)}"


def _cell(gib: float) -> str:
    return "–" if pd.isna(gib) else f"{gib:.1f}"


def _slope_lines(frame: pd.DataFrame) -> list[str]:
    model = frame.loc[frame["metric"] == "peak_memory", "model"]
    lines = [f"Device memory slope on {model.iloc[0] if len(model) else CURVE_MODEL} (linear fit of the "
             "curve's points within the budget, GiB per 1000 tokens):", "", "| method | slope |", "|---|---|"]
    return lines + [f"| {label} | {slope:.4f} |" for label, slope in
                    sorted(slopes(frame).items(), key=lambda item: _rank(item[0]))]


def _target_lines(data: pd.DataFrame, frame: pd.DataFrame) -> list[str]:
    """Whether streambp + offload reaches the lengths and the slope it is meant to."""
    lines = ["Targets (streambp + offload):", ""]
    for (model, rank), tokens in TARGETS.items():
        rows = data[(data["model"] == model) & (data["label"] == "streambp + offload")
                    & (data["lora_rank"].isna() if rank is None else data["lora_rank"] == rank)]
        if len(rows):
            found = rows["value"].iloc[0]
            lines.append(f"- {model}: {found:,.0f} tokens (target >= {tokens:,}: "
                         f"{'met' if found >= tokens else 'not met'})")
    curve = frame.loc[frame["metric"] == "peak_memory", "model"]
    slope = slopes(frame).get("streambp + offload")
    if slope is not None and set(curve) == {CURVE_MODEL}:
        lines.append(f"- {CURVE_MODEL} device slope: {slope:.4f} GiB per 1000 tokens (target <= "
                     f"{SLOPE_TARGET_GIB_PER_K}: {'met' if slope <= SLOPE_TARGET_GIB_PER_K else 'not met'})")
    return lines
