"""Output of `streambp-bench max-len`: progress lines, a table with provenance, JSON, results-CSV rows."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from streambp_bench import results as rows_file
from streambp_bench.maxlen.plan import MethodResult, Plan
from streambp_bench.output import stdout_console
from streambp_bench.results import (
    ResultRow,
    allocator_columns,
    host_columns,
    memory_columns,
    row_head_mode,
    spec_fields,
)
from streambp_core.measure.tags import CATEGORIES
from streambp_core.measure.units import GIB, format_size, memory_unit
from streambp_core.search import SEARCH_CAP_TOKENS, ProbeResult
from streambp_core.step.search.partitions import searched


def peak_gib(result: MethodResult) -> float | None:
    """Peak at the maximum length in GiB (None when nothing fits)."""
    best = result.search.peak_at_max
    return None if best is None or best.peak_bytes is None else best.peak_bytes / GIB


def breakdown_gib(result: MethodResult) -> dict[str, float]:
    """Bytes per category at the maximum length's peak, in GiB (empty when nothing fits)."""
    best = result.search.peak_at_max
    return {} if best is None else {k: v / GIB for k, v in best.breakdown_bytes.items()}


def host_gib(result: MethodResult) -> dict[str, float | None]:
    """The host pool at the maximum length, GiB: its peak and the bytes copied each way per step (None
    each when nothing fits)."""
    best = result.search.peak_at_max
    names = {"host_peak_gib": "host_peak_bytes", "to_host_gib": "to_host_bytes",
             "to_device_gib": "to_device_bytes"}
    values = {key: None if best is None else getattr(best, name) for key, name in names.items()}
    return {key: None if value is None else value / GIB for key, value in values.items()}


def host_bound(plan: Plan) -> str:
    """How an answer's host pool was judged, in words every row carries: 'unbounded' without
    --host-budget-gib (the answer may need more host memory than the machine has), else the bound."""
    if plan.host_budget_bytes is None:
        return "unbounded"
    return f"<= {plan.host_budget_bytes / GIB:g} GiB per rank"


def ratio_to_checkpoint(results: list[MethodResult], result: MethodResult) -> float | None:
    """Max length over checkpointing's at the same offload (None without such a result that fits)."""
    offload = result.spec.stream.offload
    same = [r for r in results if r.method == "checkpoint" and r.spec.stream.offload == offload]
    reference = next(iter(same), None)
    if reference is None or reference.search.max_len_tokens == 0 or result.search.capped or (
            reference.search.capped):  # a capped length is a lower bound: no ratio
        return None
    return result.search.max_len_tokens / reference.search.max_len_tokens


def to_dict(plan: Plan, results: list[MethodResult]) -> dict:
    """The JSON document: model, budget, source, settings (a partition given as auto says "auto", with
    the size the search ran it at, `step.search.partitions.searched`, in `searched_partitions`) and one entry
    per method."""
    first = plan.specs[0]
    fields = first.to_dict()
    settings = {k: fields[k] for k in ("batch_size", "dtype", "partition_size", "head_partition_size",
                                       "objective", "lora_rank", "optimizer", "attn", "protocol", "grads")}
    if first.stream.automatic:
        ran = searched(first).stream
        settings["searched_partitions"] = [ran.partition_size, ran.head_partition_size]
    host_budget = None if plan.host_budget_bytes is None else plan.host_budget_bytes / GIB
    return {
        "model": plan.model,
        "budget_gib": plan.budget_bytes / GIB,
        "source": plan.target.source,
        "device": plan.target.device_name,
        "settings": settings,
        "resident_gib": plan.resident_bytes / GIB,
        "host_budget_gib": host_budget,
        "host_budget_per_node_gib": None if host_budget is None else host_budget * plan.ranks_per_node,
        "ranks_per_node": plan.ranks_per_node,
        "gpus": first.gpus, "sp": first.sp, "shard": first.shard,
        "refused": [{"method": method, "reason": why} for method, why in plan.refused],
        "results": [
            {
                "method": r.method,
                "offload": str(r.spec.stream.offload),
                "label": r.label,
                "head_mode": row_head_mode(r.spec) or None,
                "max_len_tokens": r.search.max_len_tokens,
                "capped": r.search.capped,
                "confirmed_layers": r.search.confirmed_layers,
                "peak_gib": peak_gib(r),
                "breakdown_gib": breakdown_gib(r),
                **host_gib(r),
                "host_bound": host_bound(plan),
                "host_breakdown_gib": {"offloaded": host_gib(r)["host_peak_gib"]},
                "bracket_tokens": list(r.search.bracket),
                "ratio_to_checkpoint": ratio_to_checkpoint(results, r),
                "probes": len(r.search.probes),
                "probes_by_source": dict(Counter(p.source for p in r.search.probes)),
                "refused_probes": [p.message for p in r.search.refused],
                "how": r.how,
            }
            for r in results
        ],
        "notes": offload_notes(results),
    }


