"""What the training examples share: their command line, the model, tokenizer and data, trainer settings.

Not a script: `train_trainer.py`, `train_sft.py`, `train_dpo.py` and `train_grpo.py` import it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch

from streambp_core.config import METHODS, ConfigError
from streambp_core.integrations import stream_trainer
from streambp_core.models import build_model, has_weights, load_model
from streambp_core.models.lora import apply_lora

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def fail(message: str) -> NoReturn:
    """Bad input: one `error:` line on stderr, exit 2 (as the streambp-bench CLI)."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


POSITIVE_OPTIONS = ("partition_size", "head_partition_size", "batch_size", "grad_accum", "max_steps",
                    "save_steps")


class ExampleParser(argparse.ArgumentParser):
    """argparse with the CLI's bad-input contract: every error is one `error:` line and exit 2, and the
    numbers, the data file and the model are checked before anything is loaded."""

    def error(self, message: str) -> NoReturn:
        fail(message)

    def parse_args(self, args=None, namespace=None):  # noqa: D102 - argparse's own
        parsed = super().parse_args(args, namespace)
        for name in POSITIVE_OPTIONS:
            if getattr(parsed, name) < 1:
                fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(parsed, name)}")
        if parsed.max_length < 2:
            fail(f"--max-length must be at least 2 tokens, got {parsed.max_length}")
        if parsed.lora_rank < 0:
            fail(f"--lora-rank must be 0 or more, got {parsed.lora_rank}")
        if not parsed.data.is_file():
            fail(f"--data {parsed.data}: no such file")
        try:
            from streambp_core.models import load_config

            config = load_config(parsed.model)
        except ConfigError as error:
            fail(f"--model: {error}")
        parsed.tokenizer, parsed.tokenizer_note = model_tokenizer(parsed.model, config)
        check_ram(parsed, config)
        return parsed


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
"""Files of which a model directory with a tokenizer has one at least."""


def model_tokenizer(model: str, config):
    """The tokenizer of the model directory, loaded from it alone (never the network), and None; for a
    preset or a directory without one, the package's byte tokenizer and the `note:` line `load` prints
    (after the data file is checked, so that bad input stays one `error:` line). Bad input: exit 2."""
    from streambp_core.models.byte_tokenizer import byte_tokenizer

    path = Path(model)
    if path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as error:
            fail(f"--model {model}: its tokenizer cannot be loaded: {error}")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer, None
    where = "a preset" if not path.is_dir() else f"{model} has no tokenizer"
    try:
        tokenizer = byte_tokenizer(config.vocab_size)
    except ConfigError as error:
        fail(f"--model {model}: {where}, and {error}")
    return tokenizer, (f"note: {where}: training with the package's byte tokenizer (256 bytes, pad, bos, "
                       "eos), which suits random weights only")


def check_ram(args: argparse.Namespace, config) -> None:
    """Exit 2, before building anything, when a CPU run's weights, gradients and AdamW moments cannot fit
    in the RAM this machine has available (a model built for minutes, then killed)."""
    if torch.cuda.is_available():
        return
    from streambp_core.measure.host_ram import available_ram_bytes
    from streambp_core.models import build_model
    from streambp_core.models.load import count_parameters

    parameters = count_parameters(build_model(config, device="meta", checked=True))
    size = DTYPES[args.dtype].itemsize
    need = parameters * size * (1 if args.lora_rank else 4)  # weights; full: + gradients + 2 moments
    have = available_ram_bytes()
    if need > have:
        gib = 2**30
        what = "weights alone" if args.lora_rank else "weights, gradients and AdamW moments"
        fail(f"--model {args.model}: {parameters / 1e9:.2f}B parameters need {need / gib:.1f} GiB in "
             f"{args.dtype} for the {what}; this machine has {have / gib:.1f} GiB of RAM available "
             "(run it on a GPU, or try a tiny/<family> preset)")


