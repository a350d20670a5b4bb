"""`verify trainer KIND --nproc N --engine fsdp2|deepspeed`: the ranks of a sharded trainer check.

    results = run_sharded_parity(ParitySetup(trainer="sft"), engine="fsdp2", shard="zero3", nproc=2,
                                 methods=("streambp",), partition_size=8)

What each rank runs and how the figures are judged is `streambp_core.verify.trainer_sharded`; this
module checks the request before any rank starts, starts the ranks (`parallel.launch.run_ranks`, gloo),
trains the reference and returns one `ShardedParity` per method.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from transformers import TrainerCallback

from streambp_core.config import ConfigError


def run_sharded_parity(setup, *, engine: str, shard: str, nproc: int, methods, **options) -> list:
    """Train plain and each method on `nproc` ranks of `engine` and compare them with the reference
    (`sharded_parity`'s steps); ConfigError before any rank starts for what cannot run, and for a plain
    training that moved nothing; `BrokenReference` for a reference whose update is not finite."""
    from streambp_core.parallel.launch import check_nproc, run_ranks
    from streambp_core.verify import trainer_sharded as sharded
    from streambp_core.verify.trainer_parity import check_reference

    try:
        sharded.check_sharded(setup, engine, shard, methods)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_nproc(nproc, "cpu")
    sharded.check_settings(setup)
    setup = replace(setup, settings={"gradient_accumulation_steps": sharded.ACCUMULATION_STEPS,
                                     **setup.settings})
    per_rank = run_ranks(sharded.rank_train, nproc, timeout_s=sharded.RANK_TIMEOUT_S,
                         args=(setup, engine, shard, tuple(methods), options, ReductionCount))
    updates, tied, reductions = per_rank[0]
    float64_plain = None
    if setup.trainer == "grpo":
        reference_name, reference = "plain on the engine", updates["plain"]
    elif engine == "deepspeed":
        reference_name = "single-process plain on deepspeed"
        one_rank = run_ranks(sharded.rank_train, 1, timeout_s=sharded.RANK_TIMEOUT_S,
                             args=(sharded.global_batch(setup, nproc), engine, shard, (), {}))
        reference = one_rank[0][0]["plain"]
        float64_plain = sharded.single_process_plain(setup, nproc)
    else:
        reference_name, reference = "single-process plain", sharded.single_process_plain(setup, nproc)
    check_reference(reference_name, reference)
    check_reference(f"plain on {nproc} {engine} ranks", updates["plain"])
    return [sharded.compare_sharded(engine, shard, nproc, setup, method, reference_name, reference, updates,
                                    tied, float64_plain, reductions) for method in methods]


class ReductionCount(TrainerCallback):
    """How many times ZeRO reduces each trainable parameter per micro-step (per step on ZeRO-1), counted by
    `verify.deepspeed.count_reductions` on the engine's optimizer, tallied as '0', '1', '2+'."""

    def __init__(self, shard: str) -> None:
        self.per_step = shard == "zero1"
        self.trainer = None
        self.tallies: Counter = Counter()
        self._counts: Counter = Counter()
        self._trainable = 0

    def on_train_begin(self, args, state, control, **kwargs):
        from streambp_core.verify.deepspeed import count_reductions

        engine = self.trainer.model_wrapped  # the DeepSpeed engine `train()` built
        self._counts = count_reductions(engine.optimizer)
        self._trainable = sum(1 for p in engine.module.parameters() if p.requires_grad)

    def on_substep_end(self, args, state, control, **kwargs):
        if not self.per_step:
            self._tally()

    def on_step_end(self, args, state, control, **kwargs):
        self._tally()

    def _tally(self) -> None:
        self.tallies.update("1" if n == 1 else "2+" for n in self._counts.values())
        self.tallies["0"] += self._trainable - len(self._counts)
        self.tallies = +self.tallies
        self._counts.clear()