def render_tables(plan: Plan, results: list[MethodResult]) -> tuple[Table, Table]:
    """(lengths, breakdown): max length, bracket, peak, source, ratio; then GiB per category at the peak."""
    title = (
        f"max trainable length: {plan.model}, budget {plan.budget_bytes / GIB:g} GiB, "
        f"{plan.specs[0].dtype}, batch {plan.specs[0].batch_size}"
    )
    lengths = Table(title=title, title_justify="left")
    host = (f"host GiB ({host_bound(plan)})", "copied GiB to host / to device") if plan.offloads else ()
    scale, unit = memory_unit([peak for r in results if (peak := peak_gib(r)) is not None])
    columns = ("method", "max length", "bracket (fits, fails)", f"peak {unit}", *host, "source", "x ckpt")
    for column in columns:
        lengths.add_column(column, justify="left" if column in ("method", "source") else "right")
    shown = [c for c in CATEGORIES if any(breakdown_gib(r).get(c, 0) > 0 for r in results)]
    breakdown = Table(title=f"memory at that peak by category, {unit}", title_justify="left")
    offloaded = ("offloaded (host)",) if plan.offloads else ()
    for column in ("method", *shown, *offloaded):  # kernel_workspace reads "kernel workspace"
        breakdown.add_column(column.replace("_", " "), justify="left" if column == "method" else "right")
    for r in results:
        lo, hi = r.search.bracket
        peak, parts, ratio = peak_gib(r), breakdown_gib(r), ratio_to_checkpoint(results, r)
        moved = host_gib(r)
        copied = f"{_gib(moved['to_host_gib'])} / {_gib(moved['to_device_gib'])}"
        host_cells = [_gib(moved["host_peak_gib"]), copied] if plan.offloads else []
        lengths.add_row(
            r.label,
            max_len_cell(r.search),
            f"{lo:,}, {'-' if hi is None else f'{hi:,}'}",
            "-" if peak is None else f"{peak * scale:.2f}",
            *host_cells,
            plan.target.source,
            "-" if ratio is None else f"{ratio:.2f}",
        )
        on_host = [] if not plan.offloads else [
            "-" if moved["host_peak_gib"] is None else f"{moved['host_peak_gib'] * scale:.2f}"]
        device_cells = [f"{parts[c] * scale:.2f}" if c in parts else "-" for c in shown]
        breakdown.add_row(r.label, *device_cells, *on_host)
    return lengths, breakdown