def parser(description: str, example: str) -> argparse.ArgumentParser:
    """The options every example takes; `example` is a command line shown under --help."""
    cli = ExampleParser(description=description, epilog=f"Example:\n  {example}",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--model", required=True, help="local model directory (config, safetensors, tokenizer), "
                     "or a preset: random weights")
    cli.add_argument("--data", required=True, type=Path, help="JSON-lines file, one example per line")
    cli.add_argument("--output-dir", required=True, type=Path, help="where checkpoints are written")
    cli.add_argument("--method", default="streambp", choices=METHODS, help="default: streambp")
    cli.add_argument("--partition-size", type=int, default=2000, help="tokens per layer chunk (streambp)")
    cli.add_argument("--head-partition-size", type=int, default=100,
                     help="tokens per LM-head chunk (transformers' Trainer; TRL uses its own fused head)")
    cli.add_argument("--max-length", type=int, default=32768, help="longest training sequence, in tokens")
    cli.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on every linear layer; 0: full")
    cli.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype (default bfloat16)")
    cli.add_argument("--batch-size", type=int, default=1)
    cli.add_argument("--grad-accum", type=int, default=8, help="gradient accumulation steps")
    cli.add_argument("--learning-rate", type=float, default=1e-5)
    cli.add_argument("--max-steps", type=int, default=100)
    cli.add_argument("--save-steps", type=int, default=50)
    return cli


def load(args: argparse.Namespace, *, trainable: bool = True):
    """The model (LoRA-wrapped when asked and `trainable`) and its tokenizer (`model_tokenizer`, whose
    note, if any, is printed here)."""
    if args.tokenizer_note:
        print(args.tokenizer_note, file=sys.stderr)
        args.tokenizer_note = None  # once, though DPO loads a reference model too
    # Under `accelerate launch` or torchrun each rank loads onto its own GPU (LOCAL_RANK).
    device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[args.dtype]
    if has_weights(args.model):
        model = load_model(args.model, dtype=dtype, device=device)
    else:  # a config-only directory: random weights, for a smoke test of the pipeline
        model = build_model(args.model, dtype=dtype, device=device)
    if trainable and args.lora_rank:
        model = apply_lora(model, args.lora_rank)
    if not trainable:
        model.requires_grad_(False)
    return model, args.tokenizer


def rows(path: Path, *fields: str, choices: tuple[tuple[str, ...], ...] = ()):
    """The JSON-lines file as a `datasets.Dataset`, checked for `fields` (or, given `choices`, for one of
    those sets of fields); bad input is one `error:` line, exit 2. Nothing is cached on disk."""
    from datasets import Dataset

    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            fail(f"{path} line {number}: not valid JSON ({error.msg})")
        if not isinstance(records[-1], dict):
            fail(f"{path} line {number}: expected a JSON object per line")
    for wanted in choices or (fields,):
        if records and all(all(f in r for f in wanted) for r in records):
            return Dataset.from_list(records)
    needs = " or ".join(", ".join(wanted) for wanted in choices or (fields,))
    fail(f"{path} needs JSON lines with the fields {needs}")


def trainer_options(args: argparse.Namespace) -> dict:
    """TrainingArguments fields the examples share. The weights are already in `--dtype`, so no autocast."""
    return dict(output_dir=str(args.output_dir), per_device_train_batch_size=args.batch_size,
                gradient_accumulation_steps=args.grad_accum, learning_rate=args.learning_rate,
                max_steps=args.max_steps, save_steps=args.save_steps, logging_steps=1, report_to=[],
                bf16=False, fp16=False, use_cpu=not torch.cuda.is_available(), gradient_checkpointing=False)


def train(trainer, args: argparse.Namespace) -> None:
    """Stream the trainer's model with the chosen method, train, and save the final weights."""
    with stream_trainer(trainer, args.method, partition_size=args.partition_size,
                        head_partition_size=args.head_partition_size):
        trainer.train()
    trainer.save_model(str(args.output_dir / "final"))
