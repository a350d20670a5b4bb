"""Exactness across ranks: every method, sharded with FSDP2, against single-process plain backprop.

Steps of `verify_sharded` (in `nproc` spawned ranks, see `run_ranks`):
1. Every rank builds the same seeded model; rank r draws its own batch (seed + 1 + r).
2. Rank 0 runs unsharded plain on every rank's batch; the reference gradient is their mean (data-parallel
   training averages over ranks), the reference loss the mean loss.
3. For each shard stage and method: a fresh copy of the model is sharded (`shard_model`), one step runs
   on each rank's batch under a `CollectiveLog`, the gradients are all-gathered to full tensors, and rank 0
   compares them with the reference by the criterion single-process `verify` uses (`compare.max_grad_err`).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.distributed as dist

import streambp_core
from streambp_core.config import ConfigError, require_choice
from streambp_core.models import build_model, load_config
from streambp_core.models.adapters import decoder_parts
from streambp_core.parallel.comms import CollectiveLog
from streambp_core.parallel.fsdp import SHARD_STAGES, full_gradients, shard_model
from streambp_core.parallel.launch import DEFAULT_TIMEOUT_S, run_ranks
from streambp_core.step.parts.batch import objective_inputs, random_batch
from streambp_core.verify.compare import max_grad_err
from streambp_core.verify.methods import DTYPES, TOLERANCE, MethodResult, VerifySpec, run_step


@dataclass(frozen=True, kw_only=True)
class ShardedResult(MethodResult):
    """One method under one shard stage against the single-process reference (`verify`'s figures, and
    the collectives of the step)."""

    shard: str
    objective: str
    nproc: int
    all_gathers: int
    all_gather_bytes: int
    reduce_scatters: int
    reduce_scatter_bytes: int
    """Collectives of one step (forward + backward) on one rank; bytes of the full tensors."""
    units: int
    """FSDP units of the model: one per decoder layer and the root."""


@dataclass(frozen=True, kw_only=True)
class ShardedReport:
    """Every (spec, shard, method) result of one multi-rank verification (`SequenceReport` adds its
    sequence-parallel fields)."""

    nproc: int
    device: str
    results: tuple[ShardedResult, ...]

    @property
    def ok(self) -> bool:
        return all(result.ok for result in self.results)

    @property
    def source(self) -> str:
        return f"measured-{torch.device(self.device).type}"

    def to_dict(self) -> dict:
        """JSON-ready summary: the report's fields (a subclass's too), its source and verdict, the results."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "results"}
        return {**own, "source": self.source, "ok": self.ok,
                "results": [asdict(result) for result in self.results]}


