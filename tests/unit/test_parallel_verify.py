"""Two real ranks on the CPU (gloo): every method under FSDP2 zero2 and zero3 has the gradients of
single-process plain backprop, all-gathered, for sft, grpo and dpo; and each step's collectives are one
all-gather (two for zero3) and one reduce-scatter per FSDP unit, the same for StreamBP at 8 chunks per
layer as at 1 and as for plain."""

from __future__ import annotations

from dataclasses import replace

import pytest

from streambp_core.config import METHODS
from streambp_core.models import load_config
from streambp_core.parallel.launch import available_cpus
from streambp_core.verify.methods import VerifySpec

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(available_cpus() < 2, reason="needs two CPU cores for two ranks")]

MODEL = "tiny/qwen3"
SEQ_LEN = 64
GATHERS_PER_UNIT = {"zero2": 1, "zero3": 2}


@pytest.fixture(scope="module")
def report():
    from streambp_core.verify.sharded import verify_sharded

    base = VerifySpec.of(model=MODEL, methods=METHODS, seq_len_tokens=SEQ_LEN, batch_size=2, partition_size=8,
                         head_partition_size=16, dtype="float64", padding="right")
    specs = (base, replace(base, step=base.step.replaced(objective="grpo")),
             replace(base, step=base.step.replaced(objective="dpo")),
             replace(base, methods=("streambp",), step=base.step.replaced(partition_size=SEQ_LEN)))
    return verify_sharded(specs, nproc=2)


def test_every_method_objective_and_stage_matches_single_process_plain(report):
    seen = {(r.method, r.objective, r.shard) for r in report.results}
    assert seen == {(m, o, s) for m in METHODS for o in ("sft", "grpo", "dpo") for s in GATHERS_PER_UNIT}
    bad = [(r.method, r.objective, r.shard, r.max_rel_err, r.worst_param) for r in report.results if not r.ok]
    assert not bad
    assert max(r.max_rel_err for r in report.results) <= 1e-10
    assert report.source == "measured-cpu"


@pytest.mark.parametrize("shard", list(GATHERS_PER_UNIT))
def test_collectives_are_per_layer_not_per_chunk(report, shard):
    units = load_config(MODEL).num_hidden_layers + 1  # the decoder layers and the root
    rows = [r for r in report.results if r.shard == shard]
    assert len(rows) == 3 * len(METHODS) + 1
    for row in rows:
        assert (row.all_gathers, row.reduce_scatters) == (GATHERS_PER_UNIT[shard] * units, units), row.method
    assert len({(r.all_gather_bytes, r.reduce_scatter_bytes) for r in rows}) == 1
    assert rows[0].reduce_scatter_bytes > 0
