"""`plan`'s answer: the ranking (fastest first), the misses nearest first, as JSON and as tables.

Every time is labelled estimated (`step.estimate.roofline`), every memory figure simulated
(`step.simulation.simulate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from streambp_bench.recipes.search import DOMINATED, FITS, GPU_OOM, HOST_OOM, PRUNED, REFUSED, Outcome
from streambp_bench.recipes.space import ENGINES
from streambp_core.measure.units import GIB

MISS_ORDER = {GPU_OOM: 0, HOST_OOM: 1, REFUSED: 2, PRUNED: 3}


@dataclass(frozen=True, kw_only=True)
class Setting:
    """What the figures of every recipe are read against."""

    gpu: object
    """The `step.estimate.roofline.GpuModel`."""
    gpus: int
    ranks_per_node: int
    parameters: int
    """The model's parameters (tied embeddings once): its FLOPs per token."""
    attention_width: int
    """Query heads x head dimension, summed over the decoder layers: causal attention's FLOPs per token
    pair."""


def model_flops(outcome: Outcome, setting: Setting) -> float:
    """Training FLOPs of one step of one sequence group: 6 per parameter per token plus causal attention
    (6 x width x T^2 / 2 x 2: QK^T and PV, forward and twice in backward, half the pairs), recomputation
    not counted (the usual MFU convention)."""
    tokens = outcome.spec.seq_len_tokens * outcome.spec.sequences
    return (6 * setting.parameters * tokens
            + 6 * setting.attention_width * outcome.spec.seq_len_tokens ** 2 * outcome.spec.sequences)


def recipe_dict(outcome: Outcome, setting: Setting) -> dict:
    """One recipe's entry in the JSON: its axes, status, partitions, figures and estimated time."""
    spec = outcome.spec
    entry = {"recipe": outcome.label, "method": spec.method, "head_mode": spec.stream.head_mode,
             "engine": ENGINES[spec.shard], "shard": spec.shard, "sp": spec.sp, "offload": str(spec.offload),
             "seq_len_tokens": spec.seq_len_tokens, "status": outcome.status, "why": outcome.why}
    if outcome.capped:
        entry["capped"] = True
    if outcome.fits and spec.partitioned:
        entry |= {"partition_size": spec.stream.partition_size,
                  "head_partition_size": spec.stream.head_partition_size}
    sim = outcome.sim
    gib = {"simulated_peak_gib": sim and sim.peak_bytes, "simulated_to_host_gib": sim and sim.to_host_bytes,
           "simulated_to_device_gib": sim and sim.to_device_bytes}
    entry |= {key: None if value is None else value / GIB for key, value in gib.items()}
    host = sim and sim.host_peak_bytes
    entry["simulated_host_gib_per_node"] = None if host is None else host * setting.ranks_per_node / GIB
    estimate = outcome.estimate
    if estimate is None:
        return entry
    seconds = estimate.step_time_ms / 1e3
    flops = model_flops(outcome, setting) / spec.sp
    entry |= {"estimated_step_time_s": seconds,
              "estimated_band_s": list(estimate.band_s),
              "estimated_regime": estimate.regime,
              "estimated_tokens_per_s_per_gpu": spec.seq_len_tokens * spec.sequences / spec.sp / seconds,
              "estimated_mfu": flops / seconds / setting.gpu.peak_bf16_flops}
    return entry


def ranked(outcomes: list[Outcome]) -> tuple[list[Outcome], list[Outcome], list[Outcome]]:
    """(fitting recipes fastest first, those without an estimate after them; the misses nearest first:
    GPU OOM by the least, host OOM, refused, pruned; the dominated ones, not evaluated)."""
    fitting = [outcome for outcome in outcomes if outcome.status == FITS]
    fitting.sort(key=lambda o: (o.estimate is None, o.estimate.step_time_ms if o.estimate else 0))
    misses = [outcome for outcome in outcomes if outcome.status in MISS_ORDER]
    misses.sort(key=lambda o: (MISS_ORDER[o.status], o.sim.peak_bytes if o.sim else 0))
    return fitting, misses, [outcome for outcome in outcomes if outcome.status == DOMINATED]


