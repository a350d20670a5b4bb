"""`reproduce table1`: the paper's Table 1, step time per length (measured).

On CUDA: Qwen3-4B in bf16 at the paper's first lengths, every method, layer partition T/3 (the paper's
timing protocol). Without a GPU: a tiny model's CPU step time, checkpoint and streambp (a ratio, not the
paper's seconds). Rows go to `table1.csv`; the figure to `table1-time.png`; `section` writes the README
part.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from streambp_bench.paper import plots, published
from streambp_bench.paper.prose import prose
from streambp_bench.paper.shared import Settings, sources
from streambp_bench.sweep import grid
from streambp_core.config import StepSpec
from streambp_core.step.parts.target import resolve_target


def run(settings: Settings) -> list[Path]:
    """Qwen3-4B on CUDA (paper lengths, capped), else a tiny model on the CPU; write CSV + PNG."""
    if settings.device == "cuda":
        model, dtype, lengths = "Qwen/Qwen3-4B", "bfloat16", (6144, 9216, 12288)
        methods: tuple[str, ...] = tuple(published.TABLE1_TIME_S)
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
    grid.run_points(points, target, results, force=True, on_point=settings.on_point)
    frame = results.load().assign(partition_size=pd.NA)  # ps = T/3 varies with T: one line per method
    return [plots.save(plots.time_vs_length(frame), settings.out_dir / "table1-time.png")]


def section(frame: pd.DataFrame) -> list[str]:
    """The README section: checkpoint's and streambp's step time per length and their ratio."""
    data = frame[(frame["metric"] == "step_time") & (frame["status"] == "ok")]
    source = sources(data)
    lines = ["## Table 1 — step time (" + source + ")", ""]
    if "measured-cuda" not in source:
        lines += [prose("table1-cpu"), ""]
    lines += [
        "| model | tokens | checkpoint ms | streambp ms | streambp / checkpoint |",
        "|---|---|---|---|---|",
    ]
    for (model, length), rows in data.groupby(["model", "seq_len_tokens"]):
        times = {r["method"]: r["value"] for _, r in rows.iterrows()}
        ck, sb = times.get("checkpoint"), times.get("streambp")
        ratio = f"{sb / ck:.2f}" if ck and sb else "–"
        lines.append(
            f"| {model} | {length:,} | {ck or float('nan'):.0f} | {sb or float('nan'):.0f} | {ratio} |"
        )
    return lines + ["", "![](table1-time.png)", ""]
