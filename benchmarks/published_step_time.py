"""Our estimated step time (roofline, `streambp_core.step.estimate.step_estimate.estimate_step`) next to step
times the peers published for their own long-sequence setups, with the ratio, the band every estimate
carries, and the regime the step is in.

    python benchmarks/published_step_time.py --out results/benchmarks/published_step_time.csv

Each setup (`SETUPS`) is the peer's recipe as close as this project's `StepSpec` comes: context
parallelism (a ring) as Ulysses sequence parallelism over as many ranks (the same attention FLOPs per
rank; its all-to-alls in place of the ring's sends), FSDP as ZeRO-3 over all GPUs, activation
checkpointing as the `checkpoint` method, AdamW, bf16, batch 1 per data-parallel group, the attention
kernel the peer's stack ran (`attn`: sdpa is cuDNN on Hopper, flash FlashAttention-2); a one-GPU
setup (axolotl) is `checkpoint` on one GPU without an optimizer step. The estimate is
one rank's step: its compute fitted in the length, plus the all-to-alls, ZeRO's collectives and offload
copies compute does not hide. A published throughput (tokens/s/GPU) is turned into the step time it
implies: the step's tokens (gpus / sp sequences) / (tokens/s/GPU x GPUs).

ratio = estimated / published; `estimate.STEP_BAND` (0.75-1.25) is the band every estimate carries, and
`in_band` says whether this row lies in it. Nothing here is tuned to a published number: the efficiencies
are the kernels' published ones (`step.estimate.attention_kernels`). A row the model does not reach names why
in `outside_model` (empty for the rows the band is held to). Rows are labelled `estimated` (ours) and
`published` (theirs).
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
           "ratio", "band_low", "band_high", "in_band", "regime", "attention_kernel", "outside_model",
           "estimated_source", "published_source")


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
    outside_model: str = ""
    """Why the model does not reach this row (empty: the band holds it)."""

    def step_s(self) -> float:
        """The step time the published figure implies: a throughput counts the tokens of a step (every
        data-parallel group's sequences: gpus / sp of them, each batch x length) over all its GPUs."""
        if self.metric == "s_per_step":
            return self.value
        return self.tokens() / (self.value * self.spec.gpus)

    def tokens(self) -> int:
        """Tokens of one step over all GPUs: gpus / sp sequences of batch x length."""
        return self.spec.seq_len_tokens * self.spec.batch_size * self.spec.gpus // self.spec.sp


def _spec(model: str, seq_len: int, offload: str, *, sp: int = 8, attn: str = "sdpa",
          gpus: int = 8) -> StepSpec:
    return StepSpec.of(model=model, method="checkpoint", seq_len_tokens=seq_len, gpus=gpus, sp=sp,
                       shard="zero3", optimizer="adamw", offload=offload, attn=attn)


_TRL = ("TRL PR #6846 (docs/source/long_context_training.md; "
        "examples/sft_qwen3_8b_1m_context/sft_qwen3_8b_1m_context.py)")
_TRL_SETUP = ("TRL SFT + accelerate: context parallel 8 (torch ring attention, SDPA: cuDNN on Hopper), FSDP2 "
              "over the 8 GPUs, gradient checkpointing with offload of each layer's input, chunked NLL, "
              "AdamW, bf16, batch 1, one 8 x H100 node")
_TRL_TABLE = ("TRL PR #6845 (the measured table of the first version of PR #6846, which condensed it: "
              "its Qwen3-8B 1M row, 364 s, is the 364-380 s published there)")
_TITAN = "torchtitan docs/performance.md, Table 2 (FSDP + CP + torch.compile + Float8, Llama 3.1 8B, 8 GPUs)"
_TITAN_SETUP = ("torchtitan: FSDP {fsdp} x context parallel {cp} (torch ring attention, FlashAttention-2: "
                "CP had no cuDNN before torchtitan PR #1000), full activation checkpointing, local batch 1, "
                "torch.compile, Float8 linears (estimated here as bf16), 8 x H100 96GB HBM2e at 500 W "
                "(Grand Teton; estimated as the H100 SXM5 datasheet part)")


_TITAN_RING = ("torch's ring attention as the table ran it (torch 1963fc8; "
               "torch/distributed/tensor/experimental/_attention.py, read at 0123248: causal load balancing "
               "on, K/V all-gathered once per call) makes the same FlashAttention-2 calls per ring step at "
               "CP 2, 4 and 8 (each rank's 32k queries causal, then 32k x 16k or 16k x 32k keys non-causal) "
               "and the T^2/(2 cp) pairs this model counts; its float32 merges of partial outputs and the "
               "float32 dK/dV ring of the backward (K/V at 32 heads: torchtitan repeats the 8 KV heads "
               "before SDPA) come to ~1.1 s at CP 4 and ~2.3 s at CP 8 at the HBM2e part's 2.4 TB/s, and its"
               " K/V all-gathers and dK/dV sends to at most ~0.6 s and ~1.3 s over NVLink, not the 11.7 s "
               "and 25.9 s missing. With this model's other parts taken as right, attention runs 1.2x its "
               "FlashAttention-2 time at CP 1-2 and 1.8-1.9x at CP 4-8 of the same table, a step at CP 4 "
               "that nothing published in the recipe explains (the 500 W cap and Float8 act on every row): "
               "not held to the band")


_AXOLOTL_3776 = ("axolotl PR #3776 (description's table for Qwen3-8B; "
                 "benchmarks/bench_checkpoint_activation_offload.py, mode gc)")
_AXOLOTL_3733 = "axolotl PR #3733 (description's table: Qwen3-8B full-param, single GPU, bf16)"
_AXOLOTL_SETUP = ("axolotl: Qwen3-8B, one GPU, transformers' gradient checkpointing (use_reentrant False), "
                  "flash_attention_2, bf16, batch 1, forward and backward only, logits_to_keep=1 "
                  "(estimated with the whole head and loss: ~3 % more FLOPs)")
_AXOLOTL_NO_GPU = ("no GPU is named in {where}, so no datasheet part can stand for it: estimated on the H100 "
                   "SXM5 part and not held to the band")


def _single(model: str, seq_len: int) -> StepSpec:
    """One GPU, activation checkpointing, no optimizer step, FlashAttention-2."""
    return StepSpec.of(model=model, method="checkpoint", seq_len_tokens=seq_len, optimizer="none",
                       attn="flash")

def _titan(fsdp: int, cp: int, seq_len: int, tokens_per_s_per_gpu: float) -> Published:
    return Published(_TITAN, _TITAN_SETUP.format(fsdp=fsdp, cp=cp),
                     _spec("meta-llama/Llama-3.1-8B", seq_len, "none", sp=cp, attn="flash"), "h100",
                     "tokens_per_s_per_gpu", tokens_per_s_per_gpu, _TITAN_RING if cp >= 4 else "")


SETUPS = (
    Published(_TRL, _TRL_SETUP + "; published 364-380 s/step, upper end used",
              _spec("Qwen/Qwen3-8B", 1_048_576, "checkpoints"), "h100", "s_per_step", 380.0),
    Published(_TRL, _TRL_SETUP + "; the example's docstring: Qwen3-0.6B takes 137 s/step on the same node",
              _spec("Qwen/Qwen3-0.6B", 1_048_576, "checkpoints"), "h100", "s_per_step", 137.0),
    Published(_TRL_TABLE, _TRL_SETUP + "; Qwen3-32B at 1M tokens: 1295 s/step, 60.8 GB/GPU",
              _spec("Qwen/Qwen3-32B", 1_048_576, "checkpoints"), "h100", "s_per_step", 1_295.0),
    Published(_TRL_TABLE, _TRL_SETUP.replace("context parallel 8", "context parallel 16").replace(
                  "over the 8 GPUs", "over the 16 GPUs").replace("one 8 x H100 node", "two 8 x H100 nodes")
              + "; Qwen3-8B at 2M tokens: 696 s/step",
              _spec("Qwen/Qwen3-8B", 2_097_152, "checkpoints", sp=16, gpus=16), "h100", "s_per_step", 696.0),
    _titan(8, 1, 32_768, 3_890.0),
    _titan(4, 2, 65_536, 2_540.0),
    _titan(2, 4, 131_072, 1_071.0),
    _titan(1, 8, 262_144, 548.0),
    Published(_AXOLOTL_3776, _AXOLOTL_SETUP + "; 8,192 tokens: 2,677.7 ms/step (3,059.4 tokens/s)",
              _single("Qwen/Qwen3-8B", 8_192), "h100", "s_per_step", 2.6777,
              _AXOLOTL_NO_GPU.format(where="the PR's results table or its benchmark script")),
    Published(_AXOLOTL_3776, _AXOLOTL_SETUP + "; 16,384 tokens: 6,417.9 ms/step (2,552.8 tokens/s)",
              _single("Qwen/Qwen3-8B", 16_384), "h100", "s_per_step", 6.4179,
              _AXOLOTL_NO_GPU.format(where="the PR's results table or its benchmark script")),
    Published(_AXOLOTL_3733, "axolotl: Qwen3-8B full-parameter, one GPU, gradient checkpointing without "
              "offload, bf16; batch, optimizer and attention kernel not stated (estimated as batch 1, no "
              "optimizer step, FlashAttention-2); 32,768 tokens: 1,954 tokens/s, 73.1 GB",
              _single("Qwen/Qwen3-8B", 32_768), "h100", "tokens_per_s_per_gpu", 1_954.0,
              _AXOLOTL_NO_GPU.format(where="the PR's results table")),
)


def row_of(published: Published) -> dict:
    """The CSV row of one published setup: our estimate beside it, their ratio and the band's verdict."""
    from streambp_core.step.estimate.roofline import STEP_BAND, gpu_model
    from streambp_core.step.estimate.step_estimate import estimate_step

    spec = published.spec
    estimate = estimate_step(spec, gpu_model(published.gpu))
    estimated_s = estimate.step_time_ms / 1e3
    ratio = estimated_s / published.step_s()
    return {"source": published.source, "setup": published.setup, "model": spec.model,
            "gpu": published.gpu, "gpus": spec.gpus, "seq_len_tokens": spec.seq_len_tokens,
            "published_metric": published.metric, "published_value": published.value,
            "published_step_s": round(published.step_s(), 2), "estimated_step_s": round(estimated_s, 2),
            "estimated_tokens_per_s_per_gpu": round(published.tokens() / (estimated_s * spec.gpus), 1),
            "ratio": round(ratio, 3), "band_low": STEP_BAND[0], "band_high": STEP_BAND[1],
            "in_band": STEP_BAND[0] <= ratio <= STEP_BAND[1], "regime": estimate.regime,
            "attention_kernel": estimate.kernel, "outside_model": published.outside_model,
            "estimated_source": "estimated", "published_source": "published"}


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
