"""Preference training with TRL's `DPOTrainer`, streamed: the policy's and the reference's sequence
log-probs come through StreamBP's layers under TRL's fused LM head.

Data: a JSON-lines file with "prompt", "chosen" and "rejected" fields per line. With --lora-rank the
reference is the model with its adapter disabled; otherwise a second, frozen copy is loaded.
"""

from __future__ import annotations

import sys

import example_setup as setup

EXAMPLE = ("python examples/train_dpo.py --model ./Qwen3-4B --data pairs.jsonl --output-dir out "
           "--max-length 32768 --lora-rank 32 --beta 0.1")


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, build the DPOTrainer, stream it and train."""
    from trl import DPOConfig, DPOTrainer

    cli = setup.parser(__doc__.splitlines()[0], EXAMPLE)
    cli.add_argument("--beta", type=float, default=0.1, help="DPO temperature (default 0.1)")
    args = cli.parse_args(argv)
    data = setup.rows(args.data, "prompt", "chosen", "rejected")
    model, tokenizer = setup.load(args)
    ref_model = None if args.lora_rank else setup.load(args, trainable=False)[0]
    config = DPOConfig(**setup.trainer_options(args), max_length=args.max_length, beta=args.beta)
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=config, train_dataset=data,
                         processing_class=tokenizer)
    setup.train(trainer, args)


if __name__ == "__main__":
    main(sys.argv[1:])
