"""`plan --emit DIR`: the files that run a ranked recipe: accelerate's config (FSDP2, or the DeepSpeed
plugin with its ZeRO JSON), `train.py` (TRL's trainer for the objective, `stream_trainer` with the
recipe's method and partitions) and `launch.sh` (`accelerate launch ...`).

A recipe with sp > 1 runs Ulysses sequence parallelism through `stream_trainer(...,
sequence_parallel=sp)` (`streambp_core.integrations.sequence_trainer`): sp consecutive ranks share each
sequence and the same rows. The degree is written into train.py (`SEQUENCE_PARALLEL`), and only noted in
accelerate's config: accelerate's own `parallelism_config` sp_size would start DeepSpeed's ALST, and its
cp_size torch's ring attention.

A recipe with the optimizer tier passes it to `stream_trainer` (`offload` in `STREAM`), which makes the
trainer build its AdamW in host memory (`streambp_core.integrations.optimizer_tier`); train.py sets
`max_grad_norm` 0 then (the trainer's clipping would read gradients the tier has sent to the host).

What `stream_trainer` cannot run exactly is refused by name before anything is written (`emittable`):
sequence parallelism on any engine but FSDP2 or for the grpo objective (GRPO generates completions on
each rank, which a sequence group would not share), the optimizer tier under DeepSpeed (its own
offload_optimizer holds it) and the params tier (weights in host memory: a trainer's engine holds them on
the device).
"""

from __future__ import annotations

import json
from pathlib import Path

from streambp_core.config import ConfigError

TRAINERS = {"sft": ("SFTConfig", "SFTTrainer", "prompt, completion"),
            "dpo": ("DPOConfig", "DPOTrainer", "prompt, chosen, rejected"),
            "grpo": ("GRPOConfig", "GRPOTrainer", "prompt")}
"""Per objective: TRL's config and trainer classes, and the fields of each data row."""


def emittable(entry: dict, objective: str = "sft") -> str | None:
    """Why a ranked recipe (`report.recipe_dict`) cannot be emitted for `objective`, or None when it can."""
    if entry["sp"] > 1 and entry["shard"] not in ("zero2", "zero3"):
        return (f"sp {entry['sp']} with shard {entry['shard']}: stream_trainer runs Ulysses sequence "
                "parallelism under FSDP2 (zero2, zero3) only")
    if entry["sp"] > 1 and objective == "grpo":
        return (f"sp {entry['sp']} with objective grpo: stream_trainer runs Ulysses sequence parallelism for "
                "TRL's SFT and DPO trainers (GRPO generates completions on each rank, which a sequence group "
                "would not share)")
    tiers = entry["offload"].split(",")
    if "params" in tiers:
        return (f"offload {entry['offload']}: stream_trainer takes no params tier (the trainer's engine "
                "holds the weights on the device)")
    if "optimizer" in tiers and entry["shard"].startswith("deepspeed"):
        return (f"offload {entry['offload']} with shard {entry['shard']}: stream_trainer takes no optimizer "
                "tier under DeepSpeed (its own offload_optimizer section holds it, not checked)")
    return None


def choose(document: dict, pick: int) -> dict:
    """The `pick`-th fastest recipe (1-based), or ConfigError naming why it cannot run under a trainer
    and the fastest one that can."""
    ranking = document["ranking"]
    if pick > len(ranking):
        raise ConfigError(f"--pick {pick}: only {len(ranking)} recipes fit")
    entry = ranking[pick - 1]
    objective = document["settings"]["objective"]
    why = emittable(entry, objective)
    if why is None:
        return entry
    can = next((rank for rank, other in enumerate(ranking, 1) if emittable(other, objective) is None), None)
    hint = f"; the fastest that can is --pick {can}" if can else "; no ranked recipe can"
    raise ConfigError(f"--emit: recipe #{pick} ({entry['recipe']}) cannot run under a trainer: {why}{hint}")


