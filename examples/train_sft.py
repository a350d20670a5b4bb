"""Supervised fine-tuning with TRL's `SFTTrainer`, streamed: StreamBP's layers under TRL's fused LM head.

Data: a JSON-lines file with a "text" field, or "prompt" and "completion" fields (the loss then covers
the completion only), per line. `--packing` packs several examples into each row (TRL's best-fit
decreasing packing: position_ids restart per document, and attention stays within each).
"""

from __future__ import annotations

import sys

import example_setup as setup

EXAMPLE = ("python examples/train_sft.py --model ./Qwen3-8B --data sft.jsonl --output-dir out "
           "--max-length 65536 --partition-size 2000")


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, build the SFTTrainer, stream it and train."""
    from trl import SFTConfig, SFTTrainer

    cli = setup.parser(__doc__.splitlines()[0], EXAMPLE)
    cli.add_argument("--packing", action="store_true",
                     help="pack examples into rows of --max-length tokens (documents kept apart)")
    args = cli.parse_args(argv)
    data = setup.rows(args.data, choices=(("text",), ("prompt", "completion")))
    model, tokenizer = setup.load(args)
    config = SFTConfig(**setup.trainer_options(args), max_length=args.max_length, packing=args.packing)
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    setup.train(trainer, args)


if __name__ == "__main__":
    main(sys.argv[1:])