def max_len_cell(search) -> str:
    """The max length as the table prints it: `≥ N` when the search cap itself fits (no maximum found),
    `none` when not even the shortest length probed fits."""
    if search.max_len_tokens == 0:
        return "none"
    return f"≥ {search.max_len_tokens:,}" if search.capped else f"{search.max_len_tokens:,}"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def describe(plan: Plan, results: list[MethodResult]) -> list[str]:
    """Lines saying how every number in the tables was obtained."""
    spec, target = plan.specs[0], plan.target
    how = next((r.how for r in results if r.search.peak_at_max is not None), "")
    depths = plan.resolved.depth_plan
    probes = "simulations of every layer" if depths is None else (
        "{}- and {}-layer simulations extrapolated in depth".format(*depths.depths) + (
            ", which can only under-estimate a peak, so its failing lengths fail at full depth too"
            if depths.period == 1 else ", whole periods of the layer pattern"))
    where = {
        "sim": "the real training step on meta tensors, "
        + how.removeprefix("simulated on meta tensors").lstrip(", ")
        + f" at the max length (the search probes {probes})",
        "cpu": f"a real step on CPU tensors ({target.device_name})",
        "cuda": f"a real step on {target.device_name}, one child process per probe",
    }[target.device]
    peak = (
        "the caching allocator's max_memory_allocated, breakdown from the live-tensor tracker"
        if target.device == "cuda"
        else "the most bytes of live tensors (live-tensor tracker)"
    )
    lines = [
        f"{target.source}: {where}; peak = {peak}; GiB = 2^30 B; every answer confirmed with all "
        f"{plan.num_layers} layers.",
        f"Step: protocol {spec.protocol}, grads {spec.grads}, random ids without padding, "
        f"{_partitions(plan, results)}{_head(results)}; weights + grads + optimizer state "
        f"{format_size(plan.resident_bytes)}.",
        "Search: secant-guided bracket, then secant/bisection until fails - fits <= max(1%, 128 tokens); "
        "max length = the longest probe that fits; x ckpt = max length / checkpoint's at the same offload.",
    ]
    if plan.offloads:
        lines.append(_offload_line(plan))
    lines += _softcap_lines(plan)
    lines += _train_lines(results)
    for r in results:
        if r.search.refused:
            lines.append(
                f"[yellow]{r.label}: probes were refused ({escape(r.search.refused[0].message)}); "
                "its max length is a lower bound set by RAM, not by the budget.[/]"
            )
    return lines


def _softcap_lines(plan: Plan) -> list[str]:
    """A simulated soft-capped model: the kernel whose buffers its attention backward is charged (--attn)."""
    from streambp_core.engine.attention.cuda import softcap_charge
    from streambp_core.models.adapters import SOFTCAPPED

    if plan.target.device != "sim" or plan.resolved.config.model_type not in SOFTCAPPED:
        return []
    return [f"Soft-capped attention: each chunk's backward is charged "
            f"{softcap_charge(plan.specs[0].stream.attn)}."]


def _offload_line(plan: Plan) -> str:
    """What '+ offload' rows are and how the host pool was judged."""
    bound = ("reported, not bounded (--host-budget-gib bounds it)" if plan.host_budget_bytes is None
             else f"bounded by --host-budget-gib {plan.host_budget_words}")
    return ("+ offload: checkpoints in host memory (checkpoint: transformers' own checkpoint offload; "
            "mst + offload: the ALST single-GPU recipe, tiled MLP + tiled loss + checkpoint offload; "
            "streambp: each layer's input in pinned host memory, prefetched a layer ahead); peak GiB is "
            f"the device's; host GiB = the host pool's peak, {bound}; copied GiB to host / to device = "
            "bytes copied device -> host, and host -> device, per step (+ offload TIERS: optimizer = AdamW's "
            "states and fp32 masters on the host, gradients sent as each is complete; params = weights on "
            "the host, each layer gathered for its forward and its backward).")


