"""One rank's peak under torch FSDP2: measured on real CPU ranks (gloo) against the sharded simulation.

    python benchmarks/fsdp_rank_memory.py --out results/benchmarks/fsdp_rank_memory.csv

For each shard stage, method and optimizer, runs the step on `--gpus` CPU ranks with the model sharded by
FSDP2 and rank 0 under the memory tracker (`streambp_core.parallel.memory.measure_ranks`; rows labelled
`measured-cpu`), and simulates the same `StepSpec` on meta tensors (`simulated`). Defaults: the tiny
Qwen3 preset widened to a 4096-token vocabulary, hidden 128, MLP 256 (so the model state is visible next
to the activations), 256 tokens, float32: what tests/unit/test_parallel_memory.py checks. The simulated rank
is an upper bound of the measured one (see `streambp_core.parallel.memory`); `simulated_minus_measured`
says by how much. Bytes throughout (the model is tiny).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from csv_out import script_main

from streambp_bench import options as opt
from streambp_bench.tokens import UNITS, token_count
from streambp_core.config import ConfigError, StepSpec
from streambp_core.measure.tags import CATEGORIES

COLUMNS = ("model", "vocab_size", "hidden_size", "num_layers", "seq_len_tokens", "dtype", "gpus", "shard",
           "method", "optimizer", "source", "peak_bytes", *(f"{c}_bytes" for c in CATEGORIES),
           "simulated_minus_measured")


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, its shrunken sizes, the length and the partitions: the options a rank-memory benchmark
    shares (this one and deepspeed_rank_memory.py)."""
    parser.add_argument("--model", default="tiny/qwen3", help="preset name or local config directory")
    parser.add_argument("--vocab-size", type=int, default=4096, help="0: the preset's")
    parser.add_argument("--hidden-size", type=int, default=128, help="0: the preset's")
    parser.add_argument("--intermediate-size", type=int, default=256, help="0: the preset's")
    parser.add_argument("--seq-len", type=token_count("length"), default=256, help=f"tokens ({UNITS})")
    opt.add_step_arguments(parser, ps="64", ps_head="64")


def partitions(args: argparse.Namespace) -> dict[str, object]:
    """The `StepSpec` fields of --ps and --ps-head (ConfigError, one line, for a bad value)."""
    return opt.step_fields({"ps": args.ps, "ps_head": args.ps_head}, automatic=False)


def rank_rows(args: argparse.Namespace, config, spec: StepSpec, rank, sim, compared: dict) -> list[dict]:
    """The measured-cpu and the simulated row of one rank's `spec` (peak and its categories), each with
    the `compared` column(s) that set the two side by side."""
    common = {"model": args.model, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
              "num_layers": config.num_hidden_layers, "seq_len_tokens": spec.seq_len_tokens,
              "dtype": spec.dtype, "gpus": spec.gpus, "shard": spec.shard, "method": spec.method,
              "optimizer": spec.optimizer}
    return [{**common, "source": source, "peak_bytes": peak,
             **{f"{c}_bytes": breakdown.get(c, 0) for c in CATEGORIES}, **compared}
            for source, peak, breakdown in (("measured-cpu", rank.peak_bytes, rank.breakdown_bytes),
                                            ("simulated", sim.peak_bytes, sim.breakdown_bytes))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    add_step_arguments(parser)
    opt.add_step_arguments(parser, dtype="float32")
    parser.add_argument("--gpus", type=int, default=2, help="CPU ranks (at most the cores)")
    parser.add_argument("--shards", default="zero2,zero3", help="comma-separated FSDP2 stages")
    parser.add_argument("--methods", default="streambp,checkpoint", help="comma-separated methods")
    parser.add_argument("--optimizers", default="none,adamw", help="comma-separated optimizers")
    parser.add_argument("--out", type=Path, help="CSV file for the rows (overwritten); none: print only")
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace):
    """The preset's config with the sizes the options override."""
    from streambp_core.models import load_config

    config = load_config(args.model)
    for name in ("vocab_size", "hidden_size", "intermediate_size"):
        if getattr(args, name):
            setattr(config, name, getattr(args, name))
    return config


def specs(args: argparse.Namespace) -> list[StepSpec]:
    """One spec per (shard, method, optimizer); bad values are ConfigError before anything runs."""
    combos = itertools.product(*(value.split(",") for value in (args.shards, args.methods, args.optimizers)))
    return [StepSpec.of(model=args.model, method=method, seq_len_tokens=args.seq_len, **partitions(args),
                        dtype=args.dtype, optimizer=optimizer, gpus=args.gpus, shard=shard)
            for shard, method, optimizer in combos]


def rows(args: argparse.Namespace) -> list[dict]:
    """A measured-cpu and a simulated row per spec (see COLUMNS)."""
    from streambp_core.parallel.memory import measure_ranks
    from streambp_core.step.parts.resolved import ResolvedModel
    from streambp_core.step.simulation.simulate import simulate

    chosen = specs(args)
    if any(spec.gpus < 2 for spec in chosen):
        raise ConfigError("--gpus must be at least 2: one rank of several")
    model = ResolvedModel(model_config(args))  # the overridden config, validated once
    config = model.config
    out = []
    for spec, rank in zip(chosen, measure_ranks(chosen, model), strict=True):
        sim = simulate(spec, model)
        out.extend(rank_rows(args, config, spec, rank, sim,
                             {"simulated_minus_measured": sim.peak_bytes - rank.peak_bytes}))
    return out


main = script_main(parse_args, rows, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
