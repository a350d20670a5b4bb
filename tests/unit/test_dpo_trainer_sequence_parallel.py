"""TRL's DPOTrainer under `stream_trainer(..., sequence_parallel=2)` on 2 FSDP2 gloo ranks: the policy's and
the frozen reference model's fused-head calls are both sharded over the group, so each sequence's
log-prob sum (and DPO's sigmoid of their differences) is the whole sequence's; one SGD step's update equals
plain's through the same group to 1e-10 and single-process plain's on the same rows within float32's bound
(TRL's fused head). SFT is checked through the files `plan --emit` writes
(test_plan_emitted_files_train_exactly)."""

from __future__ import annotations

import os
import tempfile

import pytest

pytest.importorskip("trl", minversion="1.15")
pytest.importorskip("accelerate")

from streambp_core.models.load import tiny_config  # noqa: E402
from streambp_core.parallel.launch import run_ranks  # noqa: E402
from streambp_core.verify.trainer_parity import full_tensors  # noqa: E402
from streambp_core.verify.trainer_setup import ParitySetup, trainer_factory  # noqa: E402

STEP = {"max_steps": 1, "learning_rate": 0.1, "optim": "sgd", "per_device_train_batch_size": 2}


def one_step(method: str | None, **settings) -> dict:
    """One SGD step of a DPO trainer (reference model separate) on 2 pairs: {name: update}; `method`
    None trains without `stream_trainer`, else with it over 2 ranks per sequence."""
    setup = ParitySetup(trainer="dpo", model=tiny_config("qwen3"), rows=4, settings=STEP | settings)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = trainer_factory(setup, output_dir)()
        before = full_tensors({n: p for n, p in trainer.model.named_parameters() if p.requires_grad})
        if method is None:
            trainer.train()
        else:
            from streambp_core.integrations import stream_trainer

            with stream_trainer(trainer, method, sequence_parallel=2, partition_size=5):
                trainer.train()
        after = full_tensors({n: p for n, p in trainer.model.named_parameters() if n in before})
    return {name: after[name] - before[name] for name in before}


def sequence_rank(rank: int, world: int, method: str):
    """A rank as `accelerate launch` with an FSDP2 (zero3) config starts it."""
    from streambp_core.verify.trainer_sharded import _declare_engine, engine_environment

    os.environ.update(engine_environment("fsdp2", "zero3"))
    _declare_engine("fsdp2")
    updates = one_step(method, use_cpu=False, accelerator_config={"use_configured_state": True})
    return updates if rank == 0 else None


def relative(update, reference) -> float:
    return float((update - reference).norm() / reference.norm())


@pytest.mark.slow
def test_dpo_over_a_sequence_group_steps_as_plain_training_does() -> None:
    streamed = run_ranks(sequence_rank, 2, args=("streambp",))[0]
    plain = run_ranks(sequence_rank, 2, args=("plain",))[0]
    single = one_step(None, use_cpu=True)
    assert set(streamed) == set(single)
    for name, reference in single.items():
        assert reference.norm() > 0, f"{name} never moved: the comparison means nothing"
        assert relative(streamed[name], plain[name]) <= 1e-10, name
        assert relative(streamed[name], reference) <= 1e-6, name  # measured 4.4e-8 (the head's float32)
