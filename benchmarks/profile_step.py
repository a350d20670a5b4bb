"""Profile one training step per method and head partition on CUDA: where the step time goes, for tuning.

    python benchmarks/profile_step.py --model Qwen/Qwen3-1.7B --seq-len 16384 \\
        --methods checkpoint,streambp --ps-head 100,1000 --out results/gpu/profile.csv

Per (method, head partition): the median step time over a few CUDA-event-timed repeats, then one
profiled step whose kernels are summed by class (attention forward/backward, GEMM, copy,
elementwise/other; `streambp_core.measure.kernels`). Prints a table and writes one CSV row per class
(`--out`), every row carrying the GPU's name; `--top N` also prints torch.profiler's top N kernels.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import streambp_core
from streambp_core.measure.cuda import median, time_cuda_ms
from streambp_core.measure.kernels import kernel_time_by_class
from streambp_core.models.load import build_model

COLUMNS = ("device_name", "model", "method", "seq_len_tokens", "partition_size", "head_partition_size",
           "step_time_ms", "kernel_class", "self_time_ms", "launches")


def parse_args() -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="Qwen/Qwen3-1.7B")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--methods", default="checkpoint,streambp")
    parser.add_argument("--ps", type=int, default=0, help="layer partition; 0 means seq_len / 3")
    parser.add_argument("--ps-head", default="100", help="comma-separated LM-head partitions")
    parser.add_argument("--attn", default="auto", choices=("auto", "sdpa", "flash"))
    parser.add_argument("--head-mode", default="auto", choices=("auto", "fused", "recompute"),
                        help="streambp's LM head (auto: fused for sft)")
    parser.add_argument("--out", type=Path, help="CSV file for the rows (overwritten)")
    parser.add_argument("--top", type=int, default=0, help="also print the top N kernels")
    return parser.parse_args()


def profile_one(model, ids, method: str, partition: int, head_partition: int, attn: str, head_mode: str):
    """(median step ms, per-class kernel times, profiler averages) of one prepared method."""
    head = {"head_mode": head_mode} if method == "streambp" else {}
    with streambp_core.prepare(model, method, partition_size=partition, head_partition_size=head_partition,
                               baseline_attention="engine", attn=attn, **head) as run:
        step = lambda: run.loss(ids).backward()  # noqa: E731
        ms = median(time_cuda_ms(step, warmup=1, repeats=3))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    averages = prof.key_averages()
    return ms, kernel_time_by_class(averages), averages


def main() -> None:
    args = parse_args()
    model = build_model(args.model, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(model.config.vocab_size, (1, args.seq_len), device="cuda")
    partition = args.ps or -(-args.seq_len // 3)
    gpu = torch.cuda.get_device_name()
    rows = []
    for method in args.methods.split(","):
        head_partitions = [int(p) for p in args.ps_head.split(",")] if method != "checkpoint" else [0]
        for head_partition in head_partitions:
            ms, classes, averages = profile_one(model, ids, method, partition, head_partition or 100,
                                                args.attn, args.head_mode)
            print(f"== {method}, ps-head {head_partition or '-'}: {ms:.1f} ms per step at {args.seq_len} "
                  f"tokens (partition {partition}, {gpu})")
            for item in classes:
                print(f"   {item.kernel_class:18s} {item.self_time_ms:9.1f} ms {item.launches:7d} launches")
                rows.append(dict(zip(COLUMNS, (gpu, args.model, method, args.seq_len, partition,
                                               head_partition or "", f"{ms:.2f}", item.kernel_class,
                                               f"{item.self_time_ms:.2f}", item.launches), strict=True)))
            if args.top:
                print(averages.table(sort_by="cuda_time_total", row_limit=args.top,
                                     max_name_column_width=70))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        print(f"rows written to {args.out}")


if __name__ == "__main__":
    main()
