"""Training under DeepSpeed ZeRO-1/2/3 with StreamBP: the user's own DeepSpeed loop, unchanged in shape.

    deepspeed --num_gpus 8 examples/train_deepspeed.py --model ./Qwen3-8B --stage 2 --seq-len 32768

`streambp_core.prepare(engine, "streambp", ...)` prepares the engine's module, computes each loss through
the engine's forward and reduces each parameter's gradient exactly once per backward, as its layer's
backward ends; under ZeRO-3 each layer is gathered once for its forward and once for its backward (see
`streambp_core.parallel.deepspeed`). Random tokens stand
in for data; swap in your own batches. On CPU, `--device cpu` runs on gloo ranks.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, build the engine, prepare the model and train `--steps` steps."""
    import deepspeed
    import torch

    import streambp_core
    from streambp_core.models import build_model, load_config
    from streambp_core.parallel.deepspeed import check_engine, zero_config
    from streambp_core.step.parts.batch import random_batch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny/qwen3", help="preset name or local config directory")
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--partition-size", type=int, default=64, help="tokens per chunk")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(load_config(args.model), dtype=dtype, device=args.device, seed=0)
    config = zero_config(args.stage, micro_batch=1, accumulation=1)
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    check_engine(engine)
    run = streambp_core.prepare(engine, "streambp", partition_size=args.partition_size,
                                head_partition_size=args.partition_size)
    for step in range(args.steps):
        batch = random_batch(vocab_size=model.config.vocab_size, seq_len=args.seq_len, batch_size=1,
                             padding="none", seed=step * 1000 + torch.distributed.get_rank(),
                             device=args.device)
        loss = engine.backward(run.loss(batch.input_ids, labels=batch.labels))
        engine.step()
        print(f"step {step}: loss {float(loss):.4f}")
    run.close()


if __name__ == "__main__":
    main(sys.argv[1:])
