"""The StreamBP paper's published numbers, as data (its Fig. 3 and Tables 1, 3, 4 and 6).

Source: Luo, Li, Zhao, Li, "StreamBP: Memory-Efficient Exact Backpropagation for Long Sequence Training
of LLMs", arXiv 2506.03077 (NeurIPS 2025); measured on an A800-80GB, bf16 weights and grads, batch 1,
logits partition 100, layer partition 500 (max length) or T/3 (timing).

- `FIG3_MAX_LEN_K`: BP-only maximum sequence length, thousands of tokens (Fig. 3), and
  `FIG3_WEIGHTS_GRADS_GIB` the figure's weights+grads line.
- `TABLE1_TIME_S`: BP time of Qwen3-4B in seconds per length (Table 1); None = OOM.
- `TABLE3_MAX_LEN_K`: training max length with optimizer, thousands (Table 3); None = "–" (not run).
- `TABLE4_MAX_LEN_K`: Qwen3-8B ZeRO-2 SFT max length per GPU count, thousands (Table 4).
- `TABLE6_REL_ERR`: gradient relative errors (Table 6).
Lengths in the paper's "k" are thousands of tokens (the tables print 0.44k, 110k, ...).
"""

from __future__ import annotations

PAPER = "StreamBP (arXiv 2506.03077)"

FIG3_MODELS: dict[str, tuple[str, int]] = {
    "Qwen3-8B": ("Qwen/Qwen3-8B", 0),
    "Qwen3-14B": ("Qwen/Qwen3-14B", 0),
    "Qwen3-32B LoRA r32": ("Qwen/Qwen3-32B", 32),
}
"""Fig. 3 panels: label -> (preset, LoRA rank; 0 = full-parameter gradients)."""

FIG3_MAX_LEN_K: dict[str, dict[str, float]] = {
    "Qwen3-8B": {"plain": 4.7, "checkpoint": 20.0, "streambp": 110.0},
    "Qwen3-14B": {"plain": 1.7, "checkpoint": 9.0, "streambp": 40.0},
    "Qwen3-32B LoRA r32": {"plain": 0.44, "checkpoint": 5.7, "streambp": 16.0},
}
FIG3_WEIGHTS_GRADS_GIB: dict[str, float] = {"Qwen3-8B": 30.5, "Qwen3-14B": 55.0, "Qwen3-32B LoRA r32": 63.0}

TABLE1_LENGTHS_K = (6, 9, 12, 15, 18, 21, 24, 27)
TABLE1_TIME_S: dict[str, tuple[float | None, ...]] = {
    "plain": (2.0, None, None, None, None, None, None, None),
    "checkpoint": (2.5, 4.7, 7.4, 10.8, 14.7, 19.3, 24.3, None),
    "mst": (2.6, 4.9, 7.6, 11.2, 15.2, 20.3, 25.2, 31.8),
    "streambp": (2.6, 4.7, 7.0, 10.0, 13.2, 17.2, 21.2, 25.8),
}

TABLE3_CELLS: dict[str, tuple[str, int]] = {
    "4B full": ("Qwen/Qwen3-4B", 0),
    "4B LoRA": ("Qwen/Qwen3-4B", 32),
    "8B full": ("Qwen/Qwen3-8B", 0),
    "8B LoRA": ("Qwen/Qwen3-8B", 32),
    "14B LoRA": ("Qwen/Qwen3-14B", 32),
    "32B LoRA": ("Qwen/Qwen3-32B", 32),
}
"""Table 3 columns: label -> (preset, LoRA rank; 0 = full parameters, pure-bf16 AdamW)."""
TABLE3_GROUP_SIZE = 8
"""GRPO completions per prompt in Table 3."""

_T3 = {
    ("sft", "plain"): (7.0, 7.1, 3.4, 5.1, 2.9, 0.4),
    ("sft", "checkpoint"): (28.5, 36.5, 15.7, 30.6, 23.0, 5.9),
    ("sft", "streambp"): (200.0, 247.0, 72.0, 142.4, 84.6, 16.3),
    ("grpo", "plain"): (0.9, 1.0, None, 0.7, 0.4, None),
    ("grpo", "checkpoint"): (8.5, 12.1, None, 9.5, 6.9, None),
    ("grpo", "streambp"): (18.2, 27.5, None, 16.5, 10.1, None),
    ("dpo", "plain"): (3.1, 3.5, None, 2.5, 1.4, 0.2),
    ("dpo", "checkpoint"): (18.7, 32.2, None, 25.5, 18.5, 4.4),
    ("dpo", "streambp"): (57.2, 100.2, None, 60.9, 36.9, 7.8),
}
TABLE3_MAX_LEN_K: dict[tuple[str, str, str], float | None] = {
    (objective, method, cell): value
    for (objective, method), values in _T3.items()
    for cell, value in zip(TABLE3_CELLS, values, strict=True)
}
"""(objective, method, cell label) -> thousands of tokens, None where the paper has no number."""

TABLE4_GPUS = (3, 4, 5, 6, 7, 8)
TABLE4_MAX_LEN_K: dict[str, tuple[float, ...]] = {
    "checkpoint": (18.6, 20.5, 22.3, 23.1, 23.5, 23.7),
    "streambp": (92.4, 112.0, 121.5, 128.7, 131.4, 131.8),
}

FIG5_PARTITION_SIZES = (500, 1000, 2000, 5000)
"""Fig. 5 layer partition sizes (Qwen3-8B)."""

TABLE6_REL_ERR: dict[str, float] = {
    "streambp fp32 vs fp32 checkpoint": 0.0004,
    "bf16 lm_head (streambp = baseline)": 0.015,
    "bf16 layers (streambp = baseline)": 0.066,
}


def max_len_records() -> list[dict[str, object]]:
    """Every published maximum length as a results-like record: model, lora_rank (None: full
    parameters), objective, optimizer, budget_gib (80, the A800), offload (none), method and value
    (tokens): Fig. 3
    (BP only: sft, no optimizer) and Table 3 (AdamW)."""
    base = {"budget_gib": 80.0, "offload": "none"}
    fig3 = [
        {**base, "model": FIG3_MODELS[label][0], "lora_rank": FIG3_MODELS[label][1] or None,
         "objective": "sft", "optimizer": "none", "method": method, "value": k * 1000}
        for label, values in FIG3_MAX_LEN_K.items()
        for method, k in values.items()
    ]
    table3 = [
        {**base, "model": TABLE3_CELLS[cell][0], "lora_rank": TABLE3_CELLS[cell][1] or None,
         "objective": objective, "optimizer": "adamw", "method": method, "value": k * 1000}
        for (objective, method, cell), k in TABLE3_MAX_LEN_K.items()
        if k
    ]
    return fig3 + table3
