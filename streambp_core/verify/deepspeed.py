"""Exactness on DeepSpeed ZeRO across ranks: the applied update of one optimizer step, and the reductions.

Steps of `verify_deepspeed` (in `nproc` spawned ranks, see `run_ranks`):
1. Every rank builds the same seeded model and draws every rank's batches (seed + 1 + rank, one per
   micro-step; with padding, rank r's rows pad r * (T // 8 + 1) positions more, so the ranks count
   different valid tokens: `deepspeed_update.rank_padded`), and computes the reference on its own:
   single-process plain backprop of the mean of the ranks' mean losses over all ranks' and micro-steps'
   batches (data parallelism's gradient).
2. For each ZeRO stage and method: a fresh copy of the model goes through `deepspeed.initialize` (with
   torch's Adam from the config, or a client `torch.optim.SGD`: `optimizer`); the
   user's loop runs unchanged (`prepare(engine, ...)`, `engine.backward(run.loss(...))`,
   `engine.step()`) over the rank's micro-steps, while every parameter id ZeRO puts into a reduction
   bucket is counted (`count_reductions`). At the accumulation boundary, before `engine.step()`, the
   gradient ZeRO hands its optimizer is read whole with DeepSpeed's `safe_get_full_grad`, and its float32
   master weights with `safe_get_full_fp32_param` before and after the step. LoRA (`lora_rank`) trains
   the adapters only.
3. The applied update is checked in two parts, which together say it is one step of the engine's
   optimizer on plain's gradient:
   - `grad_err`: the reduced gradient against single-process plain's, by the criterion of every
     verify (`compare.max_grad_err`), within float32's bound (ZeRO reduces into float32 whatever the
     parameters' dtype: `GRAD_TOLERANCE`);
   - `step_err`: the applied update (the parameters after minus before; ZeRO-3's gathered whole)
     against one step of the engine's own optimizer (its class and settings, `_own_step`) from the
     masters before the step on that reduced gradient (`STEP_TOLERANCE`).
   `update_err`, the applied update against plain's gradient stepped by the same optimizer from float32
   masters (the user's own comparison), is reported beside them. Under Adam it is not judged: Adam's
   first step moves each element by lr * g / (|g| + eps), so an element whose gradient is within
   float32's rounding of eps moves a different fraction of a step on a rounding difference. Plain on the
   engine itself is 1.2e-4 from plain in one process that way (float32, ZeRO-2, tiny/qwen3), with
   gradients 7.5e-7 apart. Under SGD it is judged within float32's rounding of the write
   (`update_ratio` <= 1, `deepspeed_update`).
4. With `offload` (ZeRO-3: the optimizer and params tiers as DeepSpeed's `offload_optimizer` and
   `offload_param`, `deepspeed.offload_sections`), every engine of steps 2 and 3 runs with them, and each
   method's reduced gradient is also compared with its own on an engine without them (`offload_err`:
   the host partitions hold the same float32 gradient).
"""

from __future__ import annotations

import copy
import inspect
from collections import Counter
from dataclasses import asdict, dataclass, replace

import torch

import streambp_core
from streambp_core.config import ConfigError, offload_choice
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
from streambp_core.step.parts.batch import objective_inputs, random_batch
from streambp_core.tiers import Tiers
from streambp_core.verify.compare import max_grad_err, max_rel_err
from streambp_core.verify.deepspeed_update import (
    LINEAR,
    check_optimizer,
    optimizer_class,
    rank_padded,
    update_ratio,
)
from streambp_core.verify.methods import DTYPES, TOLERANCE, VerifySpec

LR = 1e-3

GRAD_TOLERANCE = 1e-5
"""The reduced gradient against single-process plain's: ZeRO reduces into float32 whatever the
parameters' dtype, so float32's bound. Measured on 2 ranks, every method, stage and objective,
tiny/llama and tiny/qwen3: up to 1.3e-6 with float32 parameters (float32's rounding of another
summation order; `verify`'s defaults with -b 2, dpo), up to 3.4e-8 with float64 ones (the cast to
float32 alone).
float32's rounding grows with the length where a loss is conditioned badly: at 4096 tokens, dpo
(the difference of two sequences' summed log-probs), plain in float32 is itself 3.7e-5 from float64."""

