"""The files `plan --emit` writes run the recipe: the emitted accelerate config (FSDP2 zero2) starts 2 gloo
ranks on CPU as `accelerate launch` would configure them (`trainer_sharded.engine_environment`), each
imports the emitted train.py, builds its trainer on a tiny float64 model and trains one SGD step through
the script's own `train` (its `stream_trainer` call); the update equals plain's on the same engine to
1e-10 and single-process plain's within float32's bound (TRL's fused head sums in float32).

A recipe with sp 2 emits `SEQUENCE_PARALLEL = 2`: its 2 ranks share one sequence group, so both train on
the same rows (2 padded rows, accumulated over 2 micro-batches), each on its half of every sequence; the
update equals plain's through the same sequence group to 1e-10 and single-process plain's on those rows
within float32's bound.

A recipe with the optimizer tier makes the trainer step AdamW in host memory (`max_grad_norm` 0, as the
script sets it): two AdamW steps (weight decay 0.1 on all but biases and norms) equal the trainer's own
AdamW on the device on the same engine to 1e-10, and single-process plain's within AdamW's float32
bound."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", minversion="1.15")
pytest.importorskip("accelerate")

from streambp_bench.recipes.launch import write_launch  # noqa: E402
from streambp_core.models import build_model  # noqa: E402
from streambp_core.models.load import tiny_config  # noqa: E402
from streambp_core.parallel.launch import run_ranks  # noqa: E402
from streambp_core.verify.trainer_parity import full_tensors  # noqa: E402
from streambp_core.verify.trainer_setup import ParitySetup, parity_dataset, word_tokenizer  # noqa: E402

RECIPE = {"recipe": "streambp (recompute head), FSDP2 zero2, offload none", "method": "streambp",
          "head_mode": "recompute", "engine": "FSDP2 zero2", "shard": "zero2", "sp": 1, "offload": "none",
          "seq_len_tokens": 16, "status": "fits", "partition_size": 5, "head_partition_size": 7}
DOCUMENT = {"settings": {"model": "tiny/qwen3", "gpus": 2, "gpus_per_node": 8, "objective": "sft",
                         "batch_size": 1, "lora_rank": 0}, "ranking": [RECIPE]}
HOST_RECIPE = RECIPE | {"recipe": "streambp (recompute head), FSDP2 zero3, offload checkpoints,optimizer",
                        "engine": "FSDP2 zero3", "shard": "zero3", "offload": "checkpoints,optimizer"}
ADAMW = {"per_device_train_batch_size": 1, "optim": "adamw_torch", "weight_decay": 0.1, "max_steps": 2}
SP_RECIPE = RECIPE | {"recipe": "streambp (recompute head), FSDP2 zero3, sp 2, offload none", "sp": 2,
                      "engine": "FSDP2 zero3", "shard": "zero3"}
STEP = {"max_steps": 1, "learning_rate": 0.1, "optim": "sgd", "bf16": False, "seed": 0,
        "lr_scheduler_type": "constant", "save_strategy": "no", "logging_strategy": "no",
        "disable_tqdm": True}


def emitted_module(folder: Path):
    spec = importlib.util.spec_from_file_location("emitted_train", folder / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_step(folder: Path, streamed: bool | str, **settings) -> tuple[dict, str]:
    """One optimizer step of the emitted script's trainer on a tiny float64 model: ({name: update}, the
    class of the optimizer that stepped).
    `streamed`: True, the script's `train`; False, `trainer.train()`; "METHOD-sp" (e.g. "plain-sp"),
    that method through the script's sequence group."""
    config = tiny_config("qwen3")
    model = build_model(config, dtype=torch.float64, seed=0)
    rows = parity_dataset(ParitySetup(trainer="sft", model=config, rows=4), config.vocab_size)
    module = emitted_module(folder)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = module.trainer_for(model, word_tokenizer(config.vocab_size), rows, output_dir,
                                     **(STEP | settings))
        before = full_tensors({n: p for n, p in trainer.model.named_parameters() if p.requires_grad})
        if isinstance(streamed, str):
            from streambp_core.integrations import stream_trainer

            method = streamed.removesuffix("-sp")
            with stream_trainer(trainer, method, sequence_parallel=module.SEQUENCE_PARALLEL):
                trainer.train()
        elif streamed:
            module.train(trainer)
        else:
            trainer.train()
        after = full_tensors({n: p for n, p in trainer.model.named_parameters() if n in before})
        stepped = type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__
    return {name: after[name] - before[name] for name in before}, stepped


