"""Exactness on DeepSpeed ZeRO across ranks: the applied update of one optimizer step, and the reductions.

Steps of `verify_deepspeed` (in `nproc` spawned ranks, see `run_ranks`):
1. Every rank builds the same seeded model and draws every rank's batches (seed + 1 + rank, one per
   micro-step), and computes the reference on its own: single-process plain backprop of the mean loss
   over all ranks' and micro-steps' batches, then one step of torch's Adam (DeepSpeed's `torch_adam`) on
   float32 master weights, as ZeRO keeps them whatever the parameters' dtype (the update is their
   change, cast back).
2. For each ZeRO stage and method: a fresh copy of the model goes through `deepspeed.initialize`; the
   user's loop runs unchanged (`prepare(engine, ...)`, `engine.backward(run.loss(...))`,
   `engine.step()`) over the rank's micro-steps, while every parameter id ZeRO puts into a reduction
   bucket is counted (`count_reductions`). LoRA (`lora_rank`) trains the adapters only.
3. Each rank compares the applied update (trainable parameters after minus before; ZeRO-3's gathered
   whole) with the reference's, and
   with plain's on the same engine (`engine_plain_err`: the mechanism alone, float32 masters on both
   sides): max relative error over parameters; rank 0 returns the results.
4. With `offload` (ZeRO-3: the optimizer and params tiers as DeepSpeed's `offload_optimizer` and
   `offload_param`, `deepspeed.offload_sections`), every engine of steps 2 and 3 runs with them, and each
   method's update is also compared with its own on an engine without them (`offload_err`: 0 with
   torch's Adam on the host partitions, DeepSpeed's CPU Adam with `cpu_adam` rounds in float32 its own
   way).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import asdict, dataclass, replace

import torch

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.models import build_model, load_config
from streambp_core.models.lora import apply_lora
from streambp_core.parallel.deepspeed import (
    STAGES,
    check_engine,
    check_installed,
    check_stage,
    offload_sections,
    zero_config,
)
from streambp_core.parallel.launch import DEFAULT_TIMEOUT_S, run_ranks
from streambp_core.step.batch import objective_inputs, random_batch
from streambp_core.verify.compare import max_rel_err
from streambp_core.verify.methods import DTYPES, TOLERANCE, VerifySpec

LR = 1e-3

ENGINE_TOLERANCE = TOLERANCE["float32"]
"""Update error accepted against plain on the same engine (the mechanism alone): ZeRO-1/2 accumulate in
float32 and step float32 master weights whatever the parameters' dtype, so a gradient difference at
float64's rounding (mst's, streambp's against plain's) can move an update by float32's: 3.0e-5 measured
(mst, grpo, ZeRO-1 on tiny/qwen3); streambp's update equalled plain's exactly where measured."""

MASTER_TOLERANCE = TOLERANCE["float32"]
"""Update error accepted against single-process plain (float32 masters on both sides): ZeRO also
accumulates micro-steps' gradients and reduces in float32, which plain on the engine shows alone (up to
1.5e-5 measured, grpo on tiny/qwen3); float32's bound of `verify`."""


@dataclass(frozen=True, kw_only=True)
class DeepSpeedResult:
    """One method under one ZeRO stage against single-process plain (`verify`'s update figure)."""

    method: str
    shard: str
    objective: str
    nproc: int
    micro_steps: int
    max_rel_err: float
    """Max over parameters of |update - plain's update| / |plain's update| (Frobenius), one step."""
    engine_plain_err: float
    """The same against plain's update on the same DeepSpeed engine."""
    worst_param: str
    offload: str = "none"
    """The project's tiers DeepSpeed held on the host (`deepspeed.offload_sections`): optimizer is its
    `offload_optimizer`, params its `offload_param`."""
    offload_err: float | None = None
    """With `offload`: the same against the same method's update on the same engine without it."""
    tolerance: float
    reductions: dict[str, int]
    """Per micro-step, how many parameters ZeRO reduced 0, 1 or more times ('0', '1', '2+')."""
    ok: bool


