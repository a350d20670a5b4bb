"""Profile one training step of a method on CUDA: the kernels that take the time, for tuning.

    python benchmarks/profile_step.py --model Qwen/Qwen3-1.7B --seq-len 16384 --methods checkpoint,streambp

Prints, per method, the median step time over a few repeats and torch.profiler's top CUDA kernels.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import streambp_core
from streambp_core.measure.cuda import median, time_cuda_ms
from streambp_core.models.load import build_model


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="Qwen/Qwen3-1.7B")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--methods", default="checkpoint,streambp")
    parser.add_argument("--ps", type=int, default=0, help="layer partition; 0 means seq_len / 3")
    parser.add_argument("--ps-head", type=int, default=100)
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args()
    model = build_model(args.model, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(model.config.vocab_size, (1, args.seq_len), device="cuda")
    partition = args.ps or -(-args.seq_len // 3)
    for method in args.methods.split(","):
        with streambp_core.prepare(model, method, partition_size=partition, head_partition_size=args.ps_head,
                                   baseline_attention="engine") as run:
            step = lambda run=run: run.loss(ids).backward()  # noqa: E731
            ms = median(time_cuda_ms(step, warmup=1, repeats=3))
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        print(f"== {method}: {ms:.1f} ms per step at {args.seq_len} tokens (partition {partition})")
        averages = prof.key_averages()
        table = averages.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60)
        print(table)


if __name__ == "__main__":
    main()
