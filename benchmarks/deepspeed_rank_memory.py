"""One rank's peak under DeepSpeed ZeRO: measured on real CPU ranks (gloo) against the DeepSpeed layouts.

    python benchmarks/deepspeed_rank_memory.py --out results/benchmarks/deepspeed_rank_memory.csv

For each layout (`deepspeed-zero2`, `deepspeed-zero3`) and method, runs the step on `--gpus` CPU ranks
with the model handed to DeepSpeed (bf16, AdamW, its default buckets) and rank 0 under the memory tracker
(`streambp_core.parallel.deepspeed_memory`; rows labelled `measured-cpu`), and simulates the same
`StepSpec` on meta tensors (`simulated`). Defaults as benchmarks/fsdp_rank_memory.py: the tiny Qwen3
preset widened to a 4096-token vocabulary, hidden 128, MLP 256, 256 tokens. The target: the simulated
rank an upper bound of the measured one, within 5 % (`simulated_over_measured`). Bytes throughout.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from csv_out import emit_rows
from fsdp_rank_memory import add_step_arguments, model_config, rank_rows

from streambp_core.config import ConfigError, StepSpec
from streambp_core.measure.tags import CATEGORIES

COLUMNS = ("model", "vocab_size", "hidden_size", "num_layers", "seq_len_tokens", "dtype", "gpus", "shard",
           "method", "optimizer", "source", "peak_bytes", *(f"{c}_bytes" for c in CATEGORIES),
           "simulated_over_measured")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    add_step_arguments(parser)
    parser.add_argument("--gpus", type=int, default=2, help="CPU ranks (at most the cores)")
    parser.add_argument("--shards", default="deepspeed-zero2", help="comma-separated DeepSpeed layouts")
    parser.add_argument("--methods", default="streambp,checkpoint", help="comma-separated methods")
    parser.add_argument("--out", type=Path, help="CSV file for the rows (overwritten); none: print only")
    return parser.parse_args(argv)


def specs(args: argparse.Namespace) -> list[StepSpec]:
    """One spec per (layout, method); bad values are ConfigError before anything runs."""
    combos = itertools.product(args.shards.split(","), args.methods.split(","))
    return [StepSpec.of(model=args.model, method=method, seq_len_tokens=args.seq_len, partition_size=args.ps,
                        head_partition_size=args.ps_head, dtype="bfloat16", optimizer="adamw",
                        gpus=args.gpus, shard=shard) for shard, method in combos]


def rows(args: argparse.Namespace) -> list[dict]:
    """A measured-cpu and a simulated row per spec (see COLUMNS)."""
    from streambp_core.parallel.deepspeed_memory import measure_deepspeed_ranks
    from streambp_core.step.resolved import ResolvedModel
    from streambp_core.step.simulate import simulate

    chosen = specs(args)
    if any(spec.gpus < 2 for spec in chosen):
        raise ConfigError("--gpus must be at least 2: one rank of several")
    model = ResolvedModel(model_config(args))
    config = model.config
    out = []
    for spec, rank in zip(chosen, measure_deepspeed_ranks(chosen, config), strict=True):
        sim = simulate(spec, model)
        out.extend(rank_rows(args, config, spec, rank, sim,
                             {"simulated_over_measured": round(sim.peak_bytes / rank.peak_bytes, 4)}))
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the rows (and write them with --out); bad input is one `error:` line and exit code 2."""
    args = parse_args(argv)
    return emit_rows(lambda: rows(args), args.out, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
