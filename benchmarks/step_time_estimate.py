"""Estimated step time (roofline, `streambp_core.step.estimate.roofline`) next to measured CUDA step times.

    python benchmarks/step_time_estimate.py --measured results/gpu/selfcheck-h200.csv \\
        --out results/benchmarks/step_time_estimate.csv
    python benchmarks/step_time_estimate.py --gpu h100 --model Qwen/Qwen3-4B --seq-len 16384,32768 \\
        --methods checkpoint,streambp --ps-head 100,1024

With `--measured`: every `measured-cuda` step_time row of the CSV is estimated with its own settings
(model, method, length, batch, partitions, dtype; the GPU from the row's device name) and written with
the ratio estimated / measured. Otherwise: an estimate for each method and length given (layer partition
T/3 unless `--ps`). The ops come from one step on meta tensors of the model cut to two depths whole
periods of its layer pattern apart (one and two layers on a uniform model), scaled to the full depth
(`streambp_core.step.estimate.roofline.estimate_by_depth`), with the code installed here: a measured row taken
on other code is compared with what this code would do. Rows are labelled `estimated`. Bad input
(options, model, GPU, a --measured file that is not a results CSV) is one `error:` line and exit code 2,
before any estimate.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from csv_out import emit_rows

from streambp_bench import options as opt
from streambp_bench.tokens import UNITS, parse_token_list
from streambp_core.config import ConfigError, StepSpec
from streambp_core.models.config_file import precheck_model

COLUMNS = ("gpu", "model", "method", "seq_len_tokens", "batch_size", "partition_size",
           "head_partition_size", "head_mode", "estimated_ms", "matmul_ms", "attention_ms", "other_ms",
           "launch_ms", "launches", "measured_ms", "estimated_vs_measured", "code", "source")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--measured", type=Path,
                        help="results CSV whose measured-cuda step_time rows to estimate")
    parser.add_argument("--gpu", default="h200", help="h100, h200, a100 or a800 (without --measured)")
    parser.add_argument("--model", default="Qwen/Qwen3-1.7B")
    parser.add_argument("--seq-len", default="16384,32768", help=f"comma-separated lengths ({UNITS})")
    parser.add_argument("--methods", default="checkpoint,streambp")
    opt.add_step_arguments(parser, ps=None, ps_head="1024", head_mode="auto")  # --ps not given: seq_len / 3
    parser.add_argument("--out", type=Path, help="CSV file for the rows (overwritten); none: print only")
    return parser.parse_args(argv)


def code_version() -> str:
    """`git describe --always --dirty` of the streambp_core being run (the code whose ops are estimated)."""
    import subprocess

    import streambp_core

    where = Path(streambp_core.__file__).parent
    done = subprocess.run(["git", "-C", str(where), "describe", "--always", "--dirty"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() or "unknown"


def gpu_key(device_name: str) -> str:
    """'NVIDIA H200' -> 'h200'; ConfigError for a GPU without datasheet figures here."""
    from streambp_core.step.estimate.roofline import GPU_MODELS

    for key in GPU_MODELS:
        if key in device_name.lower():
            return key
    raise ConfigError(f"no datasheet figures for the GPU {device_name!r}; known: {', '.join(GPU_MODELS)}")


NEEDED = ("metric", "source", "status", "device_name", "model", "method", "seq_len_tokens", "batch_size",
          "partition_size", "head_partition_size", "dtype", "step_time_ms")
"""The columns of a results CSV that --measured reads."""


def measured_settings(path: Path) -> list[dict]:
    """Settings and time of each measured-cuda step_time row of a results CSV (ConfigError when it is
    not one)."""
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        missing = [column for column in NEEDED if column not in (reader.fieldnames or ())]
        if missing:
            raise ConfigError(f"--measured {path} is not a results CSV: no column {', '.join(missing)}")
        rows = [r for r in reader
                if r["metric"] == "step_time" and r["source"] == "measured-cuda" and r["status"] == "ok"]
    return [dict(gpu=gpu_key(r["device_name"]), model=r["model"], method=r["method"],
                 seq_len_tokens=int(r["seq_len_tokens"]), batch_size=int(r["batch_size"]),
                 partition_size=int(r["partition_size"]), head_partition_size=int(r["head_partition_size"]),
                 head_mode=r.get("head_mode") or "", dtype=r["dtype"],
                 measured_ms=float(r["step_time_ms"]))
            for r in rows]


def requested_settings(args) -> list[dict]:
    """One setting per length, method and (streambp) head partition given."""
    from streambp_core.step.estimate.roofline import gpu_model

    gpu_model(args.gpu)
    lengths = parse_token_list(args.seq_len)
    sizes = opt.step_fields({"ps": args.ps, "ps_head": args.ps_head}, listed=("ps_head",), automatic=False)
    heads = sizes["head_partition_size"]
    variants = [(method, head) for method in args.methods.split(",")
                for head in (heads[:1] if method == "checkpoint" else heads)]
    return [dict(gpu=args.gpu, model=args.model, method=method, seq_len_tokens=length, batch_size=1,
                 partition_size=sizes.get("partition_size") or -(-length // 3), head_partition_size=head,
                 head_mode=args.head_mode if method == "streambp" else "", dtype="bfloat16", measured_ms=None)
            for length in lengths for method, head in variants]


def check_settings(settings: list[dict]) -> list[dict]:
    """`settings`, each checked as a step spec (ConfigError, one line) before any estimate runs."""
    if not settings:
        raise ConfigError("nothing to estimate: no lengths, methods or measured-cuda step_time rows")
    for item in settings:
        precheck_model(item["model"])
        head = {"head_mode": item["head_mode"]} if item["head_mode"] else {}
        StepSpec.of(model=item["model"], method=item["method"], seq_len_tokens=item["seq_len_tokens"],
                    batch_size=item["batch_size"], partition_size=item["partition_size"],
                    head_partition_size=item["head_partition_size"], dtype=item["dtype"], **head)
    return settings


def estimate_row(settings: dict) -> dict:
    """One output row (see COLUMNS) for one step's settings."""
    import torch

    from streambp_core.models.load import load_config
    from streambp_core.step.estimate.ops import meta_step_ops
    from streambp_core.step.estimate.roofline import estimate_by_depth, gpu_model
    from streambp_core.step.parts.depth import with_depth

    config = load_config(settings["model"])
    options = {key: settings[key] for key in ("partition_size", "head_partition_size")}
    if settings["method"] == "streambp" and settings["head_mode"]:  # none given: the code's default
        options["head_mode"] = settings["head_mode"]
    dtype = getattr(torch, settings["dtype"])

    def record(depth: int):
        return meta_step_ops(with_depth(config, depth), settings["method"], settings["seq_len_tokens"],
                             batch_size=settings["batch_size"], dtype=dtype, **options)

    est = estimate_by_depth(record, config, gpu_model(settings["gpu"]))
    measured = settings["measured_ms"]
    ratio = f"{est.step_time_ms / measured:.3f}" if measured else ""
    same = ("gpu", "model", "method", "seq_len_tokens", "batch_size", "partition_size", "head_partition_size")
    return dict(**{key: settings[key] for key in same},
                head_mode=options.get("head_mode", ""), estimated_ms=f"{est.step_time_ms:.1f}",
                matmul_ms=f"{1e3 * est.matmul_s:.1f}", attention_ms=f"{1e3 * est.attention_s:.1f}",
                other_ms=f"{1e3 * est.other_s:.1f}", launch_ms=f"{1e3 * est.launch_s:.1f}",
                launches=est.launches, measured_ms=f"{measured:.1f}" if measured else "",
                estimated_vs_measured=ratio, code=code_version(), source=est.source)


def main(argv: list[str] | None = None) -> int:
    """Print the rows as they come (and write them with --out); bad input is one `error:` line, exit 2."""
    args = parse_args(argv)

    def rows():  # settings checked here, at once; each estimate made as its row is printed
        settings = measured_settings(args.measured) if args.measured else requested_settings(args)
        return map(estimate_row, check_settings(settings))

    return emit_rows(rows, args.out, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
