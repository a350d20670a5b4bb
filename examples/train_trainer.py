"""Causal-LM training with transformers' `Trainer`, streamed: the loss goes through StreamBP's layers and
streamed LM head, so the full T x vocab logits never exist.

Data: a JSON-lines file with a "text" field per line.
"""

from __future__ import annotations

import sys

import example_setup as setup

EXAMPLE = ("python examples/train_trainer.py --model ./Qwen3-8B --data train.jsonl --output-dir out "
           "--max-length 65536 --lora-rank 32")


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, build the Trainer, stream it and train."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    args = setup.parser(__doc__.splitlines()[0], EXAMPLE).parse_args(argv)
    texts = setup.rows(args.data, "text")
    model, tokenizer = setup.load(args)
    data = texts.map(lambda row: tokenizer(row["text"], truncation=True, max_length=args.max_length),
                     remove_columns=texts.column_names)
    trainer = Trainer(model=model, args=TrainingArguments(**setup.trainer_options(args)), train_dataset=data,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    setup.train(trainer, args)


if __name__ == "__main__":
    main(sys.argv[1:])
