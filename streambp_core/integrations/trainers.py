"""One call that makes a transformers `Trainer` or a TRL trainer train its model with a streambp method.

    trainer = SFTTrainer(model=model, args=SFTConfig(...), train_dataset=dataset)
    stream_trainer(trainer, "streambp", partition_size=2000)
    trainer.train()

The trainer is not subclassed or patched: its own `compute_loss`, `loss.backward()`, gradient
accumulation, clipping, optimizer, LoRA and checkpoint saving run as they do without streambp. What
changes is the model's answer to the trainer's forward calls (see `forwards.py`).

Under `accelerate launch` with the FSDP2 or the DeepSpeed plugin (ZeRO-1, 2 or 3) the same call works on
every rank; what it does there, and what it refuses, is in `engines.py` (ZeRO-3: `zero3_trainer.py`).
With `sequence_parallel=N` (FSDP2, TRL's SFT and DPO trainers) N ranks share each sequence, Ulysses-style
(`sequence_trainer.py`); with the optimizer offload tier the trainer's AdamW steps in host memory
(`optimizer_tier.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from streambp_core.config import ConfigError, check_method
from streambp_core.engine.sequence.group import SequenceGroup
from streambp_core.integrations.checks import check_trainer
from streambp_core.integrations.engines import (
    DeepSpeedReduction,
    deepspeed_stage,
    shard_for_plugin,
    trainer_engine,
)
from streambp_core.integrations.forwards import (
    HeadUnit,
    set_forward,
    streamed_backbone_forward,
    streamed_loss_forward,
)
from streambp_core.integrations.optimizer_tier import optimizer_refusals, set_host_optimizer
from streambp_core.integrations.sequence_trainer import (
    SameRows,
    check_sequence_trainer,
    set_sequence_forwards,
)
from streambp_core.integrations.zero3_trainer import Zero3Preparation
from streambp_core.methods import Run, prepare
from streambp_core.registry import method_class
from streambp_core.tiers import Tiers


class TrainerStream:
    """What `stream_trainer` set up: the prepared runs and the forwards it set; `close()` undoes it all.

    Under DeepSpeed ZeRO-3 the trained model's run is prepared for each optimizer step inside `train()`
    (`zero3`, a `zero3_trainer.Zero3Preparation`); `runs` holds the frozen reference model's run only."""

    def __init__(self, method: str, runs: list[Run], undo: list[Callable[[], None]],
                 zero3: Zero3Preparation | None = None) -> None:
        self.method = method
        self.runs = runs
        self.zero3 = zero3
        self._undo = undo

    def close(self) -> None:
        """Give the trainer's model (and reference model) back unprepared (under FSDP2 it stays sharded,
        as accelerate would have left it)."""
        while self._undo:
            self._undo.pop()()
        for run in self.runs:
            run.close()

    def __enter__(self) -> TrainerStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def stream_trainer(trainer, method: str = "streambp", *, sequence_parallel: int = 1,
                   **options) -> TrainerStream:
    """Prepare `trainer.model` (and a TRL trainer's frozen `ref_model`) for `method`, then train as usual.

    `trainer` is a `transformers.Trainer` or a TRL 1.15+ trainer (SFT, DPO, GRPO, ...), built already.
    Options are those of `streambp_core.prepare` (partition_size, head_partition_size, mlp_chunk_size,
    attn). TRL's trainers keep their own fused LM head; `head_partition_size` sizes the streamed head of a
    plain `Trainer`. `offload` with the optimizer tier makes the trainer build its AdamW in host memory
    (`optimizer_tier`). `sequence_parallel`: ranks per sequence (Ulysses; FSDP2 and TRL's SFT or DPO
    trainer, whose update then equals plain training's over the same rows, `sequence_trainer`). A trainer
    setting that cannot work with a prepared model raises ConfigError naming it.
    """
    check_method(method)
    if not hasattr(trainer, "model") or not hasattr(trainer, "args"):
        raise ConfigError(f"stream_trainer() takes a transformers Trainer or a TRL trainer, got "
                          f"{type(trainer).__name__}")
    check_trainer(trainer, method)
    engine = trainer_engine(trainer)
    if sequence_parallel != 1:
        check_sequence_trainer(trainer, sequence_parallel, engine)
    host_optimizer = Tiers.of(options.get("offload", Tiers.NONE)).optimizer
    if host_optimizer:
        for refused, setting, why in optimizer_refusals(trainer, engine):
            if refused:
                raise ConfigError(f"{setting} cannot train: {why}")
    if engine == "fsdp2":
        shard_for_plugin(trainer)
    zero3 = engine == "deepspeed" and deepspeed_stage(trainer) == 3
    runs: list[Run] = []
    undo: list[Callable[[], None]] = []
    stream = TrainerStream(method, runs, undo)
    try:
        group = None
        if host_optimizer:
            undo.append(set_host_optimizer(trainer))
        if sequence_parallel != 1:
            rows = SameRows(trainer, sequence_parallel)
            undo.append(rows.close)
            group = rows.group
        if zero3:
            stream.zero3 = _zero3_preparation(trainer, method, options, undo)
        else:
            reduction = _deepspeed_reduction(trainer.model, method, undo) if engine == "deepspeed" else None
            runs.append(_prepare_trained(trainer.model, method, options, undo, reduction, group))
        ref_model = getattr(trainer, "ref_model", None)
        if type(ref_model).__name__ == "DeepSpeedEngine" and not zero3:  # TRL wraps a frozen reference
            ref_model = ref_model.module  # ZeRO-1/2: the module; ZeRO-3: the engine itself (`prepare`)
        streams = method_class(method).streams_layers
        if ref_model is not None and (streams or group is not None):  # sharded: every method's reference
            runs.append(_prepare_frozen(ref_model, "streambp" if streams else method, options, undo, group))
    except BaseException:
        stream.close()
        raise
    return stream