def emitted_rank(rank: int, world: int, folder: Path, streamed: bool | str | tuple, step: dict | None = None):
    """A rank as `accelerate launch --config_file accelerate_config.yaml train.py` starts it; `step`: the
    trainer settings that differ from STEP (default one row per device). A tuple `streamed` trains one
    step of each, one after another on the same ranks, and returns rank 0's results in its order."""
    import yaml

    from streambp_core.verify.trainer_sharded import _declare_engine, engine_environment

    config = yaml.safe_load((folder / "accelerate_config.yaml").read_text())
    assert config["distributed_type"] == "FSDP" and config["num_processes"] == world
    stage = "zero3" if config["fsdp_config"]["fsdp_reshard_after_forward"] else "zero2"
    os.environ.update(engine_environment("fsdp2", stage))
    _declare_engine("fsdp2")
    settings = (step or {"per_device_train_batch_size": 1}) | {
        "use_cpu": False, "accelerator_config": {"use_configured_state": True}}
    if isinstance(streamed, tuple):
        updates = [one_step(folder, each, **settings) for each in streamed]
    else:
        updates = one_step(folder, streamed, **settings)
    return updates if rank == 0 else None


def relative(update: torch.Tensor, reference: torch.Tensor) -> float:
    return float((update - reference).norm() / reference.norm())


@pytest.mark.slow
def test_the_emitted_launch_files_train_one_step_as_plain_training_does(tmp_path: Path) -> None:
    emitted = write_launch(tmp_path, DOCUMENT, 1)
    assert emitted["files"] == ["accelerate_config.yaml", "launch.sh", "train.py"]
    plain_on_engine = run_ranks(emitted_rank, 2, args=(tmp_path, False))[0][0]
    streamed = run_ranks(emitted_rank, 2, args=(tmp_path, True))[0][0]
    single = one_step(tmp_path, False, per_device_train_batch_size=2, use_cpu=True)[0]
    assert set(streamed) == set(single)
    for name, reference in single.items():
        assert reference.norm() > 0, f"{name} never moved: the comparison means nothing"
        assert relative(streamed[name], plain_on_engine[name]) <= 1e-10, name
        assert relative(streamed[name], reference) <= 1e-4, name


def test_an_emitted_sequence_parallel_recipe_trains_one_step_as_plain_training_does(tmp_path: Path) -> None:
    emitted = write_launch(tmp_path, DOCUMENT | {"ranking": [SP_RECIPE]}, 1)
    assert emitted["recipe"] == SP_RECIPE["recipe"]
    assert "SEQUENCE_PARALLEL = 2" in (tmp_path / "train.py").read_text()
    rows = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}  # padded rows, accumulated
    (streamed, _), (plain_sp, _) = run_ranks(emitted_rank, 2, args=(tmp_path, (True, "plain-sp"), rows))[0]
    single = one_step(tmp_path, False, **rows, use_cpu=True)[0]
    assert set(streamed) == set(single)
    for name, reference in single.items():
        assert reference.norm() > 0, f"{name} never moved: the comparison means nothing"
        assert relative(streamed[name], plain_sp[name]) <= 1e-10, name
        assert relative(streamed[name], reference) <= 1e-6, name  # measured 3.8e-8 (the fused head's float32)


@pytest.mark.slow
def test_an_emitted_optimizer_tier_recipe_steps_adamw_on_the_host_as_the_trainer_does(tmp_path: Path) -> None:
    write_launch(tmp_path, DOCUMENT | {"ranking": [HOST_RECIPE]}, 1)
    script = (tmp_path / "train.py").read_text()
    assert '"offload": "checkpoints,optimizer"' in script and '"max_grad_norm": 0.0' in script
    streamed, host = run_ranks(emitted_rank, 2, args=(tmp_path, True, ADAMW))[0]
    plain_on_engine, device = run_ranks(emitted_rank, 2, args=(tmp_path, False, ADAMW))[0]
    assert (host, device) == ("HostAdamW", "AdamW")
    single = one_step(tmp_path, False, **(ADAMW | {"per_device_train_batch_size": 2}), use_cpu=True)[0]
    assert set(streamed) == set(single)
    for name, reference in single.items():
        assert reference.norm() > 0, f"{name} never moved: the comparison means nothing"
        assert relative(streamed[name], plain_on_engine[name]) <= 1e-10, name
        assert relative(streamed[name], reference) <= 2e-6, name  # measured 5.3e-7: AdamW over float32 sums