def to_dict(outcomes: list[Outcome], setting: Setting, settings: dict, refused: list) -> dict:
    """The whole answer as JSON: settings, the ranking, the misses, the dominated recipes, the axes
    refused by name; with `--seq-len max`, the frontier's longest and the fastest at the longest."""
    fitting, misses, dominated = ranked(outcomes)
    document = {"command": "plan", "settings": settings,
                "ranking": [recipe_dict(outcome, setting) for outcome in fitting],
                "misses": [recipe_dict(outcome, setting) for outcome in misses],
                "dominated": [recipe_dict(outcome, setting) for outcome in dominated],
                "refused": [{"recipes": what, "why": why} for what, why in refused]}
    if settings.get("seq_len_tokens") == "max":
        document["frontier"] = frontier(fitting)
    return document


def frontier(fitting: list[Outcome]) -> dict:
    """The longest length any recipe reaches, and the fastest of the recipes within the search's 1 %
    tolerance of it (by their estimated time at their own longest)."""
    if not fitting:
        return {"longest": None, "fastest_at_longest": None}
    longest = max(fitting, key=lambda o: o.spec.seq_len_tokens)
    near = [o for o in fitting if o.spec.seq_len_tokens >= 0.99 * longest.spec.seq_len_tokens]
    timed = [o for o in near if o.estimate is not None]
    fastest = min(timed, key=lambda o: o.estimate.step_time_ms) if timed else None
    return {"longest": {"recipe": longest.label, "seq_len_tokens": longest.spec.seq_len_tokens},
            "fastest_at_longest": None if fastest is None else {
                "recipe": fastest.label, "seq_len_tokens": fastest.spec.seq_len_tokens,
                "estimated_step_time_s": fastest.estimate.step_time_ms / 1e3}}


def render(console, document: dict, limit: int = 20) -> None:
    """The ranking table (fastest first, `limit` rows), the nearest misses, the frontier's answer."""
    settings = document["settings"]
    length = settings["seq_len_tokens"]
    length = "each recipe's longest length" if length == "max" else f"{length:,} tokens"
    title = (f"recipes that fit {settings['model']} on {settings['gpus']} x {settings['gpu_model']} "
             f"({settings['budget_gib']:g} GiB each, host {settings['host_gib_per_node']}), "
             f"{length}, fastest first: times estimated, memory simulated")
    table = Table(title=title, title_justify="left")
    columns = ("#", "recipe", "length", "partitions", "est. step s (band)", "regime", "tok/s/GPU", "MFU",
               "GPU peak GiB", "host GiB/node", "GiB to host / device")
    for column in columns:
        table.add_column(column, justify="left" if column in ("recipe", "regime") else "right")
    for rank, entry in enumerate(document["ranking"][:limit], 1):
        table.add_row(str(rank), entry["recipe"], f"{entry['seq_len_tokens']:,}", _partitions(entry),
                      *_timing(entry), _gib(entry["simulated_peak_gib"]),
                      _gib(entry["simulated_host_gib_per_node"]),
                      f"{_gib(entry['simulated_to_host_gib'])} / {_gib(entry['simulated_to_device_gib'])}")
    console.print(table)
    hidden = len(document["ranking"]) - limit
    if hidden > 0:
        console.print(f"... {hidden} more fitting recipes in --json")
    if document["misses"]:
        console.print("[bold]nearest misses[/]")
        for entry in document["misses"][:5]:
            console.print(f"  {entry['recipe']}: {entry['why']}", soft_wrap=True)
    for entry in document["refused"]:
        console.print(f"  {entry['recipes']}: refused: {entry['why']}", soft_wrap=True)
    if "frontier" in document and document["frontier"]["longest"]:
        front = document["frontier"]
        console.print(f"longest: {front['longest']['recipe']} at {front['longest']['seq_len_tokens']:,} "
                      "tokens (simulated)")
        if front["fastest_at_longest"]:
            fastest = front["fastest_at_longest"]
            console.print(f"fastest at the longest: {fastest['recipe']}, "
                          f"{fastest['estimated_step_time_s']:,.2f} s per step (estimated)")


def _partitions(entry: dict) -> str:
    if "partition_size" not in entry:
        return "-"
    return f"{entry['partition_size']:,} / {entry['head_partition_size']:,}"


def _timing(entry: dict) -> tuple[str, ...]:
    if "estimated_step_time_s" not in entry:
        return ("no estimate", "-", "-", "-")
    low, high = entry["estimated_band_s"]
    return (f"{entry['estimated_step_time_s']:,.2f} ({low:,.2f}-{high:,.2f})", entry["estimated_regime"],
            f"{entry['estimated_tokens_per_s_per_gpu']:,.0f}", f"{entry['estimated_mfu']:.1%}")


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"

