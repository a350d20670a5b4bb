"""`reproduce table3`: the paper's Table 3, max length with AdamW for SFT, GRPO and DPO (simulated).

Every cell of the paper (Qwen3-4B, 8B full and LoRA, 14B and 32B LoRA) for plain, checkpoint and
streambp: SFT (one sequence), GRPO (one group of 8) and DPO (a chosen and a rejected sequence), under the
trl protocol (the baselines' GRPO and DPO losses as TRL 0.17's trainers compute them, which the paper
ran). Rows go to `table3.csv`; the figures to `table3-<objective>.png`; `section` writes the README part.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from streambp_bench.paper import plots, published
from streambp_bench.paper.prose import prose
from streambp_bench.paper.shared import METHODS, Settings, k_tokens, max_len_rows, sources
from streambp_core.config import StepSpec

OBJECTIVES = ("sft", "grpo", "dpo")


def run(settings: Settings) -> list[Path]:
    """Search every cell; write CSV + one PNG per objective."""
    results = settings.csv("table3")
    results.append_many(max_len_rows(specs(settings.quick), settings))
    return figures(settings)


def cells_of(quick: bool) -> dict[str, tuple[str, int]]:
    """The table's cells, name -> (model, LoRA rank or 0): the paper's, or tiny ones when `quick`."""
    if quick:
        return {"tiny full": ("tiny/llama", 0), "tiny LoRA": ("tiny/llama", 4)}
    return published.TABLE3_CELLS


def specs(quick: bool, methods: tuple[str, ...] = METHODS) -> list[StepSpec]:
    """Every (objective, cell, method) step of the table, searched under the trl protocol with AdamW."""
    sizes = {"partition_size": 32, "head_partition_size": 16} if quick else {}
    group = 2 if quick else published.TABLE3_GROUP_SIZE
    return [StepSpec.of(model=model, method=method, objective=objective, lora_rank=rank, optimizer="adamw",
                        batch_size=batch, protocol="trl", **sizes)
            for objective, batch in (("sft", 1), ("grpo", group), ("dpo", 1))
            for model, rank in cells_of(quick).values()
            for method in methods]


def figures(settings: Settings) -> list[Path]:
    """One PNG per objective from `table3.csv`, ours beside the paper's."""
    cells = cells_of(settings.quick)
    frame = settings.csv("table3").load()
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
            for (objective, method, cell), k in published.TABLE3_MAX_LEN_K.items()
            if k and cell in cells
        ]
    )
    written = []
    for objective in OBJECTIVES:
        part = frame[frame["objective"] == objective]
        fig = plots.max_length_bars(part, paper_frame if len(paper_frame) else None)
        written.append(plots.save(fig, settings.out_dir / f"table3-{objective}.png"))
    return written


def section(frame: pd.DataFrame) -> list[str]:
    """The README section: ours (paper) per objective, method and cell; how far checkpoint is from the
    paper; what the trl protocol emulates and what it does not."""
    cells = list(published.TABLE3_CELLS)
    lines = [
        "## Table 3 — max length with AdamW, ours (paper), thousands of tokens (" + sources(frame) + ")",
        "",
        "| objective | method | " + " | ".join(cells) + " |",
        "|---|---|" + "---|" * len(cells),
    ]
    data = frame[frame["metric"] == "max_len"]
    for (objective, method), rows in data.groupby(["objective", "method"], sort=False):
        text = []
        for cell in cells:
            model, rank = published.TABLE3_CELLS[cell]
            match = rows[(rows["model"] == model) & (rows["lora_rank"].fillna(0) == rank)]
            ours = match["value"].iloc[0] if len(match) else None
            theirs = published.TABLE3_MAX_LEN_K.get((objective, method, cell))
            text.append(f"{k_tokens(ours)} ({k_tokens(theirs and theirs * 1000)})")
        lines.append(f"| {objective} | {method} | " + " | ".join(text) + " |")
    figures = [f"![](table3-{o}.png)" for o in OBJECTIVES]
    return lines + ["", _confirmed(data), "", *_checkpoint_gaps(data), "", prose("table3-gaps"), "",
                    *figures, ""]


def _confirmed(data: pd.DataFrame) -> str:
    """Whether every answer was confirmed at its model's full depth (the rows' `confirmed_layers`)."""
    if "confirmed_layers" not in data or data["confirmed_layers"].isna().any():
        return "Some cells were searched before answers were confirmed at full depth (no confirmed_layers)."
    by_model = data.groupby("model")["confirmed_layers"].max().astype(int)
    depths = ", ".join(f"{model.split('/')[-1]} {layers}" for model, layers in by_model.items())
    return f"Every cell is confirmed by a simulation of all of its model's layers ({depths})."


def _checkpoint_gaps(data: pd.DataFrame) -> list[str]:
    """One line per objective: the range of checkpoint's ours/paper - 1 over the cells the paper has."""
    lines = ["Checkpoint vs the paper (ours / paper - 1, over the cells the paper reports):", ""]
    for objective, rows in data[data["method"] == "checkpoint"].groupby("objective", sort=False):
        gaps = []
        for cell, (model, rank) in published.TABLE3_CELLS.items():
            theirs = published.TABLE3_MAX_LEN_K.get((objective, "checkpoint", cell))
            match = rows[(rows["model"] == model) & (rows["lora_rank"].fillna(0) == rank)]
            if theirs and len(match):
                gaps.append(match["value"].iloc[0] / (theirs * 1000) - 1)
        if gaps:
            within = sum(abs(g) <= 0.15 for g in gaps)
            lines.append(
                f"- {objective}: {min(gaps):+.0%} to {max(gaps):+.0%}; {within} of {len(gaps)} within ±15%"
            )
    return lines
