"""`reproduce table6`: gradient precision in the style of the paper's Table 6, measured on the CPU with
`streambp_core.verify`. Rows go to `table6.csv`; `section` writes the README part.

Steps of `precision_rows`:
1. Build the model in float64 and run plain backprop: the float64 reference.
2. Cast it to float32; run plain, checkpoint and streambp: their error against the float64 reference.
3. Round the weights to bfloat16 values (kept in float32) and run plain in float32: the fp32 reference
   of the bf16 runs (the paper's "pure-fp32 checkpointed baseline"; checkpointing does not change it).
4. Cast to bfloat16; run checkpoint (the bf16 baseline) and streambp: their error against step 3.
Each error is ||g - g_ref|| / ||g_ref|| over a group of parameters: the LM head, and everything else
(decoder layers, embeddings, final norm), as the paper reports them.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from streambp_bench.paper.prose import prose
from streambp_bench.paper.shared import Settings, sources
from streambp_bench.results import ResultRow, provenance
from streambp_core.models import build_model, load_config
from streambp_core.step.parts.batch import random_batch
from streambp_core.verify.compare import Gradients
from streambp_core.verify.methods import VerifySpec, run_step

GROUPS = ("lm_head", "layers")


def group_rel_err(grads: Gradients, reference: Gradients, group: str) -> float:
    """Relative error of the concatenated gradients of `group` ('lm_head' or the rest), in float64."""
    names = [n for n in reference if ("lm_head" in n) == (group == "lm_head")]
    diff = sum(float((grads[n].double() - reference[n].double()).pow(2).sum()) for n in names)
    norm = sum(float(reference[n].double().pow(2).sum()) for n in names)
    return (diff / norm) ** 0.5 if norm else float("nan")


def precision_rows(model_name: str, *, seq_len: int, partition_size: int, seed: int = 0) -> list[ResultRow]:
    """Rows of metric grad_rel_err_<group> (see the module docstring), source measured-cpu."""
    config = load_config(model_name)
    sizes = {"partition_size": partition_size, "head_partition_size": partition_size}
    spec = VerifySpec.of(model=model_name, seq_len_tokens=seq_len, dtype="float64", seed=seed, **sizes)
    batch = random_batch(vocab_size=config.vocab_size, seq_len=seq_len, batch_size=1, seed=seed + 1)
    model = build_model(config, dtype=torch.float64, seed=seed)
    reference = run_step(model, spec.reference, batch).grads
    model.to(torch.float32)
    runs = [
        (m, "float32", "plain float64", run_step(model, spec.step_of(m), batch).grads)
        for m in ("plain", "checkpoint", "streambp")
    ]
    streamed = {**sizes, "head_mode": spec.step_of("streambp").stream.head_mode}  # streambp's rows' cells
    rows = _rows(model_name, seq_len, streamed, runs, reference)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    reference = run_step(model, spec.reference, batch).grads
    model.to(torch.bfloat16)
    runs = [
        (m, "bfloat16", "plain float32, bf16-rounded weights", run_step(model, spec.step_of(m), batch).grads)
        for m in ("checkpoint", "streambp")
    ]
    return rows + _rows(model_name, seq_len, streamed, runs, reference)


def _rows(model_name, seq_len, streamed, runs, reference) -> list[ResultRow]:
    rows = []
    for method, dtype, reference_name, grads in runs:
        partitioned = streamed if method == "streambp" else {}
        for group in GROUPS:
            rows.append(
                ResultRow(
                    method=method,
                    model=model_name,
                    seq_len_tokens=seq_len,
                    dtype=dtype,
                    **partitioned,
                    metric=f"grad_rel_err_{group}",
                    value=group_rel_err(grads, reference, group),
                    error=f"reference: {reference_name}",
                    **provenance("measured-cpu", "cpu"),
                )
            )
    return rows


def run(settings: Settings) -> list[Path]:
    """Measure `precision_rows` on a tiny model and write them to table6.csv."""
    rows = precision_rows("tiny/llama", seq_len=128 if settings.quick else 1024, partition_size=100)
    results = settings.csv("table6")
    results.append_many(rows)
    return [results.path]


def section(frame: pd.DataFrame) -> list[str]:
    """The README section: each run's error per parameter group against its reference."""
    lines = [
        "## Table 6 — gradient precision (" + sources(frame) + ")",
        "",
        prose("table6-errors"),
        "",
        "| model | tokens | method | dtype | reference | lm_head | layers |",
        "|---|---|---|---|---|---|---|",
    ]
    for (model, length, method, dtype), rows in frame.groupby(
        ["model", "seq_len_tokens", "method", "dtype"], sort=False
    ):
        err = {r["metric"].removeprefix("grad_rel_err_"): r["value"] for _, r in rows.iterrows()}
        reference = rows["error"].iloc[0].removeprefix("reference: ")
        head, layers = err.get("lm_head", float("nan")), err.get("layers", float("nan"))
        cells = f"{method} | {dtype} | {reference} | {head:.1e} | {layers:.1e}"
        lines.append(f"| {model} | {length:,} | {cells} |")
    return lines + [""]
