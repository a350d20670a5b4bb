"""The optimizer offload tier under a trainer: `stream_trainer(trainer, method, offload="optimizer")` makes
the trainer build `HostAdamW` from its own param groups (weight decay on all but biases and norms), and
its AdamW steps equal the trainer's own AdamW on the device; what the tier cannot serve is refused by
name. One process here; 2 FSDP2 ranks in test_plan_emitted_files_train_exactly (slow)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl", minversion="1.15")

from streambp_core.config import ConfigError  # noqa: E402
from streambp_core.engine.host.optimizer import HostAdamW  # noqa: E402
from streambp_core.integrations import stream_trainer  # noqa: E402
from streambp_core.models.load import tiny_config  # noqa: E402
from streambp_core.verify.trainer_setup import ParitySetup, trainer_factory  # noqa: E402

ADAMW = {"optim": "adamw_torch", "weight_decay": 0.1, "max_grad_norm": 0.0, "max_steps": 2}


def trained(tmp_path, method: str | None, **settings) -> tuple[dict, torch.optim.Optimizer]:
    """The update of two AdamW steps ({name: update}) and the optimizer that made them."""
    setup = ParitySetup(trainer="sft", model=tiny_config("qwen3"), rows=4, settings=ADAMW | settings)
    trainer = trainer_factory(setup, tmp_path)()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    if method is None:
        trainer.train()
    else:
        with stream_trainer(trainer, method, partition_size=5, offload="optimizer"):
            trainer.train()
    update = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}
    return update, getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def test_the_trainers_adamw_steps_in_host_memory_as_on_the_device(tmp_path) -> None:
    reference, device = trained(tmp_path / "plain", None)
    update, host = trained(tmp_path / "streambp", "streambp")
    assert type(device) is torch.optim.AdamW and isinstance(host, HostAdamW)
    assert sorted(group["weight_decay"] for group in host.param_groups) == [0.0, 0.1]
    assert not host._hooks  # closing the stream took the gradient hooks off
    for name, expected in reference.items():
        assert expected.norm() > 0, f"{name} never moved: the comparison means nothing"
        assert float((update[name] - expected).norm() / expected.norm()) <= 1e-10, name


@pytest.mark.parametrize(("settings", "named"), [
    ({"max_grad_norm": 1.0}, "max_grad_norm 1.0 with offload optimizer cannot train"),
    ({"optim": "sgd"}, "optim sgd with offload optimizer cannot train"),
])
def test_what_the_tier_cannot_serve_is_refused_by_name(tmp_path, settings, named) -> None:
    setup = ParitySetup(trainer="sft", model=tiny_config("qwen3"), rows=2, settings=ADAMW | settings)
    trainer = trainer_factory(setup, tmp_path)()
    with pytest.raises(ConfigError, match=named):
        stream_trainer(trainer, "streambp", offload="optimizer")
    assert trainer.optimizer_cls_and_kwargs is None
