"""`reproduce fig3`: the paper's Fig. 3, BP-only maximum length and memory vs length (simulated).

- Max length (simulated search, confirmed at full depth) of plain, checkpoint and streambp for Qwen3-8B,
  Qwen3-14B and Qwen3-32B LoRA r32 at 80 GiB: bf16, batch 1, gradients resident, no optimizer.
- Memory vs length of each, each series stopping after its first length over the budget.
Rows go to `fig3.csv`; the figures to `fig3-memory.png` and `fig3-maxlen.png`; `section` writes the
README part.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from streambp_bench.paper import plots, published
from streambp_bench.paper.prose import prose
from streambp_bench.paper.shared import METHODS, Settings, k_tokens, max_len_rows, memory_curve
from streambp_core.config import StepSpec
from streambp_core.step.parts.target import resolve_target


def run(settings: Settings) -> list[Path]:
    """Search each model's methods, then the memory curves; write CSV + PNGs."""
    models = {"tiny": ("tiny/llama", 0)} if settings.quick else published.FIG3_MODELS
    lengths = (64, 256, 1024) if settings.quick else (1024, 2048, *range(4096, 131072 + 1, 8192))
    results, budget = settings.csv("fig3"), settings.budget_gib()
    sizes = {"partition_size": 32, "head_partition_size": 16} if settings.quick else {}
    rows = max_len_rows([StepSpec.of(model=model, method=method, lora_rank=rank, **sizes)
                         for model, rank in models.values() for method in METHODS], settings)
    results.append_many(rows)
    target = resolve_target("sim", budget)
    points = [
        StepSpec.of(method=method, model=model, seq_len_tokens=length, lora_rank=rank, **sizes)
        for model, rank in models.values()
        for method in METHODS
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
            for label, values in published.FIG3_MAX_LEN_K.items()
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


def slopes(frame: pd.DataFrame) -> pd.DataFrame:
    """Linear fit of simulated peak GiB vs thousands of tokens per (model, LoRA, method), ok rows only."""
    data = frame[(frame["metric"] == "peak_memory") & (frame["status"] == "ok")]
    out = []
    for (model, rank, method), rows in data.groupby(["model", "lora_rank", "method"], dropna=False):
        if len(rows) >= 2:
            slope = np.polyfit(rows["seq_len_tokens"] / 1000, rows["value"], 1)[0]
            out.append(
                {"model": model, "lora_rank": rank, "method": method, "slope": slope, "points": len(rows)}
            )
    return pd.DataFrame(out)


def section(frame: pd.DataFrame) -> list[str]:
    """The README section: each max length beside the paper's, then the memory slopes."""
    lines = [
        "## Fig. 3 — BP-only maximum length (simulated, 80 GiB)",
        "",
        "| model | method | ours | paper | ours / paper | source |",
        "|---|---|---|---|---|---|",
    ]
    by_model = {v: k for k, v in published.FIG3_MODELS.items()}
    for _, row in frame[frame["metric"] == "max_len"].iterrows():
        label = by_model.get((row["model"], int(row["lora_rank"]) if pd.notna(row["lora_rank"]) else 0))
        theirs = published.FIG3_MAX_LEN_K.get(label, {}).get(row["method"])
        ratio = f"{row['value'] / (theirs * 1000):.2f}" if theirs else "–"
        name = label or row["model"]
        lines.append(
            f"| {name} | {row['method']} | {k_tokens(row['value'])} | {k_tokens(theirs and theirs * 1000)} "
            f"| {ratio} | {row['source']} |"
        )
    lines += [
        "",
        prose("fig3-slopes"),
        "",
        "| model | method | slope | points |",
        "|---|---|---|---|",
    ]
    for _, row in slopes(frame).iterrows():
        lora = f" LoRA r{int(row['lora_rank'])}" if pd.notna(row["lora_rank"]) else ""
        lines.append(f"| {row['model']}{lora} | {row['method']} | {row['slope']:.3f} | {row['points']} |")
    return lines + ["", "![](fig3-memory.png)", "", "![](fig3-maxlen.png)", ""]