def _train_lines(results: list[MethodResult]) -> list[str]:
    """The trainer call for the longest length found (docs/trainers.md, "Train at that length")."""
    from streambp_core.integrations.settings import trainer_settings_line

    best = max(results, key=lambda r: r.search.max_len_tokens, default=None)
    if best is None or best.search.max_len_tokens == 0:
        return []
    if best.search.capped:
        return [f"No maximum found: {best.label} fits the longest length searched ({SEARCH_CAP_TOKENS:,} "
                "tokens), so the budget bounds nothing below it (≥ marks a capped answer, not a max length)."]
    if best.spec.sp > 1 and best.spec.shard in ("zero2", "zero3"):
        return [f"Train at {best.search.max_len_tokens:,} tokens per sequence over {best.spec.sp} ranks "
                f"({best.label}, {best.search.max_len_tokens // best.spec.sp:,} per rank): under "
                f"accelerate's FSDP2 plugin with TRL's SFTTrainer call {trainer_settings_line(best.spec)} on "
                "every rank "
                "before trainer.train() (streambp_core.integrations.sequence_trainer)."]
    if best.spec.sp > 1:
        return [f"Train at {best.search.max_len_tokens:,} tokens per sequence over {best.spec.sp} ranks "
                f"({best.label}, {best.search.max_len_tokens // best.spec.sp:,} per rank): prepare the model "
                "in each rank with its SequenceGroup (streambp_core.engine.sequence.group) and its shard "
                "of the sequence."]
    if best.spec.shard.startswith("deepspeed-"):
        return [f"Train at {best.search.max_len_tokens:,} tokens per rank ({best.label}) under DeepSpeed: "
                "prepare the engine deepspeed.initialize returns (streambp_core.prepare(engine, ...)), "
                "then engine.backward(run.loss(...)) and engine.step() (streambp_core.parallel.deepspeed)."]
    if best.spec.shard != "none":  # the trainer integration runs one process
        return [f"Train at {best.search.max_len_tokens:,} tokens per rank ({best.label}): shard the model "
                "with streambp_core.parallel.shard_model in each rank's process group, then prepare it as on "
                "one GPU (the trainer integration runs one process)."]
    line = (f"Train at {best.search.max_len_tokens:,} tokens ({best.label}): build the trainer with "
            f"max_length <= {best.search.max_len_tokens}, then call "
            f"{trainer_settings_line(best.spec)} before trainer.train().")
    if best.spec.offload.optimizer:  # stream_trainer makes the trainer build HostAdamW
        line += (" With the optimizer tier the trainer's AdamW steps in host memory (optim adamw_torch, "
                 "max_grad_norm=0: streambp_core.integrations.optimizer_tier).")
    return [line]


def _partitions(plan: Plan, results: list[MethodResult]) -> str:
    """The partition sizes of the rows: one pair for all (streambp, mst), or each method's where they
    differ (`--ps auto`: the largest that fit at each method's maximum)."""
    chunked = [r for r in results if r.spec.partitioned]
    sizes = {(r.spec.stream.partition_size, r.spec.stream.head_partition_size) for r in chunked}
    if len(sizes) > 1:
        return "partitions " + ", ".join(
            f"{r.label} ps {r.spec.stream.partition_size} ps-head {r.spec.stream.head_partition_size}"
            for r in chunked)
    first = searched(plan.specs[0]).stream
    layer, head = sizes.pop() if sizes else (first.partition_size, first.head_partition_size)
    return f"ps {layer} (streambp, mst), ps-head {head} (streambp, mst)"


def _head(results: list[MethodResult]) -> str:
    """', LM head <mode> (streambp)' when streambp is in the run, else ''."""
    heads = dict.fromkeys(r.spec.stream.head_mode for r in results if r.spec.method == "streambp")
    return f", LM head {' / '.join(heads)} (streambp)" if heads else ""


def offload_notes(results: list[MethodResult]) -> list[str]:
    """Why a method reaches fewer tokens with its checkpoints offloaded than without: the categories that
    hold more device memory at the offloaded peak (e.g. LoRA + AdamW: gradients live at that peak)."""
    lines = []
    for with_offload in (r for r in results if r.spec.offload):
        plain = next((r for r in results if r.method == with_offload.method and not r.spec.offload
                      and r.spec.stream.partition_size == with_offload.spec.stream.partition_size), None)
        if plain is None or with_offload.search.max_len_tokens >= plain.search.max_len_tokens:
            continue
        here, there = breakdown_gib(with_offload), breakdown_gib(plain)
        more = sorted(((here.get(c, 0) - there.get(c, 0), c) for c in here), reverse=True)
        grown = ", ".join(f"{c} +{gib:.2f} GiB" for gib, c in more if gib > 0.005) or "no category"
        lines.append(
            f"{with_offload.label} reaches fewer tokens than {plain.label} "
            f"({with_offload.search.max_len_tokens:,} < {plain.search.max_len_tokens:,}): offloading frees "
            f"the checkpoints but its peak falls elsewhere in the step, where the device holds more "
            f"({grown}, simulated, each at its own max length)."
        )
    return lines


