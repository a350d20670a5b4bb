"""What `stream_trainer(..., sequence_parallel=N)` refuses by name before preparing anything: a trainer on
one process (no FSDP2 ranks to share a sequence), and each setting `sequence_refusals` lists (on a stand-in
trainer: the check reads the trainer's class, arguments, dataset and accelerator only). The exact update on
real ranks is checked in test_plan_emitted_files_train_exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl", minversion="1.15")

from streambp_core.config import ConfigError  # noqa: E402
from streambp_core.integrations import stream_trainer  # noqa: E402
from streambp_core.integrations.sequence_trainer import sequence_refusals  # noqa: E402
from streambp_core.models.load import tiny_config  # noqa: E402
from streambp_core.verify.trainer_setup import ParitySetup, trainer_factory  # noqa: E402


class StandIn:
    """A trainer as `sequence_refusals` reads it: its class names, `args`, dataset and accelerator."""

    def __init__(self, dataset=None, dispatch=None, **args) -> None:
        settings = {"packing": False, "padding_free": False, "label_smoothing_factor": 0.0} | args
        self.args = SimpleNamespace(**settings)
        self.compute_loss_func = None
        self.train_dataset = dataset
        self.accelerator = SimpleNamespace(dataloader_config=SimpleNamespace(dispatch_batches=dispatch))


class SFTTrainer(StandIn):
    """Stands in for TRL's."""


class DPOTrainer(StandIn):
    """Stands in for TRL's."""


class Trainer(StandIn):
    """Stands in for transformers'."""


class GRPOTrainer(StandIn):
    """Stands in for TRL's."""


class Rows(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


def refused(trainer, size: int = 1, engine: str = "fsdp2") -> list[str]:
    return [f"{setting}: {why}" for no, setting, why in sequence_refusals(trainer, size, engine) if no]


def test_a_trainer_on_one_process_is_refused_before_its_model_is_prepared(tmp_path) -> None:
    trainer = trainer_factory(ParitySetup(trainer="sft", model=tiny_config("qwen3"), rows=2), tmp_path)()
    forward = trainer.model.model.forward
    with pytest.raises(ConfigError, match="sequence_parallel=2 on engine single cannot train: it runs under "
                                          "accelerate's FSDP2 plugin"):
        stream_trainer(trainer, "streambp", sequence_parallel=2)
    assert trainer.model.model.forward == forward


@pytest.mark.parametrize(("trainer", "engine", "named"), [
    (SFTTrainer(), "deepspeed", "sequence_parallel=1 on engine deepspeed"),
    (Trainer(), "fsdp2", "sequence_parallel=1 with Trainer: TRL's SFTTrainer and DPOTrainer are served"),
    (GRPOTrainer(), "fsdp2", "sequence_parallel=1 with GRPOTrainer: TRL's SFTTrainer and DPOTrainer"),
    (SFTTrainer(packing=True), "fsdp2", "packing or padding_free with sequence_parallel=1"),
    (SFTTrainer(label_smoothing_factor=0.1), "fsdp2", "label_smoothing_factor or compute_loss_func"),
    (SFTTrainer(dataset=Rows()), "fsdp2", "an iterable dataset (dispatch_batches)"),
    (SFTTrainer(dispatch=True), "fsdp2", "an iterable dataset (dispatch_batches)"),
])
def test_each_setting_sequence_parallelism_cannot_serve_is_named(trainer, engine, named) -> None:
    assert refused(SFTTrainer()) == [] and refused(DPOTrainer()) == []
    reasons = refused(trainer, engine=engine)
    assert len(reasons) == 1 and reasons[0].startswith(named), reasons
