"""What `plan --emit` writes for a ranked recipe, and what it refuses by name (no torch, no ranks)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml

from streambp_bench.recipes.launch import write_launch
from streambp_core.config import ConfigError


def entry(**changes) -> dict:
    base = {"recipe": "streambp (recompute head), FSDP2 zero3, offload checkpoints", "method": "streambp",
            "head_mode": "recompute", "shard": "zero3", "sp": 1, "offload": "checkpoints",
            "seq_len_tokens": 262144, "partition_size": 87382, "head_partition_size": 32768}
    return base | changes


def document(*entries, gpus: int = 16, objective: str = "sft") -> dict:
    return {"settings": {"model": "Qwen/Qwen3-8B", "gpus": gpus, "gpus_per_node": 8, "objective": objective,
                         "batch_size": 1, "lora_rank": 0}, "ranking": list(entries)}


def test_fsdp2_recipe_writes_accelerates_config_over_its_nodes_and_the_streamed_trainer(tmp_path) -> None:
    written = write_launch(tmp_path, document(entry()), 1)
    assert written["files"] == ["accelerate_config.yaml", "launch.sh", "train.py"]
    config = yaml.safe_load((tmp_path / "accelerate_config.yaml").read_text())
    assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_version"] == 2
    assert config["fsdp_config"]["fsdp_reshard_after_forward"] is True
    assert (config["num_processes"], config["num_machines"]) == (16, 2)
    script = (tmp_path / "train.py").read_text()
    ast.parse(script)
    assert "SFTTrainer" in script and "MAX_LENGTH = 262144" in script and "METHOD = 'streambp'" in script
    assert ('STREAM = {"partition_size": 87382, "head_partition_size": 32768, "offload": "checkpoints"}'
            in script)
    launch = (tmp_path / "launch.sh").read_text()
    assert "accelerate launch --config_file accelerate_config.yaml train.py" in launch
    assert (tmp_path / "launch.sh").stat().st_mode & 0o111


def test_an_optimizer_tier_recipe_passes_the_tier_and_turns_clipping_off(tmp_path) -> None:
    write_launch(tmp_path, document(entry(offload="checkpoints,optimizer")), 1)
    script = (tmp_path / "train.py").read_text()
    ast.parse(script)
    assert '"offload": "checkpoints,optimizer"' in script and '"max_grad_norm": 0.0' in script
    write_launch(tmp_path, document(entry()), 1)
    assert "max_grad_norm" not in (tmp_path / "train.py").read_text()


def test_deepspeed_recipe_writes_its_zero_json_beside_the_plugin_config(tmp_path) -> None:
    write_launch(tmp_path, document(entry(shard="deepspeed-zero3", offload="none"), objective="dpo"), 1)
    config = yaml.safe_load((tmp_path / "accelerate_config.yaml").read_text())
    assert config["distributed_type"] == "DEEPSPEED"
    assert config["deepspeed_config"]["deepspeed_config_file"] == "ds_config.json"
    zero = json.loads((tmp_path / "ds_config.json").read_text())["zero_optimization"]
    assert zero == {"stage": 3, "stage3_param_persistence_threshold": 0}
    assert "DPOTrainer" in (tmp_path / "train.py").read_text()


def test_a_sequence_parallel_recipe_writes_its_degree_into_the_script_and_notes_it_in_the_config(
        tmp_path) -> None:
    write_launch(tmp_path, document(entry(sp=8), gpus=8), 1)
    text = (tmp_path / "accelerate_config.yaml").read_text()
    assert "8 ranks per sequence (data-parallel degree 1)" in text
    config = yaml.safe_load(text)
    assert "parallelism_config" not in config  # accelerate's sp_size would start DeepSpeed's ALST
    assert config["distributed_type"] == "FSDP" and config["num_processes"] == 8
    script = (tmp_path / "train.py").read_text()
    ast.parse(script)
    assert "SEQUENCE_PARALLEL = 8" in script
    assert "stream_trainer(trainer, METHOD, sequence_parallel=SEQUENCE_PARALLEL, **STREAM)" in script


@pytest.mark.parametrize(("refused", "objective", "words"), [
    (entry(sp=8, shard="deepspeed-zero3"), "sft", ("sp 8", "deepspeed-zero3", "FSDP2", "--pick 2")),
    (entry(sp=8), "grpo", ("sp 8", "objective grpo", "generates completions on each rank", "--pick 2")),
    (entry(offload="checkpoints,optimizer,params"), "sft", ("checkpoints,optimizer,params", "no params tier",
                                                           "--pick 2")),
    (entry(offload="optimizer", shard="deepspeed-zero3"), "sft", ("deepspeed-zero3", "no optimizer tier",
                                                                 "offload_optimizer", "--pick 2")),
])
def test_a_recipe_a_trainer_cannot_run_is_refused_by_name_with_the_one_that_can(tmp_path, refused, objective,
                                                                                words) -> None:
    with pytest.raises(ConfigError) as error:
        write_launch(tmp_path / "out", document(refused, entry(), objective=objective), 1)
    assert all(word in str(error.value) for word in words), error.value
    assert not (tmp_path / "out").exists()


def test_a_pick_beyond_the_ranking_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--pick 3: only 1 recipes fit"):
        write_launch(tmp_path, document(entry()), 3)
