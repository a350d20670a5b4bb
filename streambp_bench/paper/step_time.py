"""The step-time sections of `results/README.md`, from the CSVs the step-time benchmarks write under
`results/benchmarks/`: `step_flops.csv` (benchmarks/step_flops.py) and `step_time_estimate*.csv`
(benchmarks/step_time_estimate.py)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

FLOPS_TEXT = """\
One training step (loss and backward) of two Qwen3-1.7B decoder layers at 16k tokens on meta tensors,
every aten op recorded (`benchmarks/step_flops.py --auto-budget-gib 24,80,139 --out
results/benchmarks/step_flops.csv`): matmul FLOPs by torch's formulas (in-place `addmm_` included), ops
dispatched (views included) and kernels launched (ops that move data). Layer partition T/3 (the paper's
timing protocol). Targets: FLOPs <= 1.00x checkpoint ({flops_verdict}: {flops_ratio:.3f}x with the fused
head at partition {head}), dispatched ops <= 2x checkpoint ({ops_verdict}: {ops_ratio:.2f}x there). Each
of the three chunks of a layer dispatches the model's own RMSNorm, RoPE and projections and their backward
(autograd's, or by hand for plain linear projections), about as many ops as a whole checkpointed layer, so
far fewer needs fused kernels, which only a GPU can show to be faster; the RMSNorm's backward stays
autograd's, since the models compute it in float32 even in a float64 model, so another formula would move
float64 gradients by ~1e-7 against plain backprop.
{auto_text}"""

AUTO_TEXT = """\
The rows with a budget are the partitions the automatic choice (`--ps auto --ps-head auto`, fused head)
makes for the full-depth model at that budget, the sizes a GPU step runs with: there streambp
dispatches {auto_low:.2f}x to {auto_high:.2f}x checkpoint's ops.
"""


ESTIMATE_TEXT = """\
Roofline estimate (`streambp_core.step.estimate`): per op max(FLOPs / (datasheet bf16 peak x 0.70 for
matmuls, x 0.35 for attention), bytes / (HBM bandwidth x 0.80)) plus 10 us per launched kernel, over the
ops of one step on meta tensors at 1 and 2 layers, scaled to the full depth
(`benchmarks/step_time_estimate.py --measured results/gpu/selfcheck-h200.csv`). The launch cost is the
one constant chosen with these rows in view, so they are calibration points, not an independent test.
`code` is the engine whose ops were estimated: the measured rows were taken on the engine of commit
4c91162; the estimator's files were added to a checkout of it to estimate the same code. Rows without
a measurement are predictions for the current engine (fused LM head; partitions T/3, or one chunk as
the automatic choice gives on a large GPU), to be checked by `selfcheck` on a GPU.
"""


def _frame(path: Path) -> pd.DataFrame | None:
    return pd.read_csv(path) if path.exists() else None


def _automatic(frame: pd.DataFrame) -> pd.Series:
    """Which rows are at the automatic partitions of a budget (older CSVs have no such rows)."""
    if "auto_budget_gib" not in frame:
        return pd.Series(False, index=frame.index)
    return frame["auto_budget_gib"].notna()


def _flops_text(frame: pd.DataFrame) -> str:
    """FLOPS_TEXT filled from the fixed-partition streambp row with the fused head at its largest head
    partition, and from the rows at automatic partitions."""
    auto = frame[_automatic(frame)]
    auto_text = "" if not len(auto) else AUTO_TEXT.format(auto_low=auto["dispatched_vs_checkpoint"].min(),
                                                           auto_high=auto["dispatched_vs_checkpoint"].max())
    frame = frame[~_automatic(frame)]
    fused = frame[(frame["method"] == "streambp") & (frame["head_mode"] == "fused")]
    if not len(fused):
        fused = frame[frame["method"] == "streambp"]
    row = fused.loc[fused["head_partition_size"].idxmax()]
    verdict = lambda ratio, target: "met" if ratio <= target else "not met"  # noqa: E731
    return FLOPS_TEXT.format(flops_ratio=row["flops_vs_checkpoint"],
                             ops_ratio=row["dispatched_vs_checkpoint"], head=int(row["head_partition_size"]),
                             flops_verdict=verdict(row["flops_vs_checkpoint"], 1.0),
                             ops_verdict=verdict(row["dispatched_vs_checkpoint"], 2.0), auto_text=auto_text)


def flops_section(frame: pd.DataFrame) -> list[str]:
    lines = ["## Step time proxies — matmul FLOPs and ops of one step (simulated)", "", _flops_text(frame),
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
    lines = ["## Step time — estimated vs measured-cuda", "", ESTIMATE_TEXT,
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
