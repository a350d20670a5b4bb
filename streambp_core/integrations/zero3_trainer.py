"""DeepSpeed ZeRO-3 under a trainer: the run prepared on the trainer's DeepSpeed engine, one optimizer step
at a time.

ZeRO-3 needs two things a run prepared before `trainer.train()` cannot give (`parallel.deepspeed`):
- the run must be prepared on the engine (`prepare(engine, ...)`): streambp and mst then gather each of
  their units once per forward and once per backward and hand each gradient to ZeRO once
  (`engine.engines.zero3.Zero3Units`), which needs the parameters ZeRO-3 partitioned;
- each loss must run inside the engine's forward, where ZeRO-3 starts a micro-step (without it the
  micro-steps' gradients would overwrite rather than accumulate).
A trainer builds its engine inside `train()` (`Accelerator.prepare` calls `deepspeed.initialize`), and
calls that engine for every training forward (`Trainer.compute_loss` calls `model_wrapped`, TRL's
trainers the model they are handed, the same engine). So `Zero3Preparation`, a `TrainerCallback`, finds
the engine at `on_train_begin` (after the trainer built it) and hooks the engine's own forward: at the
first training forward of each optimizer step (grad on, the engine in training mode) it prepares the
run on the engine, before the engine calls its module, so the streamed forwards (`forwards.py`) answer
that call; the loss is then computed inside the engine's forward already, and the run does not enter
it a second time (a nested engine forward would register DeepSpeed's backward hooks twice and divide
the gradients by the accumulation twice). At `on_step_end` (the optimizer has stepped) the run is closed:
DeepSpeed's module hooks are back on every module between steps, where TRL's GRPO generates (its
`unwrap_model_for_generation` takes DeepSpeed's hooks off every module and registers new ones), so each
step's run takes the hooks the model holds then.

Inside the engine's forward DeepSpeed makes any partitioned parameter read by attribute an "external
parameter" of the module running (and gathers it); the streamed forwards undo that for what the run
reads (`forwards._no_new_external_params`), and under TRL hold the run's head unit gathered until TRL's
fused head has read the LM head's weight (`forwards.HeadUnit`): the run's units gather and release
their own parameters.

So a trainer must not run the model between the micro-steps of one optimizer step outside the engine's
training forward: GRPO generating inside a step (`steps_per_generation x num_iterations` not a multiple
of `gradient_accumulation_steps`) is refused by name for the methods whose units take DeepSpeed's
hooks off (`zero3_refusals`).

A frozen reference model (TRL's DPO) is a DeepSpeed engine of its own that TRL builds and calls; its
streamed run is prepared on it once (`stream_trainer`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import TrainerCallback

from streambp_core.config import ConfigError
from streambp_core.engine.engines.reduction import engine_and_module
from streambp_core.methods import Run
from streambp_core.registry import METHODS, method_class

PrepareStep = Callable[[torch.nn.Module], tuple[Run, list[Callable[[], None]]]]
"""Prepare the trained model's run on an engine; (the run, its undo in order of doing)."""


def zero3_refusals(trainer, method: str) -> list[tuple[bool, str, str]]:
    """(refused, setting, why) of a trainer that would run the model between the micro-steps of one
    optimizer step (module docstring); nothing for a trainer without generation."""
    args = trainer.args
    per_generation = getattr(args, "steps_per_generation", None)
    if per_generation is None or method not in METHODS or not method_class(method).drives_modules:
        return []  # only a run that drives its units takes DeepSpeed's hooks off them
    every = per_generation * int(getattr(args, "num_iterations", 1) or 1)
    return [(every % args.gradient_accumulation_steps != 0,
             f"steps_per_generation x num_iterations = {every} under DeepSpeed ZeRO-3",
             "it generates inside an optimizer step, while the run holds DeepSpeed's hooks off its units; "
             "make it a multiple of gradient_accumulation_steps")]


class Zero3Preparation(TrainerCallback):
    """Prepares the trained model's run on the trainer's DeepSpeed ZeRO-3 engine for each optimizer step
    (module docstring); `close()` closes the open run and takes the engine's hooks off."""

    def __init__(self, trainer, prepare_step: PrepareStep) -> None:
        self.trainer = trainer
        self._prepare_step = prepare_step
        self.run: Run | None = None
        """The run of the optimizer step in progress (None between steps)."""
        self._undo: list[Callable[[], None]] = []
        self._handles: list = []
        self._engine: torch.nn.Module | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        """Find the engine the trainer built and hook its forward."""
        engine, _ = engine_and_module(self.trainer.model_wrapped)
        if engine is None:
            raise ConfigError("DeepSpeed ZeRO-3: the trainer did not wrap its model in a DeepSpeed engine "
                              f"(model_wrapped is {type(self.trainer.model_wrapped).__name__}); a streamed "
                              "run on ZeRO-3 needs the engine")
        if engine is not self._engine:
            self.close()
            self._engine = engine
            self._handles = [engine.register_forward_pre_hook(self._before_forward)]

    def on_step_end(self, args, state, control, **kwargs):
        """The optimizer stepped: close this step's run (DeepSpeed's hooks back on every module)."""
        self._close_run()

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def _before_forward(self, engine: torch.nn.Module, args) -> None:
        """A forward pre-hook of the engine: prepare this step's run at its first training forward."""
        if self.run is None and torch.is_grad_enabled() and engine.training:
            self.run, self._undo = self._prepare_step(engine)

    def _close_run(self) -> None:
        undo, self._undo = self._undo, []
        run, self.run = self.run, None
        try:
            while undo:
                undo.pop()()
        finally:
            if run is not None:
                run.close()

    def close(self) -> None:
        """Close the open run and take the engine's forward hook off."""
        self._close_run()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._engine = None
