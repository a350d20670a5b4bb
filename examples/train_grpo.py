"""Reinforcement learning with TRL's `GRPOTrainer`, streamed: completions are generated as usual; the
policy's (and, with --beta, the reference's) per-token log-probs come through StreamBP's layers under
TRL's fused LM head.

Data: a JSON-lines file with "prompt" and "answer" fields per line; a completion earns reward 1 when it
contains the answer, else 0.
"""

from __future__ import annotations

import sys

import example_setup as setup

EXAMPLE = ("python examples/train_grpo.py --model ./Qwen3-4B --data prompts.jsonl --output-dir out "
           "--max-completion-length 16384 --num-generations 8 --lora-rank 32")


def contains_answer(completions: list[str], answer: list[str], **_) -> list[float]:
    """1.0 for each completion that contains its row's answer, else 0.0."""
    return [float(str(a) in c) for c, a in zip(completions, answer, strict=True)]


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, build the GRPOTrainer, stream it and train."""
    from trl import GRPOConfig, GRPOTrainer

    cli = setup.parser(__doc__.splitlines()[0], EXAMPLE)
    cli.add_argument("--num-generations", type=int, default=8, help="completions per prompt")
    cli.add_argument("--max-completion-length", type=int, default=4096, help="tokens per completion")
    cli.add_argument("--beta", type=float, default=0.0, help="KL coefficient; > 0 scores a reference too")
    args = cli.parse_args(argv)
    data = setup.rows(args.data, "prompt", "answer")
    model, tokenizer = setup.load(args)
    options = {**setup.trainer_options(args), "per_device_train_batch_size": args.num_generations}
    config = GRPOConfig(**options, num_generations=args.num_generations, beta=args.beta,
                        max_completion_length=args.max_completion_length)
    trainer = GRPOTrainer(model=model, reward_funcs=contains_answer, args=config, train_dataset=data,
                          processing_class=tokenizer)
    setup.train(trainer, args)


if __name__ == "__main__":
    main(sys.argv[1:])
