"""Ulysses sequence parallelism under a trainer: `stream_trainer(trainer, method, sequence_parallel=N)`.

`sequence_parallel` consecutive ranks share each sequence (the group `methods.sequence` runs): every rank
of a group trains on the same rows, computes its contiguous shard of every sequence, and attends over the
whole sequence through the all-to-alls of `engine.sequence`. Under accelerate's FSDP2 plugin, with TRL's
SFTTrainer or DPOTrainer (their fused LM head scores the tokens; DPO's frozen reference model is sharded
the same way, prepared for the same method, or for streambp when the method streams its layers):

1. Rows. accelerate gives the ranks that share a data-parallel index the same batches when its data loader
   is prepared with a device mesh that names that dimension (`accelerate.data_loader.prepare_data_loader`:
   "for CP the same as TP applies"). accelerate's own ParallelismConfig cannot say so here: its `cp_size`
   runs torch's ring attention on the trainer's inputs and its `sp_size` DeepSpeed's ALST. So this
   trainer's accelerator prepares its data loaders with a (dp_shard, cp) = (world / N, N) mesh
   (`SameRows`), set on the instance and taken off by `close`; nothing else of accelerate reads it.
2. The decoder stack. Each training call gets the whole batch; the run computes this rank's shard at its
   global positions (`Run.shard_batch`) and returns the shard's hidden states (B, T_r, d): streambp through
   its streamed layers, plain, checkpoint and mst through the model's own forward with the sequence
   attention of `engine.sequence.hf`.
3. The head. The causal LM's fused call scores the shard against its slice of the globally shifted labels
   (`shift_labels`: the last token of a shard predicts the first of the next); the per-token fields come
   back gathered over the group, the whole sequence's (B, T - 1), so the trainer's loss, whatever it does
   with them, is the whole sequence's on every rank of the group. The gather's backward gives each rank
   its own tokens' slice of the gradient, so a rank's backward leaves its tokens' share of every
   parameter's gradient and the shares add up to the whole sequence's.
4. The reduction. FSDP2 averages the gradients over all world ranks, N of which hold shares of the same
   rows; the gather's backward scales each share by N, so the average is the data-parallel mean of whole
   rows' gradients, as plain training's over the same rows.

Refused by name (`sequence_refusals`): any engine but FSDP2, a world size N does not divide, trainers other
than SFTTrainer and DPOTrainer (GRPO generates completions on each rank), packed rows, losses that need
full logits, and an iterable dataset (accelerate dispatches its batches from rank 0 over every rank,
ignoring the mesh).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from streambp_core.config import ConfigError
from streambp_core.engine.packing import call_position_ids
from streambp_core.engine.sequence.group import SequenceGroup
from streambp_core.engine.stream.objectives import IGNORE_INDEX
from streambp_core.integrations.forwards import call_arguments, generating, not_streamable

PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
"""The per-token fields of TRL's fused head output (`trl.trainer.utils.FusedCausalLMOutput`)."""


def sequence_refusals(trainer, size: int, engine: str) -> list[tuple[bool, str, str]]:
    """(refused, setting, why) for `size` ranks per sequence on this trainer (module docstring)."""
    import torch.distributed as dist

    args = trainer.args
    world = dist.get_world_size() if dist.is_initialized() else 1
    names = [cls.__name__ for cls in type(trainer).__mro__]
    dataset = getattr(trainer, "train_dataset", None)
    dispatch = getattr(getattr(trainer.accelerator, "dataloader_config", None), "dispatch_batches", None)
    setting = f"sequence_parallel={size}"
    return [
        (not isinstance(size, int) or size < 1, setting, "give a positive number of ranks per sequence"),
        (engine != "fsdp2", f"{setting} on engine {engine}",
         "it runs under accelerate's FSDP2 plugin (DeepSpeed ZeRO's reduction hooks are not shared out)"),
        (world % size != 0, f"{setting} over {world} ranks", "the ranks must split into whole groups"),
        ("SFTTrainer" not in names and "DPOTrainer" not in names, f"{setting} with {type(trainer).__name__}",
         "TRL's SFTTrainer and DPOTrainer are served (their fused LM head scores each rank's shard); GRPO "
         "generates completions on each rank, which a group would not share"),
        (bool(getattr(args, "packing", False) or getattr(args, "padding_free", False)),
         f"packing or padding_free with {setting}", "each shard takes its global positions; a packed row's "
                                                    "restart per document"),
        (args.label_smoothing_factor > 0 or trainer.compute_loss_func is not None,
         f"label_smoothing_factor or compute_loss_func with {setting}", "they need the full logits"),
        (isinstance(dataset, torch.utils.data.IterableDataset) or dispatch is True,
         f"an iterable dataset (dispatch_batches) with {setting}",
         "accelerate dispatches its batches from rank 0 over every rank, not over the data-parallel ranks"),
    ]


