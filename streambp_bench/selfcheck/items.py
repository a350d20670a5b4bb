"""The self-check's items in the order they run, each with its estimate on an H200 (`estimate`).

Order: the cheap checks every later row leans on first (bf16 gradients, the families' and the attention
kernels' since the first H200 run, memory), then the other rows owed since that run, the longest
(checkpoint offload at 256k tokens) last, so a run cut short keeps the most. Processes of their own (the
FSDP2 rank, `max-len`'s probes) start after `Context.release_gpu` has handed the cached device memory
back. Every item runs from the installed package: none needs a checkout.
"""

from __future__ import annotations

from streambp_bench.selfcheck import check, estimate, families, owed
from streambp_bench.selfcheck.estimate import OVERHEAD_S, SIM_S, step_seconds
from streambp_bench.selfcheck.plan import Item

REPEATS = 3
"""Timed repeats of a step-time row (after one warm-up)."""
PROFILE_FACTOR = 1.5
"""A profiled step's time over a plain one (the profiler's own cost)."""
AUTO_SIMS = 8
"""Simulations the AUTO partitions' search runs per length (`fitting_partitions`)."""
TRACKED_S = (6.0, 0.8)
"""A tracked step of the memory model: seconds, plus seconds per layer chunk (the committed H200 rows:
streambp at 4k, 8k and 16k, ps 500, took 13, 18 and 32 s under the tracker)."""
MAX_LEN_PROBES = (4, 6, 32768)
"""The measured probes of the `max-len` item, its simulated ones, and the longest length a probe is
assumed to run (the simulated answer at 6 GiB is 22k tokens; the guided search probes near it)."""
KERNEL_CASE_S = 1.0
"""One attention path's check (`families.kernel_rows`): three bf16 and float32 backward passes of 500
queries over at most 20,000 keys, the written-out ones holding the score matrix."""


class Context:
    """What the items share: the plan, where it runs, the memory model (built once, when first needed),
    resolved models, and the committed rows' step-time curves (for the estimates)."""

    def __init__(self, plan: check.CheckPlan, where: str) -> None:
        self.plan, self.where = plan, where
        self._model = None
        self._resolved: dict = {}
        self._curves: dict | None = None

    @property
    def device(self) -> str:
        return self.plan.device

    def model(self):
        """The memory model on the plan's device (random weights), built on first use."""
        if self._model is None:
            self._model = check.memory_model(self.plan)
        return self._model

    def resolved(self, name: str):
        """`name` resolved once (`step.parts.resolved.ResolvedModel`)."""
        from streambp_core.step.parts.resolved import ResolvedModel

        if name not in self._resolved:
            self._resolved[name] = ResolvedModel(name)
        return self._resolved[name]

    def curves(self) -> dict:
        """The committed H200 rows' step-time curves (`estimate.fitted_curves`)."""
        if self._curves is None:
            self._curves = estimate.fitted_curves()
        return self._curves

    def release_gpu(self) -> None:
        """Drop the memory model and hand the allocator's cached blocks back (another process's turn)."""
        self._model = None
        if self.device == "cuda":
            import gc

            import torch

            gc.collect()
            torch.cuda.empty_cache()


def _steps_s(ctx: Context, method: str, lengths, count: int = 1, model: str | None = None) -> float:
    model = model or ctx.plan.memory_model
    return count * sum(step_seconds(ctx.curves(), method, n, model) for n in lengths)


def _verify(ctx: Context):
    return check.verify_rows(ctx.plan, ctx.where)


def _verify_s(ctx: Context) -> float:
    return len(ctx.plan.objectives) * (OVERHEAD_S["model"] + 1.0)


def _memory(ctx: Context):
    return check.memory_rows(ctx.plan, ctx.model(), ctx.where)


def _workspace(ctx: Context):
    return check.workspace_rows(ctx.plan, ctx.model(), ctx.where)


def _time(ctx: Context):
    return check.time_rows(ctx.plan, ctx.model(), ctx.where, REPEATS)


def _profile(ctx: Context):
    return check.profile_rows(ctx.plan, ctx.model(), ctx.where)


def _memory_s(ctx: Context) -> float:
    plan = ctx.plan
    steps = sum(_steps_s(ctx, method, plan.lengths) for method in check.METHODS)
    return OVERHEAD_S["model"] + steps + len(check.METHODS) * len(plan.lengths) * SIM_S


def _time_s(ctx: Context) -> float:
    plan = ctx.plan
    variants = check.timed_variants(plan)
    steps = sum(_steps_s(ctx, method, plan.timed_lengths, 1 + REPEATS) for method, _ in variants)
    auto = check.AUTO in plan.timed_head_partitions
    return steps + (AUTO_SIMS * SIM_S * len(plan.timed_lengths) if auto else 0.0)


def _profile_s(ctx: Context) -> float:
    longest = max(ctx.plan.timed_lengths)
    return sum(_steps_s(ctx, method, (longest,), 1) * (1 + PROFILE_FACTOR)
               for method, _ in check.timed_variants(ctx.plan))


def _workspace_s(ctx: Context) -> float:
    lengths = ctx.plan.workspace_lengths
    per_kernel = 2 * (_steps_s(ctx, "streambp", lengths) + len(lengths) * SIM_S)
    return per_kernel * len(check.attention_kernels(ctx.plan))


