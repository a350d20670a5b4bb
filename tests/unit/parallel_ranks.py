"""Rank bodies for the multi-process tests (a light module: spawned ranks import it)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank_and_sum(rank: int, world: int) -> tuple[int, float]:
    """Each rank returns its rank and the all-reduced sum of ranks."""
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, float(total)


def rank_prints_and_sums(rank: int, world: int) -> tuple[int, float]:
    """Each rank prints to its stdout, through Python and through the file descriptor, as engines do; then
    `rank_and_sum`."""
    print(f"rank {rank} says hello through print", flush=True)
    os.write(1, f"rank {rank} says hello through fd 1\n".encode())
    return rank_and_sum(rank, world)


def rank_one_raises(rank: int, world: int) -> None:
    """Rank 1 raises while rank 0 waits in a collective."""
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def rank_one_dies(rank: int, world: int) -> None:
    """Rank 1 exits hard (no error record) while rank 0 waits in a collective."""
    if rank == 1:
        os._exit(3)
    dist.barrier()


def sequence_all_to_all(rank: int, world: int, total_tokens: int) -> dict[str, float]:
    """Each rank swaps its shard of a shared float64 sequence to head layout and back, with gradients;
    returns the errors against the same tensor sliced by hand."""
    from streambp_core.engine.sequence.group import SequenceGroup, heads_to_seq, seq_to_heads

    group = SequenceGroup.of_process_group()
    full = torch.arange(2 * total_tokens * 4 * 3, dtype=torch.float64).view(2, total_tokens, 4, 3)
    start, end = group.shard_bounds(total_tokens)
    mine = full[:, start:end].clone().requires_grad_(True)
    heads = seq_to_heads(mine, group, total_tokens)
    local = 4 // world
    expected = full[:, :, rank * local:(rank + 1) * local]
    back = heads_to_seq(heads, group, total_tokens)
    weights = torch.linspace(-1, 1, heads.numel(), dtype=torch.float64).view_as(heads)
    (heads * weights).sum().backward()
    full_weights = torch.cat([weights] * world, dim=2)  # every rank weights its heads alike
    return {
        "heads": float((heads - expected).abs().max()),
        "round_trip": float((back - mine).abs().max()),
        "grad": float((mine.grad - full_weights[:, start:end]).abs().max()),
    }


def zero3_uneven_lengths(rank: int, world: int, offload: str = "none") -> dict[str, int]:
    """streambp on DeepSpeed ZeRO-3 with a different sequence length (so chunk count) on each rank: one
    micro-step and one optimizer step; returns the all-gathers its units issued, the units, the chunks.
    With DeepSpeed's offload sections for `offload` (`zero_config`), also how many parameters have their
    partition (`ds_tensor`) in DeepSpeed's host buffer for offloaded partitions, of how many."""
    import deepspeed

    import streambp_core
    from streambp_core.models import build_model, load_config
    from streambp_core.parallel.deepspeed import zero_config

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(load_config("tiny/llama"), dtype=torch.float64, device="cpu", seed=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=zero_config(3, micro_batch=1, offload=offload))
    seq_len = 8 + 16 * rank
    generator = torch.Generator().manual_seed(rank)
    input_ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=generator)
    with streambp_core.prepare(engine, "streambp", partition_size=4, head_partition_size=4) as run:
        engine.backward(run.loss(input_ids))
        engine.step()
        units = run.zero3.num_units - 1  # unit 0 (the embedding) runs under DeepSpeed's own hooks
        gathers = run.zero3.gathers
    host = {buffer.untyped_storage().data_ptr()
            for buffer in getattr(engine.optimizer, "param_groups_fp16_flat_cpu_memory", [])}
    params = list(engine.module.parameters())
    in_host = sum(p.ds_tensor.untyped_storage().data_ptr() in host for p in params)
    return {"gathers": gathers, "units": units, "chunks": seq_len // 4, "in_host_buffer": in_host,
            "params": len(params)}
