"""`reproduce table4`: the paper's Table 4 (Qwen3-8B SFT with AdamW across 3-8 GPUs, ZeRO-2) side by side,
and beyond it ZeRO-3 for Qwen3-8B/14B/32B on 8 GPUs, with and without checkpoint offload.

Every cell is a simulated max-length search of one rank (`StepSpec.gpus`/`shard`, confirmed at full
depth), 80 GiB per GPU, bf16, AdamW, ps 500, ps-head 100, one sequence per rank:
- `deepspeed-zero2`: what DeepSpeed ZeRO-2 allocates with bf16 (the paper's engine: replicated bf16
  weights, fp32 master weights and AdamW moments and a bf16 gradient partition per rank, one gradient
  bucket), the paper's setting for both methods;
- `zero2`, `zero3`: torch FSDP2 with pure-bf16 AdamW (bf16 moments, no master copy), what this project's
  engine runs (`streambp_core.parallel`);
- ZeRO-3 + offload: `zero3` with `offload="checkpoints"` (what a method keeps between forward and
  backward lives in host memory);
- `deepspeed-zero3`: what DeepSpeed ZeRO-3 allocates with bf16, beside FSDP2's zero3 on 8 GPUs.
Both methods run on DeepSpeed itself (`streambp_core.parallel.deepspeed`: each gradient reduced as its
layer's backward ends, as DeepSpeed schedules plain backprop's), so the `ds` cells are what this
project's DeepSpeed engine allocates too.

The checkpoint column under DeepSpeed ZeRO-2's allocations is compared with the paper at 4-8 GPUs
(`checkpoint_agreement`: within ±15 %); the 3-GPU cell is a known difference, reported: the paper's
column grows less from 3 to 8 GPUs than ZeRO-2's sharding of 14 bytes of state per parameter frees.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from streambp_bench.paper import plots, published
from streambp_bench.paper.prose import prose
from streambp_bench.paper.shared import Settings, max_len_rows
from streambp_core.config import StepSpec

METHODS = ("checkpoint", "streambp")
ENGINES = ("deepspeed-zero2", "zero2")
"""Table 4's engines: the paper's (DeepSpeed ZeRO-2's allocations) and this project's (FSDP2 zero2)."""
ZERO3_MODELS = ("Qwen/Qwen3-8B", "Qwen/Qwen3-14B", "Qwen/Qwen3-32B")
ZERO3_GPUS = 8
ZERO3_ENGINES = ("zero3", "deepspeed-zero3")
"""The ZeRO-3 rows' engines: FSDP2's (with and without checkpoint offload) and DeepSpeed's allocations."""
AGREEMENT = 0.15
"""The checkpoint column under DeepSpeed ZeRO-2's allocations agrees with the paper's within this."""
AGREEMENT_GPUS = (4, 5, 6, 7, 8)
"""Where it is compared; 3 GPUs is a known difference (module docstring)."""


def table4_specs(quick: bool = False) -> list[StepSpec]:
    """Every cell's step (max-length searches vary the length): Table 4, then the ZeRO-3 rows."""
    if quick:
        base = {"model": "tiny/llama", "partition_size": 32, "head_partition_size": 16}
        gpus, zero3_models, zero3_gpus = (2,), ("tiny/llama",), 2
    else:
        base = {"model": "Qwen/Qwen3-8B"}
        gpus, zero3_models, zero3_gpus = published.TABLE4_GPUS, ZERO3_MODELS, ZERO3_GPUS
    common = {k: v for k, v in base.items() if k != "model"}
    specs = [StepSpec.of(**base, method=method, optimizer="adamw", gpus=n, shard=engine)
             for engine in ENGINES for method in METHODS for n in gpus]
    for shard, offload in (("zero3", "none"), ("zero3", "checkpoints"), ("deepspeed-zero3", "none")):
        specs += [StepSpec.of(model=model, method=method, optimizer="adamw", gpus=zero3_gpus, shard=shard,
                              offload=offload, **common)
                  for model in zero3_models for method in METHODS]
    return specs


def checkpoint_agreement(frame: pd.DataFrame) -> dict[int, float]:
    """Ours / the paper's checkpoint length under DeepSpeed ZeRO-2's allocations, per GPU count of
    Table 4 present in `frame` (Qwen3-8B, no offload)."""
    data = frame[(frame["metric"] == "max_len") & (frame["status"] == "ok")]
    data = data[data["model"] == "Qwen/Qwen3-8B"]
    ratios = {}
    for n in published.TABLE4_GPUS:
        ours = _cell(data, method="checkpoint", shard="deepspeed-zero2", gpus=n, offload="none")
        if ours:
            ratios[n] = ours / (paper_k("checkpoint", n) * 1000)
    return ratios


def _agreement_line(frame: pd.DataFrame) -> list[str]:
    ratios = checkpoint_agreement(frame)
    compared = {n: r for n, r in ratios.items() if n in AGREEMENT_GPUS}
    if not compared:
        return []
    within = all(abs(r - 1) <= AGREEMENT for r in compared.values())
    low, high = min(compared.values()), max(compared.values())
    text = (f"Checkpoint under DeepSpeed ZeRO-2's allocations against the paper at "
            f"{min(compared)}-{max(compared)} GPUs: ratios {low:.2f}-{high:.2f}, "
            f"{'within' if within else 'outside'} ±{AGREEMENT:.0%}.")
    if 3 in ratios:
        text += (f" At 3 GPUs {ratios[3]:.2f}, a known difference: the paper's column grows less from 3 to "
                 "8 GPUs than ZeRO-2's sharding of the model state frees (below).")
    return [text, ""]


def paper_k(method: str, gpus: int) -> float | None:
    """The paper's Table 4 cell, thousands of tokens (None outside it)."""
    if gpus not in published.TABLE4_GPUS or method not in published.TABLE4_MAX_LEN_K:
        return None
    return published.TABLE4_MAX_LEN_K[method][published.TABLE4_GPUS.index(gpus)]


def _cell(frame: pd.DataFrame, **match) -> float | None:
    rows = frame
    for column, value in match.items():
        rows = rows[rows[column] == value]
    return float(rows["value"].iloc[0]) if len(rows) else None


def _k(tokens: float | None) -> str:
    return "–" if tokens is None or pd.isna(tokens) else f"{tokens / 1000:.1f}k"


def _ratio(ours: float | None, theirs_k: float | None) -> str:
    return "–" if not ours or not theirs_k else f"{ours / (theirs_k * 1000):.2f}"


def section(frame: pd.DataFrame) -> list[str]:
    """The README section: Table 4 side by side, then the ZeRO-3 rows."""
    data = frame[(frame["metric"] == "max_len") & (frame["status"] == "ok")]
    sources = ", ".join(sorted(set(data["source"]))) or "–"
    lines = [
        f"## Table 4 — Qwen3-8B SFT with AdamW across GPUs, ZeRO-2, 80 GiB per GPU ({sources})",
        "",
        prose("table4-engines"),
        "",
        "| GPUs | ckpt paper | ckpt ds | ratio | ckpt fsdp2 | streambp paper | streambp ds | ratio "
        "| streambp fsdp2 | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    eight_b = data[data["model"] == "Qwen/Qwen3-8B"]
    for n in sorted(set(eight_b[eight_b["shard"].isin(ENGINES)]["gpus"])):
        cells = {(m, e): _cell(eight_b, method=m, shard=e, gpus=n, offload="none")
                 for m in METHODS for e in ENGINES}
        ck, sb = paper_k("checkpoint", n), paper_k("streambp", n)
        lines.append(
            f"| {n} | {ck or '–'}k | {_k(cells['checkpoint', 'deepspeed-zero2'])} "
            f"| {_ratio(cells['checkpoint', 'deepspeed-zero2'], ck)} | {_k(cells['checkpoint', 'zero2'])} "
            f"| {sb or '–'}k | {_k(cells['streambp', 'deepspeed-zero2'])} "
            f"| {_ratio(cells['streambp', 'deepspeed-zero2'], sb)} | {_k(cells['streambp', 'zero2'])} "
            f"| {_ratio(cells['streambp', 'zero2'], sb)} |"
        )
    return lines + ["", *_agreement_line(frame), *_state_lines(eight_b), "", *_zero3_lines(data), "",
                    "![](table4-maxlen.png)", ""]


def _state_lines(eight_b: pd.DataFrame) -> list[str]:
    """Per-rank model state (weights + grads + optimizer, GiB) of the checkpoint cells, per engine, and how
    much each engine's checkpoint length grows from the fewest GPUs to the most, beside the paper's."""
    rows = eight_b[(eight_b["method"] == "checkpoint") & eight_b["shard"].isin(ENGINES)]
    if not len(rows):
        return []
    state = rows.assign(state=rows["weights_gib"] + rows["grads_gib"] + rows["optimizer_gib"])
    gpus = sorted(set(state["gpus"]))
    lines = ["Why the checkpoint cells differ by engine: each rank's model state at the peak (weights + "
             "gradients + optimizer, GiB; the rest is the step's activations, mostly the logits):", "",
             "| engine | " + " | ".join(f"{n} GPUs" for n in gpus) + " |",
             "|---|" + "---|" * len(gpus)]
    for engine in ENGINES:
        cells = [_cell(state.rename(columns={"value": "length", "state": "value"}), shard=engine, gpus=n)
                 for n in gpus]
        lines.append(f"| {engine} | " + " | ".join("–" if c is None else f"{c:.1f}" for c in cells) + " |")
    first, last = gpus[0], gpus[-1]
    ends = {e: (_cell(rows, shard=e, gpus=first), _cell(rows, shard=e, gpus=last)) for e in ENGINES}
    growth = {e: None if None in pair else pair[1] - pair[0] for e, pair in ends.items()}
    text = (f"From {first} to {last} GPUs the checkpoint length grows by {_k(growth['deepspeed-zero2'])} "
            f"under DeepSpeed ZeRO-2's allocations and {_k(growth['zero2'])} under FSDP2 zero2")
    low, high = paper_k("checkpoint", first), paper_k("checkpoint", last)
    if low is not None and high is not None:
        text += (f"; the paper's by {high - low:.1f}k (DeepSpeed shards 14 bytes of state per parameter: "
                 "fp32 master weights and moments, bf16 gradients)")
    return lines + ["", text + "."]


def _zero3_lines(data: pd.DataFrame) -> list[str]:
    zero3 = data[data["shard"].isin(ZERO3_ENGINES)]
    gpus = "/".join(str(n) for n in sorted(set(zero3["gpus"]))) or str(ZERO3_GPUS)
    lines = [
        f"Beyond the paper: ZeRO-3 on {gpus} GPUs: torch FSDP2 (pure-bf16 AdamW), with and without "
        "checkpoint offload (host memory is reported per rank, not budgeted), and DeepSpeed ZeRO-3's "
        "allocations with bf16 (`ds`: fp32 master weights and moments, one layer gathered and its prefetch):",
        "",
        "| model | ckpt | streambp | ckpt + offload | streambp + offload | ckpt ds | streambp ds |",
        "|---|---|---|---|---|---|---|",
    ]
    present = list(dict.fromkeys(zero3["model"]))
    for model in sorted(present, key=lambda m: ZERO3_MODELS.index(m) if m in ZERO3_MODELS else len(present)):
        fsdp = zero3[zero3["shard"] == "zero3"]
        cells = [_k(_cell(fsdp, model=model, method=m, offload="none")) for m in METHODS]
        for method in METHODS:
            host = _cell(fsdp.assign(value=fsdp["host_peak_gib"]), model=model, method=method,
                         offload="checkpoints")
            length = _k(_cell(fsdp, model=model, method=method, offload="checkpoints"))
            cells.append(length if host is None or pd.isna(host) else f"{length} (host {host:.0f} GiB)")
        cells += [_k(_cell(zero3, model=model, method=m, shard="deepspeed-zero3", offload="none"))
                  for m in METHODS]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return lines


def plot(frame: pd.DataFrame):
    """Max length vs GPUs: the paper's lines and ours (DeepSpeed ZeRO-2's allocations, FSDP2 zero2)."""
    import matplotlib.pyplot as plt

    data = frame[(frame["metric"] == "max_len") & frame["shard"].isin(ENGINES) & (frame["offload"] == "none")]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method, color in zip(METHODS, ("tab:orange", "tab:blue"), strict=True):
        ax.plot(published.TABLE4_GPUS, [k * 1000 for k in published.TABLE4_MAX_LEN_K[method]], ":",
                marker="x", color=color, label=f"{method} paper")
        for engine, style in zip(ENGINES, ("--", "-"), strict=True):
            rows = data[(data["method"] == method) & (data["shard"] == engine)].sort_values("gpus")
            if len(rows):
                ax.plot(rows["gpus"], rows["value"], style, marker="o", color=color,
                        label=f"{method} {engine} (simulated)")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("max length per GPU, tokens")
    ax.set_title("Table 4: Qwen3-8B SFT, AdamW, 80 GiB per GPU")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def run(settings: Settings) -> list[Path]:
    """Search every cell (`table4_specs`), upsert the rows into table4.csv, draw table4-maxlen.png."""
    results = settings.csv("table4")
    results.append_many(max_len_rows(table4_specs(settings.quick), settings))
    return [plots.save(plot(results.load()), settings.out_dir / "table4-maxlen.png")]