STEP_TOLERANCE = 1e-6
"""The applied update against one step of the engine's own optimizer on its reduced gradient: the same
arithmetic on the same float32 values, one parameter at a time instead of ZeRO's flat partitions: 0
measured in every cell `GRAD_TOLERANCE`'s figures come from, and with DeepSpeed's CPU Adam on offloaded
partitions; the bound leaves room for a vector kernel that splits the elements differently."""


@dataclass(frozen=True, kw_only=True)
class DeepSpeedResult:
    """One method under one ZeRO stage against single-process plain (module docstring, step 3)."""

    method: str
    shard: str
    objective: str
    nproc: int
    micro_steps: int
    grad_err: float
    """The reduced gradient ZeRO hands its optimizer at the accumulation boundary against plain's, by the
    criterion every verify judges by (`compare.max_grad_err`: per parameter, the error's norm over plain's
    norm plus sqrt(numel) times the RMS of plain's whole gradient)."""
    worst_param: str
    """The parameter of `grad_err`."""
    step_err: float
    """Max over parameters of |update - own step| / |own step|: the applied update against one step of
    the engine's optimizer on the reduced gradient from the masters before the step."""
    update_err: float
    """The applied update against plain's gradient stepped by the same optimizer from float32 masters
    (module docstring): reported under Adam, judged through `update_ratio` under SGD."""
    optimizer: str = "adam"
    """The engine's optimizer: torch's Adam from DeepSpeed's config, or a client torch SGD."""
    update_ratio: float | None = None
    """SGD: the worst parameter's distance from plain's float32 step over float32's allowance
    (`deepspeed_update`), judged <= 1; None under Adam."""
    offload: str = "none"
    """The project's tiers DeepSpeed held on the host, as their canonical string
    (`deepspeed.offload_sections`): optimizer is its `offload_optimizer`, params its `offload_param`."""
    offload_err: float | None = None
    """With `offload`: the reduced gradient against the same method's on the same engine without it."""
    grad_tolerance: float = GRAD_TOLERANCE
    step_tolerance: float = STEP_TOLERANCE
    reductions: dict[str, int]
    """Per micro-step, how many parameters ZeRO reduced 0, 1 or more times ('0', '1', '2+')."""
    ok: bool


@dataclass(frozen=True)
class EngineStep:
    """What one method's DeepSpeed loop did (`_engine_step`), every tensor whole, keyed by parameter name."""

    grads: dict[str, torch.Tensor]
    """The reduced float32 gradients ZeRO handed its optimizer."""
    update: dict[str, torch.Tensor]
    """The applied update: the parameters after the step minus before, in their dtype."""
    own_step: dict[str, torch.Tensor]
    """One step of the engine's optimizer on `grads` from the masters before, as the same update."""
    reductions: Counter


