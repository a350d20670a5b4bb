"""Profile one training step per method and head partition: where the step time goes, for tuning.

    python benchmarks/profile_step.py --model Qwen/Qwen3-1.7B --seq-len 16384 \\
        --methods checkpoint,streambp --ps-head 100,1024 --out results/gpu/profile.csv
    python benchmarks/profile_step.py --model tiny/qwen3 --seq-len 512 --device cpu --dtype float32

Per (method, head partition; layer partition seq_len / 3 unless `--ps`): the step time over a few timed
repeats (`streambp_core.step.run.timing`: CUDA events on a GPU, the wall clock on a CPU), then one profiled
step whose kernels are summed by class (attention forward/backward, GEMM, copy, other;
`streambp_core.measure.kernels`). Prints a table and, with `--out`, upserts results rows into that CSV (the
project's results schema: metric `step_time` and `kernel_ms_<class>`, source measured-cuda or measured-cpu).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from streambp_bench import options as opt
from streambp_bench.errors import USER_ERRORS, print_error
from streambp_bench.results import ResultRow, ResultsFile, provenance, row_head_mode
from streambp_bench.specs import writable_results
from streambp_bench.tokens import UNITS, token_count
from streambp_core.config import ConfigError, StepSpec
from streambp_core.measure.cuda import cuda_available
from streambp_core.measure.kernels import profile_kernel_time
from streambp_core.models.config_file import precheck_model
from streambp_core.models.load import build_model
from streambp_core.step.run.setup import build_setup
from streambp_core.step.run.timing import spec_step, time_step


def parse_args() -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="Qwen/Qwen3-1.7B")
    parser.add_argument("--seq-len", type=token_count("length"), default=16384, help=f"tokens ({UNITS})")
    parser.add_argument("--methods", default="checkpoint,streambp")
    opt.add_step_arguments(parser, ps=None, ps_head="100", dtype="bfloat16", attn="auto", head_mode="auto")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))  # --ps not given: T / 3
    parser.add_argument("--out", type=Path, help="results CSV to upsert the rows into")
    return parser.parse_args()


def profile_rows(model, spec: StepSpec, args, device: str):
    """The step_time row and one kernel_ms_<class> row per class of one step of `spec` on `model`."""
    stream = spec.stream
    common = dict(method=spec.method, model=args.model, seq_len_tokens=args.seq_len, batch_size=1,
                  partition_size=stream.partition_size, head_partition_size=stream.head_partition_size,
                  dtype=args.dtype, attn=args.attn, head_mode=row_head_mode(spec),
                  **provenance(f"measured-{device}", _device_name(device)))
    with spec_step(build_setup(spec, model.config, device, model=model)) as step:
        timing = time_step(step, device, warmup=1, repeats=3)
        classes = profile_kernel_time(step, device)
    model.zero_grad(set_to_none=True)
    rows = [ResultRow(metric="step_time", value=timing.p50_ms, **timing.columns(), **common)]
    rows += [ResultRow(metric=f"kernel_ms_{c.kernel_class}", value=c.self_time_ms, **common) for c in classes]
    return rows


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def variants(args: argparse.Namespace, partition: int, head_partitions: tuple[int, ...]) -> list[StepSpec]:
    """The step of each (method, LM-head partition) to profile, checked (ConfigError) before any work."""
    precheck_model(args.model)
    return [StepSpec.of(model=args.model, method=method, seq_len_tokens=args.seq_len,
                        partition_size=partition, head_partition_size=head, dtype=args.dtype, attn=args.attn,
                        head_mode=args.head_mode)
            for method in args.methods.split(",")
            for head in (head_partitions if method != "checkpoint" else (100,))]


def main() -> int:
    """Run the profile; bad input (options, model, --out) is one `error:` line and exit code 2."""
    args = parse_args()
    try:
        return run(args)
    except USER_ERRORS as error:
        print_error(error)
        return 2


def run(args: argparse.Namespace) -> int:
    """Profile every variant and print (and with --out, upsert) its rows."""
    device = ("cuda" if cuda_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not cuda_available():
        raise ConfigError("--device cuda: no CUDA device is available; use --device cpu")
    sizes = opt.step_fields({"ps": args.ps, "ps_head": args.ps_head}, listed=("ps_head",), automatic=False)
    partition = sizes.get("partition_size") or max(1, -(-args.seq_len // 3))
    chosen = variants(args, partition, sizes["head_partition_size"])
    writable_results(args.out)
    model = build_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    rows = []
    for spec in chosen:
        found = profile_rows(model, spec, args, device)
        head_partition = spec.stream.head_partition_size
        print(f"== {spec.method}, ps-head {head_partition}: {found[0].value:.1f} ms per step (median) at "
              f"{args.seq_len} tokens (partition {partition}, {found[0].source}, {found[0].device_name})")
        for row in found[1:]:
            print(f"   {row.metric.removeprefix('kernel_ms_'):18s} {row.value:9.1f} ms")
        rows += found
    if args.out:
        ResultsFile(args.out).append_many(rows)
        print(f"rows upserted into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
