"""The reference StreamBP's DeepSpeed ZeRO-2 approach beside this project's: each one's update error.

    python benchmarks/deepspeed_reference.py --out results/benchmarks/deepspeed_reference.csv

The reference gets past ZeRO-2's "multiple gradient reduction" assert by swapping the optimizer's
`process_gradients` for a no-op while a layer's chunks back-propagate, restoring it for the layer's last
chunk only; the LM head and the final norm are streamed with the no-op installed. It is reproduced here
from that description, on a tiny untied model (`--model`): each decoder layer is recomputed from its saved
input and its output gradient is back-propagated chunk by chunk along the sequence (`--chunk` tokens),
then the embedding. This project's run is the user's DeepSpeed loop with `prepare(engine.module,
"streambp")` (see `streambp_core.parallel.deepspeed`). Both run ZeRO-2 on 2 gloo CPU ranks in float64
(ZeRO keeps float32 master weights), one optimizer step of torch's Adam, against single-process plain
with the same float32 masters. One row per (approach, parameter group): the max relative update error
over the group's parameters (measured-cpu).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

from csv_out import emit_rows

from streambp_bench.tokens import UNITS, token_count

COLUMNS = ("approach", "params", "max_rel_err", "worst_param", "model", "seq_len_tokens", "chunk_tokens",
           "nproc", "dtype", "source")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    for flag, default, what in (("--seq-len", 64, "length"), ("--chunk", 16, "chunk")):
        parser.add_argument(flag, type=token_count(what), default=default, help=f"{what} in tokens ({UNITS})")
    parser.add_argument("--model", default="tiny/llama", help="preset (untied embedding and head)")
    parser.add_argument("--out", default=None, help="CSV path (default: print)")
    return parser.parse_args(argv)


def _group(name: str) -> str:
    if "lm_head" in name:
        return "lm_head"
    if "layers." in name:
        return "decoder layers"
    return "final norm" if "norm" in name else "embedding"


def reference_update(model, spec, batch):
    """The reference's ZeRO-2 step on this rank (module docstring): the applied update by name."""
    import deepspeed
    import torch

    from streambp_core.models.adapters import decoder_parts
    from streambp_core.parallel.deepspeed import zero_config

    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = zero_config(2, micro_batch=spec.step.batch_size)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    optimizer, parts = engine.optimizer, decoder_parts(engine.module)
    process = optimizer.process_gradients

    def streamed_backward():  # what the reference's streamed loss does inside engine.backward
        ids = batch.input_ids
        with torch.no_grad():
            hidden = [parts.embed(ids)]
            rope = parts.rope_tables(hidden[0], torch.arange(ids.shape[1])[None])[None]
            for layer in parts.layers:
                hidden.append(_layer(layer, hidden[-1], rope))
        optimizer.process_gradients = lambda *args: None  # the no-op, installed for the head
        with torch.enable_grad():
            top = hidden[-1].requires_grad_()
            logits = parts.lm_head(parts.norm(top))
            labels = batch.labels[:, 1:].flatten()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels)
            loss.backward()
            grad = top.grad
            for layer, saved in zip(reversed(parts.layers), reversed(hidden[:-1]), strict=True):
                grad = _chunked_layer_backward(optimizer, process, layer, saved, rope, grad,
                                               spec.step.stream.partition_size)
            optimizer.process_gradients = process
            parts.embed(ids).backward(grad)
        return loss.detach()

    engine.backward(_Streamed.apply(torch.zeros((), requires_grad=True), streamed_backward))
    engine.step()
    return {n: p.detach() - before[n] for n, p in engine.module.named_parameters()}


class _Streamed:
    """A loss whose backward runs `fn` (the reference's streamed backward), as `engine.backward` sees it."""

    @staticmethod
    def apply(anchor, fn):
        import torch

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, anchor):
                return anchor.detach().clone()

            @staticmethod
            def backward(ctx, grad):
                fn()
                return None

        return Function.apply(anchor)


def _layer(layer, hidden, rope):
    out = layer(hidden, position_embeddings=rope)
    return out[0] if isinstance(out, tuple) else out


def _chunked_layer_backward(optimizer, process, layer, saved, rope, grad_out, chunk: int):
    """Recompute `layer` from its input; back-propagate its output gradient chunk by chunk, the no-op
    installed for every chunk but the last (the reference's swap); the input's gradient."""
    import torch

    inp = saved.detach().requires_grad_()
    out = _layer(layer, inp, rope)
    seq_len = out.shape[1]
    starts = list(range(0, seq_len, chunk))
    for start in starts:
        last = start == starts[-1]
        optimizer.process_gradients = process if last else (lambda *args: None)
        stop = min(start + chunk, seq_len)
        torch.autograd.backward(out[:, start:stop], grad_out[:, start:stop], retain_graph=not last)
    return inp.grad


def _rank(rank, world, spec):
    import deepspeed

    from streambp_core.models import build_model, load_config
    from streambp_core.verify import deepspeed as dv
    from streambp_core.verify.compare import max_rel_err
    from streambp_core.verify.methods import DTYPES

    deepspeed.init_distributed(dist_backend="gloo")
    step = spec.step
    model = build_model(load_config(step.model), dtype=DTYPES[step.dtype], device="cpu", seed=step.seed)
    batches = [[dv._batch(spec, model, r, 0)] for r in range(world)]
    plain = dv._adam_update(model, dv._plain_gradient(model, spec, batches))
    ours = dv._engine_step(model, "streambp", "zero2", spec, batches[rank]).update
    theirs = reference_update(model, spec, batches[rank][0][0])
    rows = []
    for approach, update in (("this project (ds_grad_is_ready + one view_as firing)", ours),
                             ("reference (process_gradients no-op until a layer's last chunk)", theirs)):
        for group in ("embedding", "decoder layers", "final norm", "lm_head"):
            names = [n for n in update if _group(n) == group]
            err, worst = max_rel_err({n: update[n] for n in names}, {n: plain[n] for n in names})
            rows.append({"approach": approach, "params": group, "max_rel_err": err, "worst_param": worst})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from streambp_core.parallel.launch import run_ranks
    from streambp_core.verify.methods import VerifySpec

    spec = VerifySpec.of(model=args.model, methods=("streambp",), seq_len_tokens=args.seq_len, batch_size=1,
                         partition_size=args.chunk, head_partition_size=args.chunk, dtype="float64",
                         padding="none")
    rows = run_ranks(_rank, 2, args=(spec,), timeout_s=900)[0]
    common = {"model": args.model, "seq_len_tokens": args.seq_len, "chunk_tokens": args.chunk, "nproc": 2,
              "dtype": "float64 (float32 master weights)", "source": "measured-cpu"}
    out = Path(args.out) if args.out else None
    return emit_rows(lambda: [{**row, **common} for row in rows], out, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
