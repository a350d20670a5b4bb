"""Train with a prepared model inside transformers' `Trainer` and TRL's trainers, with one call.

    from streambp_core.integrations import stream_trainer
    trainer = SFTTrainer(model=model, args=SFTConfig(...), train_dataset=dataset)   # or DPO, GRPO, Trainer
    stream_trainer(trainer, "streambp", partition_size=2000, head_partition_size=100)
    trainer.train()

Under accelerate's FSDP2 plugin `stream_trainer(trainer, method, sequence_parallel=N)` shares each
sequence over N ranks (Ulysses, TRL's SFT and DPO trainers; `sequence_trainer`);
`offload="...,optimizer"` keeps the trainer's AdamW in host memory (`optimizer_tier`).
`trainer_settings` / `trainer_settings_line` turn a measured step's method and partition sizes into that
call. The trainer libraries are imported on first use of `stream_trainer` (install the `train` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streambp_core.integrations.settings import trainer_settings, trainer_settings_line
from streambp_core.lazy import lazy_attributes

if TYPE_CHECKING:
    from streambp_core.integrations.trainers import TrainerStream, stream_trainer

__all__ = ["TrainerStream", "stream_trainer", "trainer_settings", "trainer_settings_line"]

_LAZY = {"TrainerStream": "streambp_core.integrations.trainers",
         "stream_trainer": "streambp_core.integrations.trainers"}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
