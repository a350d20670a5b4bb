"""Our estimated step time (roofline, `streambp_core.step.step_estimate.estimate_step`) next to step
times the peers published for their own long-sequence setups, with the ratio and a calibration band.

    python benchmarks/published_step_time.py --out results/benchmarks/published_step_time.csv

Each setup (`SETUPS`) is the peer's recipe as close as this project's `StepSpec` comes: context
parallelism over the node's 8 GPUs as Ulysses sequence parallelism over 8 ranks (the same FLOPs per rank;
its all-to-alls over NVLink in place of a ring's sends), FSDP as ZeRO-3, activation checkpointing as the
`checkpoint` method, AdamW, bf16, batch 1. The estimate is one rank's step: its compute fitted in the
length, plus the all-to-alls, ZeRO's collectives and offload copies compute does not hide. A published
throughput (tokens/s/GPU) is turned into the step time it implies: tokens per step / (tokens/s/GPU x GPUs).

ratio = estimated / published. A roofline counts each op at a fixed fraction of the datasheet peak and
no stalls, so it comes out faster than a real step: `BAND` is the range a roofline typically lands in,
and `in_band` says whether this one does. Nothing here is tuned to a published number; the rows report
what the model gives. Rows are labelled `estimated` (ours) and `published` (theirs).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from csv_out import emit_rows

from streambp_core.config import StepSpec

COLUMNS = ("source", "setup", "model", "gpu", "gpus", "seq_len_tokens", "published_metric",
           "published_value", "published_step_s", "estimated_step_s", "estimated_tokens_per_s_per_gpu",
           "ratio", "band_low", "band_high", "in_band", "estimated_source", "published_source")
BAND = (0.80, 0.86)
"""Estimated / real step time a roofline typically gives (the calibration band)."""


@dataclass(frozen=True)
class Published:
    """One peer's published figure for one setup, and the spec of ours that stands for it."""

    source: str
    setup: str
    spec: StepSpec
    gpu: str
    metric: str
    """'s_per_step' or 'tokens_per_s_per_gpu'."""
    value: float

    def step_s(self) -> float:
        """The step time the published figure implies."""
        if self.metric == "s_per_step":
            return self.value
        return self.spec.seq_len_tokens * self.spec.batch_size / (self.value * self.spec.gpus)


def _spec(model: str, seq_len: int, offload: str) -> StepSpec:
    return StepSpec.of(model=model, method="checkpoint", seq_len_tokens=seq_len, gpus=8, sp=8,
                       shard="zero3", optimizer="adamw", offload=offload)


SETUPS = (
    Published("TRL PR #6846 (docs/source/long_context_training.md)",
              "TRL + accelerate: context parallel 8, FSDP, transformers checkpoint offload, chunked NLL; "
              "8 x H100; published 364-380 s/step, upper end used",
              _spec("Qwen/Qwen3-8B", 1_048_576, "checkpoints"), "h100", "s_per_step", 380.0),
    Published("torchtitan",
              "torchtitan: context parallel 8, FSDP, full activation checkpointing; 8 x H100 "
              "(the setup as assumed here: not published beside the figure)",
              _spec("meta-llama/Llama-3.1-8B", 131_072, "none"), "h100", "tokens_per_s_per_gpu", 1_071.0),
)


def row_of(published: Published) -> dict:
    """The CSV row of one published setup: our estimate beside it, their ratio and the band's verdict."""
    from streambp_core.step.estimate import gpu_model
    from streambp_core.step.step_estimate import estimate_step

    spec = published.spec
    estimated_s = estimate_step(spec, gpu_model(published.gpu)).step_time_ms / 1e3
    ratio = estimated_s / published.step_s()
    return {"source": published.source, "setup": published.setup, "model": spec.model,
            "gpu": published.gpu, "gpus": spec.gpus, "seq_len_tokens": spec.seq_len_tokens,
            "published_metric": published.metric, "published_value": published.value,
            "published_step_s": round(published.step_s(), 2), "estimated_step_s": round(estimated_s, 2),
            "estimated_tokens_per_s_per_gpu": round(spec.seq_len_tokens / (estimated_s * spec.gpus), 1),
            "ratio": round(ratio, 3), "band_low": BAND[0], "band_high": BAND[1],
            "in_band": BAND[0] <= ratio <= BAND[1], "estimated_source": "estimated",
            "published_source": "published"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", type=Path, help="CSV file for the rows (overwritten); none: print only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return emit_rows(lambda: (row_of(published) for published in SETUPS), args.out, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
