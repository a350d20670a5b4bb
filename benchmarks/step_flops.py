"""CPU proxies of step time: matmul FLOPs and ops dispatched by one training step, streambp vs checkpoint.

    python benchmarks/step_flops.py --out results/benchmarks/step_flops.csv

Runs one step (loss and backward) per variant on meta tensors (no memory, no GPU, seconds on a CPU) of
a model cut to a few decoder layers (default: two layers of Qwen3-1.7B at 16k tokens, layer partition
T/3 as in the paper's timing protocol), and records every aten op (`streambp_core.step.ops`): matmul
FLOPs by torch's formulas, ops dispatched (views included) and kernels launched (ops that move data).
Each variant's figures are also given relative to checkpoint's. Rows are labelled `simulated` (meta
tensors). Targets: matmul FLOPs <= 1.00x checkpoint, dispatched ops <= 2x checkpoint.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from csv_out import write_csv

COLUMNS = ("model", "num_layers", "seq_len_tokens", "method", "partition_size", "head_partition_size",
           "head_mode", "matmul_tflop", "dispatched_ops", "launches", "flops_vs_checkpoint",
           "dispatched_vs_checkpoint", "launches_vs_checkpoint", "source")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="Qwen/Qwen3-1.7B", help="preset name or local config directory")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept (default 2)")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--ps", type=int, default=0, help="layer partition; 0 means seq_len / 3")
    parser.add_argument("--ps-head", default="1024,100", help="comma-separated LM-head partitions")
    parser.add_argument("--head-modes", default="fused,recompute", help="comma-separated head modes")
    parser.add_argument("--out", type=Path, help="CSV file for the rows (overwritten); none: print only")
    return parser.parse_args(argv)


def variants(args) -> list[tuple[str, int, str]]:
    """(method, head partition, head mode) to run; checkpoint first, as the reference."""
    heads = [int(size) for size in args.ps_head.split(",")]
    modes = args.head_modes.split(",")
    return [("checkpoint", heads[0], "")] + [("streambp", h, m) for h in heads for m in modes]


def measure(args) -> list[dict]:
    """One row per variant (see COLUMNS)."""
    from streambp_core.step.ops import meta_step_ops

    partition = args.ps or -(-args.seq_len // 3)
    rows, reference = [], None
    for method, head, mode in variants(args):
        options = {"partition_size": partition, "head_partition_size": head}
        if mode:
            options["head_mode"] = mode
        records = meta_step_ops(args.model, method, args.seq_len, num_layers=args.layers, **options)
        figures = (sum(r.flops for r in records if r.kind == "matmul"), len(records),
                   sum(r.moves_data for r in records))
        reference = reference or figures
        ratios = [f"{value / base:.3f}" for value, base in zip(figures, reference, strict=True)]
        rows.append(dict(zip(COLUMNS, (args.model, args.layers, args.seq_len, method, partition,
                                       head if method != "checkpoint" else "", mode,
                                       f"{figures[0] / 1e12:.3f}", figures[1], figures[2], *ratios,
                                       "simulated"), strict=True)))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = measure(args)
    writer = csv.DictWriter(sys.stdout, COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    write_csv(args.out, COLUMNS, rows)


if __name__ == "__main__":
    main()