def verify_deepspeed(
    specs: tuple[VerifySpec, ...], *, nproc: int, shards: tuple[str, ...] = ("zero1", "zero2"),
    micro_steps: int = 1, offload: str = "none", cpu_adam: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[DeepSpeedResult]:
    """Verify every spec's methods under every ZeRO stage across `nproc` ranks (module docstring), with
    DeepSpeed's offload sections for the tiers `offload` (canonical; "none": none) and, with `cpu_adam`,
    DeepSpeed's CPU Adam stepping the offloaded optimizer (`deepspeed.zero_config`)."""
    check_installed()
    if not specs:
        raise ConfigError("give at least one spec")
    for spec in specs:
        check_spec(spec, shards)
    for shard in shards:
        offload_sections(offload, STAGES[shard])
    per_rank = run_ranks(rank_verify, nproc, args=(specs, shards, micro_steps, offload, cpu_adam),
                         timeout_s=timeout_s)
    return per_rank[0]


def check_spec(spec: VerifySpec, shards: tuple[str, ...]) -> None:
    """ConfigError for what a DeepSpeed verify cannot run (before any rank starts)."""
    for shard in shards:
        check_stage(shard)
    if spec.step.dtype not in TOLERANCE:
        exact = ", ".join(TOLERANCE)
        raise ConfigError(f"deepspeed verify compares exact dtypes ({exact}), got {spec.step.dtype}")
    if spec.device != "cpu":
        raise ConfigError("deepspeed verify runs on cpu ranks")


def rank_verify(rank: int, world: int, specs, shards, micro_steps: int, offload: str = "none",
                cpu_adam: bool = False) -> list[DeepSpeedResult]:
    """Body of each rank (module docstring); every rank checks, rank 0's results are returned."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for spec in specs:
        step = spec.step
        model = build_model(load_config(step.model), dtype=DTYPES[step.dtype], device="cpu", seed=step.seed)
        if step.lora_rank:
            model = apply_lora(model, step.lora_rank)
        batches = [[_batch(spec, model, r, m) for m in range(micro_steps)] for r in range(world)]
        reference = _plain_update(model, spec, batches)
        for shard in shards:
            engine_plain = _engine_update(model, "plain", shard, spec, batches[rank], offload, cpu_adam)[0]
            for method in spec.methods:
                update, tallies = _engine_update(model, method, shard, spec, batches[rank], offload, cpu_adam)
                result = _result(method, shard, spec, world, len(batches[rank]), update, tallies, reference,
                                 engine_plain)
                if offload != "none":
                    kept = _engine_update(model, method, shard, spec, batches[rank])[0]
                    result = _with_offload(result, offload, max_rel_err(update, kept)[0])
                results.append(result)
    return results


def _batch(spec: VerifySpec, model, rank: int, micro: int):
    step = spec.step
    batch = random_batch(vocab_size=model.config.vocab_size, seq_len=step.seq_len_tokens,
                         batch_size=step.batch_size, padding=spec.padding,
                         seed=step.seed + 1 + rank + 1000 * micro, device="cpu")
    labels, inputs = objective_inputs(step.objective, batch, step.seed + rank + 1000 * micro)
    return batch, labels, inputs


def _loss(run_or_model, batch, labels, inputs):
    return run_or_model.loss(batch.input_ids, attention_mask=batch.attention_mask, labels=labels, **inputs)


def _plain_update(model, spec: VerifySpec, batches) -> dict[str, torch.Tensor]:
    """Plain's update: the mean loss over every rank's micro-steps, one Adam step (data-parallel)."""
    model = copy.deepcopy(model)
    count = sum(len(rank_batches) for rank_batches in batches)
    with streambp_core.prepare(model, "plain", objective=spec.step.objective) as run:
        for rank_batches in batches:
            for batch in rank_batches:
                (_loss(run, *batch) / count).backward()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for _, p in named]
    for master, (_, param) in zip(masters, named, strict=True):
        master.grad = param.grad.float()
    torch.optim.Adam(masters, lr=LR).step()
    return {name: master.detach().to(param.dtype) - param.detach()
            for master, (name, param) in zip(masters, named, strict=True)}


def _engine_update(model, method, shard, spec: VerifySpec, batches, offload: str = "none",
                   cpu_adam: bool = False):
    """The user's DeepSpeed loop on a copy of `model` over this rank's micro-steps: the applied update, and
    how many parameters ZeRO reduced 0, 1, 2+ times (per micro-step on ZeRO-2/3, which reduce every
    micro-step; per step on ZeRO-1, which reduces at the accumulation boundary only)."""
    import deepspeed

    model = copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    config = zero_config(STAGES[shard], micro_batch=spec.step.batch_size, accumulation=len(batches),
                         lr=LR, offload=offload, cpu_adam=cpu_adam)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    check_engine(engine)
    counts = count_reductions(engine.optimizer)
    tallies: Counter = Counter()
    with streambp_core.prepare(engine, method, spec.step_of(method).stream) as run:
        for batch in batches:
            if shard != "zero1":
                counts.clear()
            engine.backward(_loss(run, *batch))
            if shard != "zero1":
                tallies.update(_tally(counts, engine.module))
            engine.step()
    if shard == "zero1":
        tallies.update(_tally(counts, engine.module))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # ZeRO-3: whole again
        update = {name: p.detach() - before[name] for name, p in engine.module.named_parameters()
                  if name in before}
    return update, tallies


def _result(method, shard, spec, world, micro_steps, update, tallies, reference, engine_plain):
    err, worst = max_rel_err(update, reference)
    engine_err, _ = max_rel_err(update, engine_plain)
    tolerance = MASTER_TOLERANCE
    return DeepSpeedResult(method=method, shard=shard, objective=spec.step.objective, nproc=world,
                           micro_steps=micro_steps, max_rel_err=err, engine_plain_err=engine_err,
                           worst_param=worst, tolerance=tolerance, reductions=dict(tallies),
                           ok=err <= tolerance and engine_err <= ENGINE_TOLERANCE and set(tallies) == {"1"})


def _with_offload(result: DeepSpeedResult, offload: str, offload_err: float) -> DeepSpeedResult:
    """`result` with its offload figure, which must be within float32's rounding of the fp32 masters too."""
    return replace(result, offload=offload, offload_err=offload_err,
                   ok=result.ok and offload_err <= ENGINE_TOLERANCE)


def count_reductions(optimizer) -> Counter:
    """A Counter of param ids that fills as `optimizer` puts each gradient into a reduction bucket.

    Stages 1 and 2 reduce a bucket in `reduce_ipg_grads` (from the hooks and at the epilogue); stage 3
    adds a gradient to its bucket in its private `__add_grad_to_ipg_bucket`, reached only when the
    gradient is ready. Either is wrapped on this instance only.
    """
    counts: Counter = Counter()
    stage3_add = "_DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket"
    if hasattr(optimizer, stage3_add):
        add = getattr(optimizer, stage3_add)

        def added(param):
            counts[param.ds_id] += 1
            return add(param)

        setattr(optimizer, stage3_add, added)
        return counts
    reduce = optimizer.reduce_ipg_grads

    def counted(comm_dtype=None, *args, **kwargs):
        buckets = optimizer.ipg_buckets
        buckets = buckets.values() if comm_dtype is None else [buckets[comm_dtype]]
        for bucket in buckets:
            counts.update(param_id for *_, param_id in bucket.params)
        return reduce(comm_dtype, *args, **kwargs)

    optimizer.reduce_ipg_grads = counted
    return counts


def _tally(counts: Counter, model) -> Counter:
    """How many trainable parameters were reduced 0, 1, 2+ times in one micro-step."""
    total = sum(1 for p in model.parameters() if p.requires_grad)
    tally = Counter("1" if n == 1 else "2+" for n in counts.values())
    tally["0"] = total - len(counts)
    return +tally


def report(results: list[DeepSpeedResult]) -> dict:
    """JSON-ready summary (measured-cpu: real gloo ranks)."""
    return {"source": "measured-cpu", "ok": all(r.ok for r in results),
            "results": [asdict(r) for r in results]}
