"""`reproduce fig5`: the paper's Fig. 5 memory, streambp's peak per layer partition size (simulated).

streambp on Qwen3-8B at layer partitions 500, 1k, 2k and 5k tokens (LM-head partition 100) over lengths
up to 128k. Rows go to `fig5.csv`; the figure to `fig5-memory.png`; `section` writes the README part.
The paper's Fig. 5 times need a GPU: not reproduced.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from streambp_bench.paper import plots, published
from streambp_bench.paper.prose import prose
from streambp_bench.paper.shared import Settings, sources
from streambp_bench.sweep import grid
from streambp_core.step.parts.target import resolve_target


def run(settings: Settings) -> list[Path]:
    """Every (partition size, length) point, simulated; write CSV + PNG."""
    model = "tiny/llama" if settings.quick else "Qwen/Qwen3-8B"
    sizes = (16, 32) if settings.quick else published.FIG5_PARTITION_SIZES
    lengths = (64, 128) if settings.quick else (4096, *range(16384, 131072 + 1, 16384))
    results = settings.csv("fig5")
    target = resolve_target("sim", settings.budget_gib() if settings.quick else None)
    points = grid.expand_grid(
        methods=("streambp",),
        models=(model,),
        seq_lens=lengths,
        partition_sizes=sizes,
        head_partition_size=16 if settings.quick else 100,
    )
    grid.run_points(points, target, results, force=True, on_point=settings.on_point)
    return [plots.save(plots.partition_ablation(results.load()), settings.out_dir / "fig5-memory.png")]


def section(frame: pd.DataFrame) -> list[str]:
    """The README section: peak GiB per length and partition size."""
    data = frame[(frame["metric"] == "peak_memory")]
    sizes = sorted(data["partition_size"].dropna().unique())
    lines = [
        "## Fig. 5 — partition-size ablation, memory (" + sources(data) + ")",
        "",
        prose("fig5-note"),
        "",
        "| model | tokens | " + " | ".join(f"ps {int(s)}" for s in sizes) + " |",
        "|---|---|" + "---|" * len(sizes),
    ]
    for (model, length), rows in data.groupby(["model", "seq_len_tokens"]):
        cells = [rows.loc[rows["partition_size"] == s, "value"] for s in sizes]
        text = [f"{c.iloc[0]:.2f}" if len(c) and pd.notna(c.iloc[0]) else "oom" for c in cells]
        lines.append(f"| {model} | {length:,} | " + " | ".join(text) + " |")
    return lines + ["", "![](fig5-memory.png)", ""]