def verify_deepspeed(
    specs: tuple[VerifySpec, ...], *, nproc: int, shards: tuple[str, ...] = ("zero1", "zero2"),
    micro_steps: int = 1, offload: Tiers | str = Tiers.NONE, cpu_adam: bool = False,
    optimizer: str = "adam", timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[DeepSpeedResult]:
    """Verify every spec's methods under every ZeRO stage across `nproc` ranks (module docstring), with
    DeepSpeed's offload sections for the tiers `offload` (a `Tiers` or what `Tiers.of` reads) and, with
    `cpu_adam`, DeepSpeed's CPU Adam stepping the offloaded optimizer (`deepspeed.zero_config`);
    `optimizer` "sgd" steps a client torch SGD instead of the config's Adam."""
    check_installed()
    if not specs:
        raise ConfigError("give at least one spec")
    for spec in specs:
        check_spec(spec, shards)
    offload = offload_choice(offload)
    for shard in shards:
        offload_sections(offload, STAGES[shard])
    if check_optimizer(optimizer) != "adam" and (cpu_adam or offload.optimizer):
        raise ConfigError("deepspeed verify offloads the optimizer with Adam only (DeepSpeed's CPU Adam or "
                          f"torch's), got {optimizer}")
    per_rank = run_ranks(rank_verify, nproc, args=(specs, shards, micro_steps, offload, cpu_adam, optimizer),
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


def rank_verify(rank: int, world: int, specs, shards, micro_steps: int, offload: Tiers = Tiers.NONE,
                cpu_adam: bool = False, optimizer: str = "adam") -> list[DeepSpeedResult]:
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
        plain_grads = _plain_gradient(model, spec, batches)
        plain_update = _plain_update(model, plain_grads, optimizer)
        exact_update = _plain_update(model, plain_grads, optimizer, torch.float64)
        for shard in shards:
            for method in spec.methods:
                run = _engine_step(model, method, shard, spec, batches[rank], offload, cpu_adam, optimizer)
                result = _result(method, shard, spec, world, len(batches[rank]), run, plain_grads,
                                 plain_update, optimizer=optimizer, exact_update=exact_update)
                if offload:
                    kept = _engine_step(model, method, shard, spec, batches[rank], optimizer=optimizer)
                    result = _with_offload(result, offload, max_grad_err(run.grads, kept.grads)[0])
                results.append(result)
    return results


def _batch(spec: VerifySpec, model, rank: int, micro: int):
    step = spec.step
    batch = random_batch(vocab_size=model.config.vocab_size, seq_len=step.seq_len_tokens,
                         batch_size=step.batch_size, padding=spec.padding,
                         seed=step.seed + 1 + rank + 1000 * micro, device="cpu")
    batch = rank_padded(batch, rank, spec.padding)
    labels, inputs = objective_inputs(step.objective, batch, step.seed + rank + 1000 * micro)
    return batch, labels, inputs


def _loss(run_or_model, batch, labels, inputs):
    return run_or_model.loss(batch.input_ids, attention_mask=batch.attention_mask, labels=labels, **inputs)


def _plain_gradient(model, spec: VerifySpec, batches) -> dict[str, torch.Tensor]:
    """Plain's gradient of the mean loss over every rank's micro-steps (data parallelism's), by name."""
    model = copy.deepcopy(model)
    count = sum(len(rank_batches) for rank_batches in batches)
    with streambp_core.prepare(model, "plain", objective=spec.step.objective) as run:
        for rank_batches in batches:
            for batch in rank_batches:
                (_loss(run, *batch) / count).backward()
    return {name: p.grad.detach() for name, p in model.named_parameters() if p.requires_grad}


def _plain_update(model, grads: dict[str, torch.Tensor], optimizer: str,
                  master_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One step of torch's `optimizer` (lr `LR`) on `grads` from `master_dtype` masters of `model`'s
    parameters: float32 as ZeRO's, as the update the parameters take (`_as_update`); float64, the exact
    step, as a float64 update."""
    params = {name: p.detach() for name, p in model.named_parameters() if name in grads}
    masters = {name: param.to(master_dtype) for name, param in params.items()}
    stepped = _stepped(optimizer_class(optimizer), {"lr": LR}, masters, grads)
    if master_dtype == torch.float32:
        return _as_update(stepped, params)
    return {name: stepped[name] - masters[name] for name in params}


def _engine_step(model, method, shard, spec: VerifySpec, batches, offload: Tiers = Tiers.NONE,
                 cpu_adam: bool = False, optimizer: str = "adam") -> EngineStep:
    """The user's DeepSpeed loop on a copy of `model` over this rank's micro-steps (module docstring,
    step 2); reductions are tallied 0, 1, 2+ per micro-step on ZeRO-2/3, which reduce every micro-step,
    per step on ZeRO-1, which reduces at the accumulation boundary only."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    model = copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    config = zero_config(STAGES[shard], micro_batch=spec.step.batch_size, accumulation=len(batches),
                         lr=LR, offload=offload, cpu_adam=cpu_adam, optimizer=optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    client = None if optimizer == "adam" else optimizer_class(optimizer)(trainable, lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, optimizer=client,
                                           config=config)
    check_engine(engine)
    params = {name: p for name, p in engine.module.named_parameters() if name in before}
    counts = count_reductions(engine.optimizer)
    tallies: Counter = Counter()
    with streambp_core.prepare(engine, method, spec.step_of(method).stream) as run:
        for batch in batches:
            if shard != "zero1":
                counts.clear()
            engine.backward(_loss(run, *batch))
            if shard != "zero1":
                tallies.update(_tally(counts, engine.module))
            if engine.is_gradient_accumulation_boundary():  # collectives: every rank, in one order
                grads = {name: safe_get_full_grad(p).detach().clone() for name, p in params.items()}
                masters = {name: safe_get_full_fp32_param(p).detach().clone() for name, p in params.items()}
            engine.step()
    if shard == "zero1":
        tallies.update(_tally(counts, engine.module))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # ZeRO-3: whole again
        update = {name: p.detach() - before[name] for name, p in params.items()}
    own = _as_update(_own_step(engine.optimizer.optimizer, masters, grads), before)
    return EngineStep(grads=grads, update=update, own_step=own, reductions=tallies)


def _own_step(optimizer, masters: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
    """`masters` after one step of a fresh optimizer of `optimizer`'s class and settings (ZeRO's basic
    optimizer: torch's Adam or DeepSpeed's CPU Adam) on `grads`, one tensor per parameter."""
    group = optimizer.param_groups[0]
    accepted = inspect.signature(type(optimizer)).parameters
    settings = {key: value for key, value in group.items() if key != "params" and key in accepted}
    if "adamw_mode" in accepted and hasattr(optimizer, "adam_w_mode"):
        settings["adamw_mode"] = optimizer.adam_w_mode
    return _stepped(type(optimizer), settings, masters, grads)


def _stepped(optimizer_class, settings: dict, masters: dict[str, torch.Tensor],
             grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of `masters` after one step of a fresh `optimizer_class(**settings)` on `grads`."""
    weights = {name: master.clone().requires_grad_() for name, master in masters.items()}
    for name, weight in weights.items():
        weight.grad = grads[name].to(weight.dtype)
    optimizer_class(list(weights.values()), **settings).step()
    return {name: weight.detach() for name, weight in weights.items()}


def _as_update(stepped: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Masters after a step, cast to the parameters' dtype, minus the parameters before: the update the
    parameters take."""
    return {name: stepped[name].to(before[name].dtype) - before[name] for name in before}


def _result(method, shard, spec, world, micro_steps, run: EngineStep, plain_grads, plain_update, *,
            optimizer: str = "adam", exact_update=None) -> DeepSpeedResult:
    grad_err, worst = max_grad_err(run.grads, plain_grads)  # the criterion of every verify
    step_err = max_rel_err(run.update, run.own_step)[0]
    update_err = max_rel_err(run.update, plain_update)[0]
    ratio = None
    if optimizer in LINEAR:
        ratio = update_ratio(run.update, plain_update, exact_update, GRAD_TOLERANCE)[0]
    return DeepSpeedResult(method=method, shard=shard, objective=spec.step.objective, nproc=world,
                           micro_steps=micro_steps, grad_err=grad_err, worst_param=worst, step_err=step_err,
                           update_err=update_err, optimizer=optimizer, update_ratio=ratio,
                           reductions=dict(run.reductions),
                           ok=grad_err <= GRAD_TOLERANCE and step_err <= STEP_TOLERANCE
                           and (ratio is None or ratio <= 1.0) and set(run.reductions) == {"1"})


def _with_offload(result: DeepSpeedResult, offload: Tiers, offload_err: float) -> DeepSpeedResult:
    """`result` with its offload figure, held to the gradient's bound too."""
    return replace(result, offload=str(offload), offload_err=offload_err,
                   ok=result.ok and offload_err <= GRAD_TOLERANCE)


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