def accelerate_config(entry: dict, gpus: int, gpus_per_node: int) -> str:
    """accelerate's YAML for the recipe's engine and stage, `gpus` processes over their nodes (sp > 1: a
    comment saying train.py's `stream_trainer` runs it, module docstring)."""
    machines = max(1, -(-gpus // gpus_per_node))
    sp = entry["sp"]
    note = (f"# Ulysses sequence parallelism, {sp} ranks per sequence (data-parallel degree {gpus // sp}), "
            "runs in train.py\n# (stream_trainer's sequence_parallel), not through accelerate's "
            "parallelism_config\n" if sp > 1 else "")
    common = (f"machine_rank: 0\nmixed_precision: 'no'\nnum_machines: {machines}\nnum_processes: {gpus}\n"
              "rdzv_backend: static\nsame_network: true\nuse_cpu: false\n")
    shard = entry["shard"]
    if shard in ("zero2", "zero3"):
        return (note + "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n"
                "  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                f"  fsdp_reshard_after_forward: {str(shard == 'zero3').lower()}\n"
                "  fsdp_offload_params: false\n  fsdp_cpu_ram_efficient_loading: false\n"
                "  fsdp_activation_checkpointing: false\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
                + common)
    if shard.startswith("deepspeed"):
        return ("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                "  deepspeed_config_file: ds_config.json\n  zero3_init_flag: false\n" + common)
    return "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\n" + common


def deepspeed_json(shard: str) -> dict:
    """DeepSpeed's config for a ZeRO stage: the trainer's arguments fill the batch, accumulation and
    clipping ("auto"); every parameter partitioned under ZeRO-3 (none kept whole)."""
    zero: dict = {"stage": int(shard[-1])}
    if shard.endswith("3"):
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "zero_allow_untested_optimizer": True, "zero_optimization": zero}


def train_script(entry: dict, settings: dict) -> str:
    """`train.py`: TRL's trainer for the objective at the recipe's length, streamed by `stream_trainer`
    with the recipe's method, partitions, checkpoints tier and sequence-parallel degree; `trainer_for` and
    `train` importable."""
    config_class, trainer_class, fields = TRAINERS[settings["objective"]]
    stream = {key: entry[key] for key in ("partition_size", "head_partition_size") if key in entry}
    if entry["offload"] != "none":
        stream["offload"] = entry["offload"]
    host_optimizer = "optimizer" in entry["offload"].split(",")
    indent = "\n" + " " * 17
    clipping = (f'{indent}"max_grad_norm": 0.0,  # offload optimizer: clipping would read no gradients'
                if host_optimizer else "")
    lora = settings.get("lora_rank", 0)
    peft = (f"\n    from peft import LoraConfig\n\n    kwargs[\"peft_config\"] = LoraConfig(r={lora}, "
            f"lora_alpha={4 * lora}, target_modules=\"all-linear\")" if lora else "")
    reward = ("\n    kwargs[\"reward_funcs\"] = kwargs.get(\"reward_funcs\", length_reward)"
              if settings["objective"] == "grpo" else "")
    length_field = "max_completion_length" if settings["objective"] == "grpo" else "max_length"
    return f'''"""Train {settings["model"]} with the plan's recipe: {entry["recipe"]}.

Written by `streambp-bench plan --emit`; run it with launch.sh. Data: a JSON-lines file whose rows have
the fields {fields}.
"""

import argparse
import json

import torch
from trl import {config_class}, {trainer_class}

from streambp_core.integrations import stream_trainer

METHOD = {entry["method"]!r}
STREAM = {json.dumps(stream)}
SEQUENCE_PARALLEL = {entry["sp"]}
"""Ranks that share each sequence (Ulysses) and its rows; 1: none."""
MAX_LENGTH = {entry["seq_len_tokens"]}


def length_reward(completions, **kwargs):
    """A placeholder reward: replace with the task's."""
    return [float(len(completion)) for completion in completions]


def trainer_for(model, tokenizer, dataset, output_dir, **settings):
    """TRL's trainer with the recipe's length (`settings` override the arguments)."""
    arguments = {{"output_dir": output_dir, "per_device_train_batch_size": {settings["batch_size"]},
                 "{length_field}": MAX_LENGTH, "bf16": True, "gradient_checkpointing": False,{clipping}
                 "report_to": [], **settings}}
    kwargs = {{}}{peft}{reward}
    return {trainer_class}(model=model, args={config_class}(**arguments), train_dataset=dataset,
                 processing_class=tokenizer, **kwargs)


def train(trainer):
    """trainer.train() with the recipe's method, partitions and sequence parallelism (`stream_trainer`)."""
    with stream_trainer(trainer, METHOD, sequence_parallel=SEQUENCE_PARALLEL, **STREAM):
        trainer.train()


def main():
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--model", default={settings["model"]!r})
    cli.add_argument("--data", required=True, help="JSON-lines rows")
    cli.add_argument("--output-dir", default="out")
    args = cli.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = load_dataset("json", data_files=args.data, split="train")
    train(trainer_for(model, tokenizer, dataset, args.output_dir))


if __name__ == "__main__":
    main()
'''


def write_launch(folder: Path, document: dict, pick: int) -> dict:
    """Write the chosen recipe's files into `folder` (created); {recipe, files}."""
    settings = document["settings"]
    entry = choose(document, pick)
    folder.mkdir(parents=True, exist_ok=True)
    files = {"accelerate_config.yaml": accelerate_config(entry, settings["gpus"], settings["gpus_per_node"]),
             "train.py": train_script(entry, settings),
             "launch.sh": ("#!/bin/sh\n# the plan's recipe: " + entry["recipe"] + "\n"
                           "# usage: ./launch.sh --data rows.jsonl [--model PATH] [--output-dir DIR]\n"
                           "# (on every node, with accelerate's --machine_rank and --main_process_ip)\n"
                           "cd \"$(dirname \"$0\")\"\n"
                           "exec accelerate launch --config_file accelerate_config.yaml train.py \"$@\"\n")}
    if entry["shard"].startswith("deepspeed"):
        files["ds_config.json"] = json.dumps(deepspeed_json(entry["shard"]), indent=2) + "\n"
    for name, text in files.items():
        (folder / name).write_text(text)
    (folder / "launch.sh").chmod(0o755)
    return {"recipe": entry["recipe"], "pick": pick, "folder": str(folder), "files": sorted(files)}