def refused_lines(plan: Plan) -> list[str]:
    """One line per method `--method all` left out, naming why ("streambp: refused: ...")."""
    return [f"{method}: refused: {why}" for method, why in plan.refused]


def print_report(plan: Plan, results: list[MethodResult], out: Path | None) -> None:
    """The table and the provenance lines on stdout."""
    console = stdout_console()
    for table in render_tables(plan, results):
        console.print(table)
    for line in [*describe(plan, results), *offload_notes(results), *refused_lines(plan)]:
        console.print(line if line.startswith("[yellow]") else escape(line), soft_wrap=True)
    if out is not None:
        console.print(f"rows upserted into {escape(str(out))}", soft_wrap=True)


def write_rows(plan: Plan, results: list[MethodResult], path: Path, extra_rows: tuple | list = ()) -> None:
    """Upsert one `max_len` row per method, and `extra_rows`, into the results CSV at `path`."""
    stamp = rows_file.provenance(plan.target.source, plan.target.device_name)
    host = None if plan.host_budget_bytes is None else plan.host_budget_bytes / GIB
    rows = [max_len_row(r.spec, r.search, stamp, host_budget_gib=host) for r in results]
    rows_file.ResultsFile(path).append_many([*rows, *extra_rows])


def max_len_row(spec, search, stamp: dict, host_budget_gib: float | None = None) -> ResultRow:
    """The `max_len` row of one search of `spec` (value: tokens; the peak and breakdown at the max, the
    host pool's peak beside it and the host budget it was bounded by: None, host unbounded)."""
    best = search.peak_at_max
    memory = {} if best is None else memory_columns(best.peak_bytes, best.breakdown_bytes)
    return ResultRow(
        **spec_fields(spec, seq_len_tokens=0),
        **stamp,
        **memory,
        **({} if best is None else {**allocator_columns(best), **host_columns(best)}),
        metric="max_len",
        value=float(search.max_len_tokens),
        status="ok" if search.max_len_tokens else "oom",
        budget_gib=search.budget_bytes / GIB,
        host_budget_gib=host_budget_gib,
        confirmed_layers=search.confirmed_layers,
    )


class ProgressView:
    """A rich progress line per method on stderr, updated after every probe."""

    def __init__(self, plan: Plan, progress: Progress) -> None:
        self.budget, self.progress = plan.budget_bytes, progress
        self.host_budget = plan.host_budget_bytes
        self.tasks = {m: progress.add_task(f"{m:<10} waiting", total=None) for m in plan.labels}

    def __call__(self, label: str, result: ProbeResult, lo: int, hi: int | None) -> None:
        peak = "no peak" if result.peak_bytes is None else format_size(result.peak_bytes)
        verdict = "fits" if result.fits(self.budget, self.host_budget) else _failure(result, self.host_budget)
        text = (
            f"{label:<10} {result.source} probe {result.seq_len_tokens:>10,} tokens: {peak} ({verdict}); "
            f"bracket [{lo:,}, {'-' if hi is None else f'{hi:,}'}]"
        )
        self.progress.update(self.tasks[label], description=text)


def _failure(result: ProbeResult, host_budget: int | None) -> str:
    """Why a probe does not fit, in a word or two: oom (of which pool), over (the device budget), over
    host budget."""
    if result.status != "ok":
        return f"{result.status}, {result.oom_pool}" if result.oom_pool else result.status
    return "over host budget" if result.over_host_budget(host_budget) else "over"
