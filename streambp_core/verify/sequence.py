"""Exactness of sequence parallelism across real ranks: every method on shards of each sequence against
single-process plain over the whole sequence.

Steps of `verify_sequence` (in `nproc` spawned ranks, see `run_ranks`):
1. The ranks form `nproc / sp` sequence groups of `sp` consecutive ranks (`SequenceGroup`); every rank
   builds the same seeded model, and group g draws its own batch (seed + 1 + g; objective inputs from
   seed + g), the WHOLE batch on each of its ranks.
2. Rank 0 runs single-process plain over each group's batch; the reference gradient is their mean (data
   parallelism across groups averages), the reference loss the mean loss.
3. For each method: a fresh copy of the model is prepared with the rank's group, one step runs under a
   `CollectiveLog` (each rank computes its shard), the gradients are summed over the sequence group
   (`sum_gradients`) and averaged over the groups, and rank 0 compares them with the reference by the
   criterion single-process `verify` uses (`compare.max_grad_err`).
   With a shard stage (zero2, zero3) the copy is sharded with FSDP2 over every rank instead, as ALST
   shards with ZeRO-3 across the ranks that share the sequence: FSDP2 averages the ranks' gradients, so
   the loss is multiplied by `sp` (the sum over a group, averaged over the groups), and the gradients are
   all-gathered to full tensors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

import streambp_core
from streambp_core.config import ConfigError, require_choice, sequence_group_problem
from streambp_core.engine.sequence.attention import kv_replication, lockstep_chunks
from streambp_core.engine.sequence.group import SequenceGroup, sum_gradients
from streambp_core.models import build_model, load_config
from streambp_core.models.adapters import decoder_parts
from streambp_core.models.lora import apply_lora
from streambp_core.parallel.comms import CollectiveLog
from streambp_core.parallel.fsdp import SHARD_STAGES, full_gradients, shard_model
from streambp_core.parallel.launch import DEFAULT_TIMEOUT_S, check_nproc, run_ranks
from streambp_core.step.parts.batch import objective_inputs, random_batch
from streambp_core.verify.compare import max_grad_err
from streambp_core.verify.methods import DTYPES, TOLERANCE, MethodResult, VerifySpec, run_step
from streambp_core.verify.sharded import Reference, ShardedReport


@dataclass(frozen=True, kw_only=True)
class SequenceResult(MethodResult):
    """One method under sequence parallelism against the single-process reference, and the collectives
    of its step on one rank."""

    objective: str
    nproc: int
    sp: int
    all_to_alls: int
    all_to_all_bytes: int
    """All-to-alls of one step (forward + backward) on rank 0, and the bytes they received."""
    all_reduces: int
    """All-reduces of one step on rank 0 (the objective's per-sequence sums), gradient sums excluded."""
    layers: int
    chunks: int
    """Lockstep chunks per layer (streambp's chunk loop; every rank runs as many)."""


@dataclass(frozen=True, kw_only=True)
class SequenceReport(ShardedReport):
    """Every (spec, method) result of one sequence-parallel verification."""

    sp: int
    shard: str
    """The FSDP2 stage the weights were sharded with over every rank, or none."""
    results: tuple[SequenceResult, ...]


def check_sequence_spec(spec: VerifySpec, nproc: int, sp: int, shard: str | None = None) -> None:
    """ConfigError, before any rank starts, for what a sequence-parallel verify cannot check."""
    check_nproc(nproc, spec.device)
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        raise ConfigError(f"sp must be a positive integer, got {sp!r}")
    if (problem := sequence_group_problem(sp, nproc, "--nproc")) is not None:
        raise ConfigError(problem)
    if spec.step.dtype not in TOLERANCE:
        raise ConfigError(f"sequence-parallel verify compares exact dtypes ({', '.join(TOLERANCE)}), "
                          f"got {spec.step.dtype}")
    if spec.step.lora_rank and shard is not None:
        raise ConfigError("sequence-parallel verify with a shard stage checks full-parameter training; "
                          "lora_rank must be 0")
    if spec.packing:
        raise ConfigError("sequence parallelism does not run packed rows")
    if spec.step.seq_len_tokens < sp:
        raise ConfigError(f"seq_len {spec.step.seq_len_tokens} is less than the {sp} sequence-parallel ranks")
    config = load_config(spec.step.model)
    heads = config.num_attention_heads
    kv_replication(heads, getattr(config, "num_key_value_heads", None) or heads, sp)


def verify_sequence(specs: tuple[VerifySpec, ...], *, nproc: int, sp: int, shard: str | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> SequenceReport:
    """Verify every spec's methods with `sp` ranks per sequence across `nproc` ranks, their weights
    sharded with FSDP2 stage `shard` over every rank when given (module docstring)."""
    if shard is not None:
        require_choice("shard", shard, SHARD_STAGES)
    if not specs:
        raise ConfigError("give at least one spec")
    devices = {spec.device for spec in specs}
    if len(devices) != 1:
        raise ConfigError(f"all specs must use one device, got {', '.join(sorted(devices))}")
    for spec in specs:
        check_sequence_spec(spec, nproc, sp, shard)
    device = devices.pop()
    per_rank = run_ranks(_rank_verify, nproc, device=device, args=(specs, sp, shard), timeout_s=timeout_s)
    return SequenceReport(nproc=nproc, sp=sp, shard=shard or "none", device=device,
                          results=tuple(per_rank[0]))


def _groups(rank: int, world: int, sp: int) -> tuple[SequenceGroup, int]:
    """This rank's sequence group (ranks g * sp .. (g + 1) * sp - 1) and its index g; every rank creates
    every group, as torch.distributed requires."""
    mine = None
    for index in range(world // sp):
        ranks = list(range(index * sp, (index + 1) * sp))
        process_group = dist.new_group(ranks)
        if rank in ranks:
            mine = (SequenceGroup(size=sp, rank=rank - index * sp, process_group=process_group), index)
    return mine


def _rank_verify(rank: int, world: int, specs, sp: int, shard: str | None) -> list[SequenceResult]:
    """Body of each rank: results on rank 0, an empty list elsewhere."""
    group, index = _groups(rank, world, sp)
    results = []
    for spec in specs:
        model = build_model(load_config(spec.step.model), dtype=DTYPES[spec.step.dtype], device=spec.device,
                            seed=spec.step.seed)
        if spec.step.lora_rank:
            model = apply_lora(model, spec.step.lora_rank)
        batches = [_group_batch(spec, model, g) for g in range(world // sp)]
        reference = _reference(model, spec, batches) if rank == 0 else None
        for method in spec.methods:
            results.append(_sequence_step(model, method, spec, (group, index, shard), batches[index],
                                          reference))
    return results if rank == 0 else []


def _group_batch(spec: VerifySpec, model, index: int):
    return random_batch(vocab_size=model.config.vocab_size, seq_len=spec.step.seq_len_tokens,
                        batch_size=spec.step.batch_size, padding=spec.padding,
                        seed=spec.step.seed + 1 + index, device=spec.device)


def _group_spec(spec: VerifySpec, index: int) -> VerifySpec:
    """The spec whose seed draws group `index`'s objective inputs (advantages, reference log-probs)."""
    return replace(spec, step=replace(spec.step, seed=spec.step.seed + index))


def _reference(model, spec: VerifySpec, batches) -> Reference:
    """Mean loss and mean gradients of single-process plain over the groups' whole batches."""
    steps = [run_step(model, _group_spec(spec, g).reference, batch) for g, batch in enumerate(batches)]
    grads = {}
    for name in steps[0].grads:
        present = [step.grads[name] for step in steps if step.grads[name] is not None]
        grads[name] = None if not present else torch.stack(present).sum(dim=0) / len(steps)
    loss = sum(step.loss for step in steps) / len(steps)
    return Reference(loss=loss, loss_tolerance=TOLERANCE[spec.step.dtype] * max(1.0, abs(loss)), grads=grads)


def _sequence_step(model, method, spec: VerifySpec, where, batch, reference) -> SequenceResult | None:
    """One step of `method` on this rank's shard; gradients summed over the group, averaged over groups.
    `where`: (this rank's group, its index, the FSDP2 stage or None)."""
    group, index, shard = where
    copied = copy.deepcopy(model) if shard is None else shard_model(copy.deepcopy(model), shard)
    step = _group_spec(spec, index).step_of(method)
    labels, inputs = objective_inputs(step.objective, batch, step.seed)
    with streambp_core.prepare(copied, method, step.stream, sequence_group=group) as run, \
            CollectiveLog() as log:
        loss = run.loss(batch.input_ids, attention_mask=batch.attention_mask, labels=labels, **inputs)
        (loss if shard is None else loss * group.size).backward()  # FSDP2 averages over every rank
    world = dist.get_world_size()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss = float(mean_loss) / world  # every rank of a group holds its group's whole loss
    if shard is None:
        grads = _summed_gradients(copied, group, world // group.size)
    else:
        grads = full_gradients(copied)
    if reference is None:
        return None
    return _result(method, spec, step, group, grads, mean_loss, log, reference, decoder_parts(copied))


def _summed_gradients(model, group: SequenceGroup, groups: int) -> dict:
    """Every gradient summed over the sequence group (`sum_gradients`), then averaged over the groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    sum_gradients(params, group)
    if groups > 1:
        for param in params:
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def _result(method, spec, step, group, grads, mean_loss, log, reference, parts) -> SequenceResult:
    err, worst = max_grad_err(grads, reference.grads)  # the criterion single-process verify judges by
    tolerance = TOLERANCE[spec.step.dtype]
    loss_err = abs(mean_loss - reference.loss)
    counts = log.summary()
    chunks = len(lockstep_chunks(group, spec.step.seq_len_tokens, step.stream.partition_size))
    return SequenceResult(
        method=method, objective=step.objective, nproc=dist.get_world_size(), sp=group.size,
        max_rel_err=err, worst_param=worst, loss=mean_loss, loss_abs_err=loss_err, tolerance=tolerance,
        loss_tolerance=reference.loss_tolerance,
        all_to_alls=counts.get("all_to_all", {}).get("calls", 0),
        all_to_all_bytes=counts.get("all_to_all", {}).get("bytes", 0),
        all_reduces=counts.get("all_reduce", {}).get("calls", 0),
        layers=len(parts.layers), chunks=chunks,
        ok=err <= tolerance and loss_err <= reference.loss_tolerance,
    )
