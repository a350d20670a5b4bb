"""`plan`'s search asks first about the partitions a related recipe runs (the stronger stage's on the same
rung, else the rung below's): on the real simulator, every recipe it fits runs the partitions `max-len`
resolves for it alone, with no guess."""

from __future__ import annotations

import pytest

from streambp_bench.recipes import run, search
from streambp_core.step.search.partitions import resolve_partitions


@pytest.mark.parametrize(("method", "budget_gib"), [
    ("streambp", 0.004),  # a rung's partitions above the rung below's: a guess that must not be trusted
    pytest.param("streambp", 0.003, marks=pytest.mark.slow),
    pytest.param("mst", 0.006, marks=pytest.mark.slow),
])
def test_every_fitting_recipe_runs_the_partitions_resolved_without_a_guess(method, budget_gib) -> None:
    job = run.prepare("tiny/qwen3", (method,), 2, "h100", 1024, budget_gib, None, 2, {"optimizer": "adamw"})
    chains = [chain for chain in job.chains if chain.base.stream.head_mode == "recompute"]
    fitted = [(chain, outcome) for chain in chains
              for outcome in search.chain_at_length(chain, job.context, lambda *args: None) if outcome.fits]
    for chain, outcome in fitted:
        alone = chain.recipe(outcome.spec.shard, outcome.spec.offload, 1024)
        resolved = resolve_partitions(alone, job.context.budget_bytes, job.context.model)
        assert resolved.stream.partition_size == outcome.spec.stream.partition_size, outcome.label
        assert resolved.stream.head_partition_size == outcome.spec.stream.head_partition_size, outcome.label
    assert len(fitted) > len(chains)  # some searched from a guess: a stronger stage's, a lower rung's
    assert any(not search.largest_partitions(outcome.spec) for _, outcome in fitted)