def _offload_item(seq_len: int, warmup: int) -> Item:
    def rows(ctx: Context):
        specs = owed.offload_specs(ctx.plan.memory_model, ctx.plan.dtype, seq_len)
        return owed.offload_rows(specs, ctx.model(), ctx.resolved(ctx.plan.memory_model), ctx.where,
                                 ctx.device, warmup)

    def seconds(ctx: Context) -> float:
        return _steps_s(ctx, "streambp", (seq_len,), 2 + warmup) + 2 * SIM_S

    return Item(f"offload-{seq_len // 1024}k", f"streambp on {check.GPU_PLAN.memory_model} at {seq_len:,} "
                f"tokens with checkpoints in pinned host memory and without: allocator and pinned peaks vs "
                f"simulated, step time with/without", rows, seconds)


def _fsdp(ctx: Context):
    ctx.release_gpu()
    spec = owed.fsdp_spec(ctx.plan.memory_model, ctx.plan.dtype, ctx.plan.fsdp_length)
    return owed.fsdp_rows(spec, ctx.resolved(spec.model), ctx.where, ctx.device)


def _fsdp_s(ctx: Context) -> float:
    steps = _steps_s(ctx, "streambp", (ctx.plan.fsdp_length,), 2)
    return OVERHEAD_S["process"] + OVERHEAD_S["model"] + steps + SIM_S


def _max_len_spec(ctx: Context):
    from streambp_core.config import StepSpec

    plan = ctx.plan
    return StepSpec.of(model=plan.small_model, method="streambp", dtype=plan.dtype, head_mode="auto",
                       partition_size=plan.max_len_partition_size, head_partition_size=1024)


def _max_len(ctx: Context):
    ctx.release_gpu()
    return owed.max_len_rows(_max_len_spec(ctx), ctx.plan.max_len_budget_gib, ctx.where, ctx.device)


def _max_len_s(ctx: Context) -> float:
    measured, simulated, longest = MAX_LEN_PROBES
    chunks = -(-longest // ctx.plan.max_len_partition_size)
    probe = OVERHEAD_S["process"] + OVERHEAD_S["model"] + TRACKED_S[0] + TRACKED_S[1] * chunks
    return measured * probe + simulated * SIM_S


def _tiers(ctx: Context):
    ctx.release_gpu()
    specs = owed.tier_specs(ctx.plan.small_model, ctx.plan.dtype, ctx.plan.tier_length)
    return owed.tier_rows(specs, ctx.resolved(ctx.plan.small_model), ctx.where, ctx.device)


def _tiers_s(ctx: Context) -> float:
    plan = ctx.plan
    return 2 * (OVERHEAD_S["model"] + _steps_s(ctx, "streambp", (plan.tier_length,), 2, plan.small_model)
                + SIM_S)


def _families(ctx: Context):
    return families.family_rows(ctx.plan, ctx.where)


def _families_s(ctx: Context) -> float:
    return len(ctx.plan.family_models) * (OVERHEAD_S["model"] + 1.0)


def _kernels(ctx: Context):
    return families.kernel_rows(ctx.plan, ctx.where)


def _kernels_s(ctx: Context) -> float:
    return len(families.KERNEL_CASES) * KERNEL_CASE_S


def plan_items(plan: check.CheckPlan) -> list[Item]:
    """Every item of `plan`, in the order they run (module doc); the CPU plan's CUDA-only items are listed
    but not run (`Item.cuda_only`)."""
    p = plan
    items = [
        Item("verify", f"bf16 gradients of every method and objective, {p.verify_model}, "
             f"{p.verify_seq_len} tokens, vs the 2x-plain-bf16 rule", _verify, _verify_s, cuda_only=False),
        Item("families", f"{p.verify_dtype} gradients of every method on {', '.join(p.family_models)}, "
             f"{p.family_seq_len} tokens", _families, _families_s, cuda_only=False),
        Item("kernels", "bf16 input gradients of the blocked attention (with sinks and windows) and the "
             "soft-capped paths vs written-out attention, by the 2x rule", _kernels, _kernels_s),
        Item("memory", f"allocator peak vs simulated, every method, {p.memory_model}, "
             f"{', '.join(str(n) for n in p.lengths)} tokens",
             _memory, _memory_s, cuda_only=False),
        _offload_item(p.offload_lengths[0], warmup=1) if p.offload_lengths else None,
        Item("fsdp", f"one FSDP2 rank (ZeRO-3) on nccl, streambp + AdamW, {p.memory_model}, {p.fsdp_length} "
             f"tokens: allocator peak vs the sharded simulation", _fsdp, _fsdp_s),
        Item("host-tiers", f"optimizer and parameter tiers in pinned host memory (side stream), "
             f"{p.small_model}, {p.tier_length} tokens: device and pinned peaks vs simulated pools",
             _tiers, _tiers_s),
        Item("max-len-cuda", f"max-len --device cuda, streambp, {p.small_model}, "
             f"{p.max_len_budget_gib:g} GiB, vs the simulated search", _max_len, _max_len_s),
        Item("workspace", f"streambp peak with its attention backward blocked and not, "
             f"{', '.join(str(n) for n in p.workspace_lengths)} tokens, per kernel (SDPA's flash and cuDNN; "
             f"flash-attn when installed), vs simulated",
             _workspace, _workspace_s, cuda_only=False),
        Item("time", f"step time of checkpoint and streambp per LM-head partition, "
             f"{', '.join(str(n) for n in p.timed_lengths)} tokens",
             _time, _time_s, cuda_only=False),
        Item("profile", f"kernel time by class of one step per timed variant, {max(p.timed_lengths)} tokens",
             _profile, _profile_s, cuda_only=False),
        *(_offload_item(n, warmup=0) for n in p.offload_lengths[1:]),
    ]
    return [item for item in items if item is not None]