def _zero3_preparation(trainer, method: str, options: dict, undo: list) -> Zero3Preparation:
    """The callback that prepares the trained model's run on the ZeRO-3 engine for each optimizer step
    (`zero3_trainer`)."""

    def prepare_step(engine: nn.Module) -> tuple[Run, list[Callable[[], None]]]:
        step_undo: list[Callable[[], None]] = []
        return _prepare_trained(engine, method, options, step_undo, None), step_undo

    callback = Zero3Preparation(trainer, prepare_step)
    trainer.add_callback(callback)
    undo.append(lambda: trainer.remove_callback(callback))
    undo.append(callback.close)
    return callback


def _prepare_trained(model: nn.Module, method: str, options: dict, undo: list,
                     reduction: DeepSpeedReduction | None, group: SequenceGroup | None = None) -> Run:
    """`model` (or a ZeRO-3 engine wrapping it) prepared for `method`, the trainer's forwards set on it;
    with a sequence group, the sharded forwards of `sequence_trainer`."""
    run = _prepare_in_engine(model, method, options, group)
    if group is not None:
        set_sequence_forwards(run, _causal_lm(run.model), set_forward, undo)
        return run
    arm = None if reduction is None else reduction.arm
    if run.drives_modules:  # its loss is its chunked or streamed head's, not the model's own forward
        causal_lm = _causal_lm(run.model)
        undo.append(set_forward(causal_lm, streamed_loss_forward(run, causal_lm.forward, arm)))
    if run.streams_layers:
        _stream_backbone(run, undo)
    if reduction is not None:
        undo.append(run.parts.backbone.register_forward_hook(reduction.hook_output).remove)
    return run


def _deepspeed_reduction(model: nn.Module, method: str, undo: list) -> DeepSpeedReduction:
    """The deferral a DeepSpeed-held model arms once per backward (`engines.DeepSpeedReduction`)."""
    reduction = DeepSpeedReduction(model, method)
    undo.append(reduction.close)
    return reduction


def _prepare_frozen(model: nn.Module, method: str, options: dict, undo: list,
                    group: SequenceGroup | None = None) -> Run:
    """A frozen reference model prepared for `method` (streamed, or with a sequence group sharded)."""
    run = _prepare_in_engine(model, method, options, group)
    if group is not None:
        set_sequence_forwards(run, _causal_lm(run.model), set_forward, undo)
    else:
        _stream_backbone(run, undo)
    return run


def _prepare_in_engine(model: nn.Module, method: str, options: dict,
                       group: SequenceGroup | None = None) -> Run:
    """`prepare(model, method)`; on a DeepSpeed engine (ZeRO-3, whose partitioned model only the engine
    itself may be prepared through), a run whose losses do not enter the engine again: the trainer calls
    the engine for every forward and the streamed forwards answer inside it (`zero3_trainer`)."""
    run = prepare(model, method, sequence_group=group, **options)
    run.engine = None
    return run


def _stream_backbone(run: Run, undo: list) -> None:
    backbone = run.parts.backbone
    head = None
    if run.zero3 is not None:  # ZeRO-3: the head unit held from the final norm to the trainer's head
        head = HeadUnit(run)
        undo.append(_causal_lm(run.model).register_forward_hook(head.hook_output).remove)
    undo.append(set_forward(backbone, streamed_backbone_forward(run, backbone.forward, head)))


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers *ForCausalLM inside a peft wrapper (or the model itself)."""
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    if not hasattr(base, "lm_head"):
        raise ConfigError(f"{type(base).__name__} is not a causal LM with an lm_head")
    return base
