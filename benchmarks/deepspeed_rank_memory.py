"""One rank's peak under DeepSpeed ZeRO: measured on real CPU ranks (gloo) against the DeepSpeed layouts.

    python benchmarks/deepspeed_rank_memory.py --out results/benchmarks/deepspeed_rank_memory.csv

For each layout (`deepspeed-zero2`, `deepspeed-zero3`) and method, runs the step on `--gpus` CPU ranks
with the model handed to DeepSpeed (bf16, AdamW, its default buckets) and rank 0 under the memory tracker
(`streambp_core.parallel.deepspeed_memory`; rows labelled `measured-cpu`), and simulates the same
`StepSpec` on meta tensors (`simulated`). Defaults as benchmarks/fsdp_rank_memory.py: the tiny Qwen3
preset widened to a 4096-token vocabulary, hidden 128, MLP 256, 256 tokens. The target: the simulated
rank an upper bound of the measured one, within 5 % (`simulated_over_measured`). Bytes throughout.

`--offloads optimizer optimizer,params` adds DeepSpeed's own offload under `deepspeed-zero3`
(`offload_optimizer`, `offload_param` on the CPU, DeepSpeed's CPU Adam): the measured rank files what
DeepSpeed keeps as offloaded state in its host pool (`host_peak_bytes`; on CPU ranks both pools are host
memory, so the split is DeepSpeed's own buffers against the rest, see
`streambp_core.parallel.deepspeed_memory`) and the simulated rank lays it out as
`step.simulation.deepspeed_host` does; `host_simulated_over_measured` sets the host pools side by side. The
bytes copied to the host are comparable (what a GPU rank copies out); the measured `to_device_bytes` are not:
on the CPU a gather reads its host partition in place (not counted), and ops reading a host buffer into a new
tensor count as copies that a GPU rank makes from device copies (`streambp_core.parallel.deepspeed_memory`).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from csv_out import script_main
from fsdp_rank_memory import add_step_arguments, model_config, partitions, rank_rows

from streambp_core.config import ConfigError, StepSpec
from streambp_core.measure.tags import CATEGORIES

COLUMNS = ("model", "vocab_size", "hidden_size", "num_layers", "seq_len_tokens", "dtype", "gpus", "shard",
           "method", "optimizer", "source", "peak_bytes", *(f"{c}_bytes" for c in CATEGORIES),
           "simulated_over_measured", "offload", "host_peak_bytes", "to_host_bytes", "to_device_bytes",
           "host_simulated_over_measured")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    add_step_arguments(parser)
    parser.add_argument("--gpus", type=int, default=2, help="CPU ranks (at most the cores)")
    parser.add_argument("--shards", default="deepspeed-zero2", help="comma-separated DeepSpeed layouts")
    parser.add_argument("--methods", default="streambp,checkpoint", help="comma-separated methods")
    parser.add_argument("--offloads", nargs="+", default=["none"],
                        help="tier sets DeepSpeed offloads: none, optimizer, optimizer,params "
                        "(deepspeed-zero3 rows only)")
    parser.add_argument("--out", type=Path, help="CSV file for the rows (overwritten); none: print only")
    return parser.parse_args(argv)


def specs(args: argparse.Namespace) -> list[StepSpec]:
    """One spec per (layout, method, offload), offload other than none under deepspeed-zero3 only (DeepSpeed
    ZeRO-2's offload is not laid out); bad values are ConfigError before anything runs."""
    combos = [(shard, method, offload)
              for shard, method, offload in itertools.product(args.shards.split(","), args.methods.split(","),
                                                              args.offloads)
              if offload == "none" or shard != "deepspeed-zero2"]
    return [StepSpec.of(model=args.model, method=method, seq_len_tokens=args.seq_len, **partitions(args),
                        dtype="bfloat16", optimizer="adamw", gpus=args.gpus, shard=shard, offload=offload)
            for shard, method, offload in combos]


def rows(args: argparse.Namespace) -> list[dict]:
    """A measured-cpu and a simulated row per spec (see COLUMNS)."""
    from streambp_core.parallel.deepspeed_memory import measure_deepspeed_pools
    from streambp_core.step.parts.resolved import ResolvedModel
    from streambp_core.step.simulation.simulate import simulate

    chosen = specs(args)
    if any(spec.gpus < 2 for spec in chosen):
        raise ConfigError("--gpus must be at least 2: one rank of several")
    model = ResolvedModel(model_config(args))
    config = model.config
    out = []
    for spec, (rank, host) in zip(chosen, measure_deepspeed_pools(chosen, config), strict=True):
        sim = simulate(spec, model)
        host_ratio = round(sim.host_peak_bytes / host.peak_bytes, 4) if host.peak_bytes else ""
        compared = {"simulated_over_measured": round(sim.peak_bytes / rank.peak_bytes, 4),
                    "offload": spec.offload, "host_simulated_over_measured": host_ratio}
        measured, simulated = rank_rows(args, config, spec, rank, sim, compared)
        out += [{**measured, "host_peak_bytes": host.peak_bytes, "to_host_bytes": host.to_host_bytes,
                 "to_device_bytes": host.to_device_bytes},
                {**simulated, "host_peak_bytes": sim.host_peak_bytes, "to_host_bytes": sim.to_host_bytes,
                 "to_device_bytes": sim.to_device_bytes}]
    return out


main = script_main(parse_args, rows, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
