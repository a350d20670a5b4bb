"""CPU proxies of step time: matmul FLOPs and ops dispatched by one training step, streambp vs checkpoint.

    python benchmarks/step_flops.py --auto-budget-gib 24,80,139 --out results/benchmarks/step_flops.csv

Runs one step (loss and backward) per variant on meta tensors (no memory, no GPU, seconds on a CPU) of a model
cut to a few decoder layers (default: two layers of Qwen3-1.7B at 16k tokens, layer partition T/3 unless
`--ps`, as in the paper's timing protocol), and records every aten op (`streambp_core.step.estimate.ops`):
matmul FLOPs
by torch's formulas, ops dispatched (views included) and kernels launched (ops that move data). Each variant's
figures are also given relative to checkpoint's. Rows are labelled `simulated` (meta tensors). Targets: matmul
FLOPs <= 1.00x checkpoint, dispatched ops <= 2x checkpoint.

--auto-budget-gib 80,139 adds a streambp row (fused head) per budget at the partitions the automatic
choice (`--ps auto --ps-head auto`) makes for the full-depth model at that budget, the sizes a GPU step
runs with; its partition columns give them. Bad input is one `error:` line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from csv_out import emit_rows

from streambp_bench import options as opt
from streambp_bench.results import RESOLVED_HEAD_MODES as HEAD_MODES
from streambp_bench.tokens import UNITS, token_count
from streambp_core.config import ConfigError, StepSpec
from streambp_core.models.config_file import precheck_model

COLUMNS = ("model", "num_layers", "seq_len_tokens", "method", "partition_size", "head_partition_size",
           "head_mode", "auto_budget_gib", "matmul_tflop", "dispatched_ops", "launches",
           "flops_vs_checkpoint", "dispatched_vs_checkpoint", "launches_vs_checkpoint", "source")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="Qwen/Qwen3-1.7B", help="preset name or local config directory")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept (default 2)")
    parser.add_argument("--seq-len", type=token_count("length"), default=16384, help=f"tokens ({UNITS})")
    opt.add_step_arguments(parser, ps=None, ps_head="1024,100")  # --ps not given: seq_len / 3
    parser.add_argument("--head-modes", default="fused,recompute", help="comma-separated head modes")
    parser.add_argument("--auto-budget-gib", default="",
                        help="comma-separated GPU budgets (GiB): a streambp row at the automatic "
                             "partitions of each")
    parser.add_argument("--out", type=Path, help="CSV file for the rows (overwritten); none: print only")
    return parser.parse_args(argv)


def variants(args) -> list[tuple[str, int, int, str, float | None]]:
    """(method, layer partition, head partition, head mode, budget of an automatic choice or None) to run;
    checkpoint first, as the reference. Every value is checked (ConfigError, one line) before any step
    runs."""
    precheck_model(args.model)
    for name, value in (("--layers", args.layers), ("--seq-len", args.seq_len)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, not {value}")
    sizes = opt.step_fields({"ps": args.ps, "ps_head": args.ps_head}, listed=("ps_head",), automatic=False)
    partition = sizes.get("partition_size") or -(-args.seq_len // 3)
    heads = sizes["head_partition_size"]
    modes = [mode.strip() for mode in args.head_modes.split(",") if mode.strip()]
    unknown = sorted(set(modes) - set(HEAD_MODES))
    if not heads or not modes or unknown:
        raise ConfigError(f"--ps-head and --head-modes need at least one value; head modes are "
                          f"{', '.join(HEAD_MODES)}" + (f", not {', '.join(unknown)}" if unknown else ""))
    found = [("checkpoint", partition, heads[0], "", None)]
    found += [("streambp", partition, head, mode, None) for head in heads for mode in modes]
    for method, layer, head, mode, _ in found:
        StepSpec.of(model=args.model, method=method, seq_len_tokens=args.seq_len, partition_size=layer,
                    head_partition_size=head, head_mode=mode or "recompute")
    return found + [("streambp", *auto_partitions(args, budget), "fused", budget) for budget in budgets(args)]


def budgets(args) -> list[float]:
    """The --auto-budget-gib values (GiB), each positive."""
    try:
        found = [float(value) for value in args.auto_budget_gib.split(",") if value.strip()]
    except ValueError:
        raise ConfigError(f"bad --auto-budget-gib {args.auto_budget_gib!r}: GiB numbers, e.g. 80,139"
                          ) from None
    if any(value <= 0 for value in found):
        raise ConfigError(f"bad --auto-budget-gib {args.auto_budget_gib!r}: budgets must be positive")
    return found


def auto_partitions(args, budget_gib: float) -> tuple[int, int]:
    """The (layer, head) partitions the automatic choice makes for the full-depth model's fused-head step
    at `budget_gib` (simulated); ConfigError when even the smallest do not fit."""
    from streambp_core.measure.units import GIB
    from streambp_core.step.search.partitions import fitting_partitions

    spec = StepSpec.of(model=args.model, method="streambp", seq_len_tokens=args.seq_len, head_mode="fused")
    chosen = fitting_partitions(spec, int(budget_gib * GIB))
    return chosen.stream.partition_size, chosen.stream.head_partition_size


def measure(args, chosen: list[tuple[str, int, int, str, float | None]]) -> list[dict]:
    """One row per variant of `chosen` (see COLUMNS)."""
    from streambp_core.step.estimate.ops import meta_step_ops

    rows, reference = [], None
    for method, partition, head, mode, budget in chosen:
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
                                       "" if budget is None else f"{budget:g}", f"{figures[0] / 1e12:.3f}",
                                       figures[1], figures[2], *ratios, "simulated"), strict=True)))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the rows (and write them with --out); bad input is one `error:` line and exit code 2."""
    args = parse_args(argv)
    return emit_rows(lambda: measure(args, variants(args)), args.out, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
