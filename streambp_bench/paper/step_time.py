"""The step-time sections of `results/README.md`, from the CSVs the step-time benchmarks write under
`results/benchmarks/`: `step_flops.csv` (benchmarks/step_flops.py) and `step_time_estimate*.csv`
(benchmarks/step_time_estimate.py)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from streambp_bench.paper.prose import prose


def _frame(path: Path) -> pd.DataFrame | None:
    return pd.read_csv(path) if path.exists() else None


def _automatic(frame: pd.DataFrame) -> pd.Series:
    """Which rows are at the automatic partitions of a budget (older CSVs have no such rows)."""
    if "auto_budget_gib" not in frame:
        return pd.Series(False, index=frame.index)
    return frame["auto_budget_gib"].notna()


def _flops_text(frame: pd.DataFrame) -> list[str]:
    """The step-flops prose filled from the fixed-partition streambp row with the fused head at its
    largest head partition, then the step-flops-auto prose from the rows at automatic partitions (when
    there are such rows)."""
    auto = frame[_automatic(frame)]
    auto_text = [] if not len(auto) else [prose("step-flops-auto",
                                                auto_low=auto["dispatched_vs_checkpoint"].min(),
                                                auto_high=auto["dispatched_vs_checkpoint"].max())]
    frame = frame[~_automatic(frame)]
    fused = frame[(frame["method"] == "streambp") & (frame["head_mode"] == "fused")]
    if not len(fused):
        fused = frame[frame["method"] == "streambp"]
    row = fused.loc[fused["head_partition_size"].idxmax()]
    verdict = lambda ratio, target: "met" if ratio <= target else "not met"  # noqa: E731
    flops, ops = row["flops_vs_checkpoint"], row["dispatched_vs_checkpoint"]
    text = prose("step-flops", flops_ratio=flops, ops_ratio=ops, head=int(row["head_partition_size"]),
                 flops_verdict=verdict(flops, 1.0), ops_verdict=verdict(ops, 2.0))
    return [text, *auto_text]


def flops_section(frame: pd.DataFrame) -> list[str]:
    lines = ["## Step time proxies — matmul FLOPs and ops of one step (simulated)", "",
             *_flops_text(frame), "",
             "| method | partition | head partition | head | budget | matmul TFLOP | x checkpoint | ops "
             "| x checkpoint | launches | x checkpoint |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    automatic = _automatic(frame)
    for index, row in frame.iterrows():
        head = "–" if pd.isna(row["head_partition_size"]) else f"{int(row['head_partition_size'])}"
        mode = "–" if pd.isna(row["head_mode"]) else row["head_mode"]
        budget = f"auto, {row['auto_budget_gib']:g} GiB" if automatic[index] else "–"
        partition = "–" if row["method"] == "checkpoint" else row["partition_size"]
        lines.append(f"| {row['method']} | {partition} | {head} | {mode} | {budget} | "
                     f"{row['matmul_tflop']:.1f} | "
                     f"{row['flops_vs_checkpoint']:.3f} | {row['dispatched_ops']} | "
                     f"{row['dispatched_vs_checkpoint']:.2f} | {row['launches']} | "
                     f"{row['launches_vs_checkpoint']:.2f} |")
    return lines + [""]


def estimate_section(frames: list[pd.DataFrame]) -> list[str]:
    lines = ["## Step time — estimated vs measured-cuda", "", prose("step-estimate"), "",
             "| GPU | model | method | tokens | partition | head partition | head | code | measured ms "
             "| estimated ms | estimated / measured |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for frame in frames:
        for _, row in frame.iterrows():
            measured = "–" if pd.isna(row["measured_ms"]) else f"{row['measured_ms']:.0f}"
            ratio = "–" if pd.isna(row["estimated_vs_measured"]) else f"{row['estimated_vs_measured']:.2f}"
            mode = row["head_mode"] if not pd.isna(row["head_mode"]) else (
                "–" if row["method"] == "checkpoint" else "default")
            lines.append(f"| {row['gpu']} | {row['model']} | {row['method']} | {row['seq_len_tokens']:,} | "
                         f"{row['partition_size']} | {row['head_partition_size']} | {mode} | {row['code']} | "
                         f"{measured} | {row['estimated_ms']:.0f} | {ratio} |")
    return lines + [""]


def step_sections(out_dir: Path) -> list[str]:
    """README lines for the step-time CSVs present in `out_dir` (none: no lines)."""
    lines, out_dir = [], out_dir / "benchmarks"
    flops = _frame(out_dir / "step_flops.csv")
    if flops is not None and len(flops):
        lines += flops_section(flops)
    measured_first = lambda path: (path.stem != "step_time_estimate", path.name)  # noqa: E731
    paths = sorted(out_dir.glob("step_time_estimate*.csv"), key=measured_first)
    estimates = [frame for path in paths
                 if (frame := _frame(path)) is not None and len(frame)]
    if estimates:
        lines += estimate_section(estimates)
    return lines