class SameRows:
    """The trainer's accelerator prepares its data loaders over (dp_shard, cp) = (world / size, size): the
    `size` consecutive ranks of one sequence group get the same batches. Holds the group's SequenceGroup."""

    def __init__(self, trainer, size: int) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        accelerator = trainer.accelerator
        if not callable(getattr(accelerator, "_prepare_device_mesh", None)):
            raise ConfigError("sequence_parallel needs accelerate's Accelerator._prepare_device_mesh "
                              "(accelerate >= 1.10), which gives its data loaders their mesh")
        world = dist.get_world_size()
        self.mesh = init_device_mesh(accelerator.device.type, (world // size, size),
                                     mesh_dim_names=("dp_shard", "cp"))
        self.group = SequenceGroup.of_process_group(self.mesh.get_group("cp"))
        self._accelerator = accelerator
        accelerator._prepare_device_mesh = self._data_mesh

    def _data_mesh(self):
        return self.mesh

    def close(self) -> None:
        """The accelerator's own mesh for its data loaders again."""
        if vars(self._accelerator).get("_prepare_device_mesh") == self._data_mesh:
            del self._accelerator._prepare_device_mesh


class ShardScope:
    """Whether the decoder stack is inside the head's fused call (the one call it computes a shard for)."""

    def __init__(self) -> None:
        self.active = False

    @contextlib.contextmanager
    def open(self):
        """The block in which the decoder stack answers with this rank's shard."""
        self.active = True
        try:
            yield
        finally:
            self.active = False


def sequence_backbone_forward(run, previous: Callable[..., Any], scope: ShardScope) -> Callable[..., Any]:
    """A decoder-stack forward that answers the head's fused call with this rank's shard (B, T_r, d) of
    the whole batch it is given; generation keeps the forward that was there (module docstring, 2)."""
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_outputs import BaseModelOutputWithPast

    def forward(self, *args, **kwargs):
        call = call_arguments(self, args, kwargs)
        if not scope.active:
            if generating(call) or not torch.is_grad_enabled():
                return previous(*args, **kwargs)
            raise ConfigError(f"a {run.method} model under sequence parallelism trains through a fused LM "
                              "head's call only (TRL's SFT and DPO trainers); this forward needs full logits")
        reason = not_streamable(call)
        if reason is not None:
            raise ConfigError(f"a {run.method} model cannot train on a forward with {reason}")
        input_ids, attention_mask = call["input_ids"], call.get("attention_mask")
        position_ids = call_position_ids(call)
        if position_ids is not None and run.packed_rows(input_ids, attention_mask, position_ids) is None:
            position_ids = None  # 0..T-1 in every row: ordinary rows, each shard at its global positions
        start, end = run.shard_batch(input_ids, attention_mask, position_ids)
        with torch.autocast(input_ids.device.type, enabled=False):
            if run.streams_layers:
                hidden = run.hidden_states(input_ids, attention_mask)
                hidden = checkpoint(run.parts.norm, hidden, use_reentrant=False)
                return BaseModelOutputWithPast(last_hidden_state=hidden)
            inputs = run.model_inputs(attention_mask, None)
            return previous(input_ids=input_ids[:, start:end], use_cache=False, **inputs)

    return forward


def sequence_head_forward(run, previous: Callable[..., Any], scope: ShardScope) -> Callable[..., Any]:
    """A causal-LM forward that runs a fused LM head's call (`fused_lm_head=True`, TRL's) on this rank's
    shard and returns its per-token fields gathered over the group (module docstring, 3 and 4)."""
    group = run.sequence_group

    def forward(self, *args, **kwargs):
        call = call_arguments(self, args, kwargs)
        if not call.get("fused_lm_head"):
            return previous(*args, **kwargs)
        labels, shifted = call.pop("labels", None), call.pop("shift_labels", None)
        num_items = call.pop("num_items_in_batch", None)
        if shifted is None:
            if labels is None:
                raise ConfigError("a fused LM head's call under sequence parallelism needs labels")
            shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        total = shifted.shape[1]
        start, end = group.shard_bounds(total)
        with scope.open():
            output = previous(**call, shift_labels=shifted[:, start:end])
        keep = total if labels is None else total - 1  # unshifted labels: (B, T - 1), as the head gives
        for name in PER_TOKEN_FIELDS:
            value = getattr(output, name, None)
            if isinstance(value, Tensor):
                output[name] = gather_shards(value, group, total)[:, :keep]
        count = output.label_mask.sum().clamp(min=1) if num_items is None else num_items
        output["loss"] = -output.log_probs.sum() / count
        return output

    return forward


def gather_shards(value: Tensor, group: SequenceGroup, total_tokens: int) -> Tensor:
    """(B, T_r, ...) of this rank's shard -> (B, T, ...) of the whole sequence, on every rank of `group`.
    Backward: this rank's slice of the gradient, times the group's size (module docstring, 4)."""
    return _GatherShards.apply(value, group, total_tokens)


def _all_gather(value: Tensor, group: SequenceGroup, total_tokens: int) -> Tensor:
    """The shards of every rank along dimension 1, in rank order (padded to one size for the exchange)."""
    import torch.distributed as dist

    sizes = group.shard_sizes(total_tokens)
    wire = value.to(torch.int32) if value.dtype == torch.bool else value  # gloo moves no bool
    padded = F.pad(wire.movedim(1, -1), (0, max(sizes) - wire.shape[1])).movedim(-1, 1).contiguous()
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded, group=group.process_group)
    whole = torch.cat([piece[:, :size] for piece, size in zip(pieces, sizes, strict=True)], dim=1)
    return whole.to(value.dtype)


class _GatherShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, group, total_tokens):
        ctx.bounds, ctx.size = group.shard_bounds(total_tokens), group.size
        return _all_gather(value, group, total_tokens)

    @staticmethod
    def backward(ctx, grad):
        start, end = ctx.bounds
        return grad[:, start:end] * ctx.size, None, None


def check_sequence_trainer(trainer, size: int, engine: str) -> None:
    """ConfigError naming the first setting `sequence_refusals` refuses."""
    for refused, setting, why in sequence_refusals(trainer, size, engine):
        if refused:
            raise ConfigError(f"{setting} cannot train: {why}")


def set_sequence_forwards(run, causal_lm: nn.Module, set_forward, undo: list) -> None:
    """Set the sharded decoder-stack and fused-head forwards on the run's model (undone by `undo`)."""
    scope = ShardScope()
    backbone = run.parts.backbone
    undo.append(set_forward(backbone, sequence_backbone_forward(run, backbone.forward, scope)))
    undo.append(set_forward(causal_lm, sequence_head_forward(run, causal_lm.forward, scope)))