def verify_sharded(
    specs: tuple[VerifySpec, ...], *, nproc: int, shards: tuple[str, ...] = SHARD_STAGES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ShardedReport:
    """Verify every spec's methods under every shard stage across `nproc` ranks (module docstring)."""
    if not specs:
        raise ConfigError("give at least one spec")
    for shard in shards:
        require_choice("shard", shard, SHARD_STAGES)
    devices = {spec.device for spec in specs}
    if len(devices) != 1:
        raise ConfigError(f"all specs must use one device, got {', '.join(sorted(devices))}")
    for spec in specs:
        if spec.step.dtype not in TOLERANCE:
            exact = ", ".join(TOLERANCE)
            raise ConfigError(f"sharded verify compares exact dtypes ({exact}), got {spec.step.dtype}")
        if spec.step.lora_rank:
            raise ConfigError("sharded verify checks full-parameter training; lora_rank must be 0")
    device = devices.pop()
    per_rank = run_ranks(_rank_verify, nproc, device=device, args=(specs, shards), timeout_s=timeout_s)
    return ShardedReport(nproc=nproc, device=device, results=tuple(per_rank[0]))


def _rank_verify(rank: int, world: int, specs, shards) -> list[ShardedResult]:
    """Body of each rank: results on rank 0, an empty list elsewhere."""
    results = []
    for spec in specs:
        model = build_model(load_config(spec.step.model), dtype=DTYPES[spec.step.dtype], device=spec.device,
                            seed=spec.step.seed)
        batches = [_rank_batch(spec, model, r) for r in range(world)]
        reference = _reference(model, spec, batches) if rank == 0 else None
        for shard in shards:
            for method in spec.methods:
                results.append(_sharded_step(model, method, shard, spec, batches[rank], reference))
    return results if rank == 0 else []


def _rank_batch(spec: VerifySpec, model, rank: int):
    return random_batch(vocab_size=model.config.vocab_size, seq_len=spec.step.seq_len_tokens,
                        batch_size=spec.step.batch_size, padding=spec.padding, seed=spec.step.seed + 1 + rank,
                        device=spec.device)


@dataclass(frozen=True, kw_only=True, eq=False)
class Reference:
    """Single-process plain over every rank's batch: the mean loss, its bound, the mean gradients (by
    parameter name), against which a cross-rank verify (sharded or sequence-parallel) compares."""

    loss: float
    loss_tolerance: float
    grads: dict


def _reference(model, spec: VerifySpec, batches) -> Reference:
    """Mean loss and mean gradients of unsharded plain over the ranks' batches, and the loss bound of
    single-process `verify` (relative `TOLERANCE` of the dtype: a float64 loss is float64)."""
    steps = [run_step(model, _rank_spec(spec, r).reference, batch) for r, batch in enumerate(batches)]
    grads = {name: _mean([step.grads[name] for step in steps]) for name in steps[0].grads}
    loss = sum(step.loss for step in steps) / len(steps)
    return Reference(loss=loss, loss_tolerance=TOLERANCE[spec.step.dtype] * max(1.0, abs(loss)), grads=grads)


def _rank_spec(spec: VerifySpec, rank: int) -> VerifySpec:
    """The spec whose seed draws rank `rank`'s objective inputs (advantages, reference log-probs)."""
    return replace(spec, step=replace(spec.step, seed=spec.step.seed + rank))


def _mean(grads):
    present = [grad for grad in grads if grad is not None]
    return None if not present else torch.stack(present).sum(dim=0) / len(grads)


def _sharded_step(model, method, shard, spec: VerifySpec, batch, reference) -> ShardedResult:
    """One step of `method` on a sharded copy of `model`; rank 0 compares with `reference`."""
    sharded = shard_model(copy.deepcopy(model), shard)
    rank_spec = _rank_spec(spec, dist.get_rank())
    step = rank_spec.step_of(method)
    labels, inputs = objective_inputs(step.objective, batch, step.seed)
    with streambp_core.prepare(sharded, method, step.stream) as run, CollectiveLog() as log:
        loss = run.loss(batch.input_ids, attention_mask=batch.attention_mask, labels=labels, **inputs)
        loss.backward()
    grads = full_gradients(sharded)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss = float(mean_loss) / dist.get_world_size()
    if reference is None:
        return None
    err, worst = max_grad_err(grads, reference.grads)  # the criterion single-process verify judges by
    tolerance = TOLERANCE[spec.step.dtype]
    loss_err = abs(mean_loss - reference.loss)
    counts = log.summary()
    return ShardedResult(
        method=method, shard=shard, objective=step.objective, nproc=dist.get_world_size(),
        max_rel_err=err, worst_param=worst, loss=mean_loss, loss_abs_err=loss_err, tolerance=tolerance,
        loss_tolerance=reference.loss_tolerance,
        all_gathers=counts.get("all_gather", {}).get("calls", 0),
        all_gather_bytes=counts.get("all_gather", {}).get("bytes", 0),
        reduce_scatters=counts.get("reduce_scatter", {}).get("calls", 0),
        reduce_scatter_bytes=counts.get("reduce_scatter", {}).get("bytes", 0),
        units=len(decoder_parts(sharded).layers) + 1,
        ok=err <= tolerance and loss_err <= reference.loss_tolerance,
    )
