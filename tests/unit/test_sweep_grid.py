"""The sweep grid's expansion, and one simulated point -> its result row."""

from __future__ import annotations

import pytest

from streambp_bench import tokens
from streambp_bench.results import ResultsFile
from streambp_bench.results.schema_history import SCHEMA_1_COLUMNS
from streambp_bench.sweep import grid
from streambp_core.config import ConfigError, StepSpec
from streambp_core.step.parts.target import resolve_target


def test_a_grid_too_large_to_run_is_refused_before_it_is_built() -> None:
    with pytest.raises(ConfigError, match="has 2,999,999 points; a sweep runs at most 10,000"):
        tokens.parse_token_list("2:3000000:1")  # a STEP of 1 token: the list alone would fill memory
    assert len(tokens.parse_token_list("2:10001:1")) == tokens.MAX_GRID_POINTS
    with pytest.raises(ConfigError, match="the grid has 40,000 points"):
        grid.expand_grid(methods=("streambp",) * 4, models=("tiny/llama",), seq_lens=tuple(range(2, 102)),
                        partition_sizes=tuple(range(1, 101)))


def test_grid_gives_partition_sizes_only_to_partitioned_methods() -> None:
    points = grid.expand_grid(
        methods=("checkpoint", "streambp"),
        models=("tiny/llama",),
        seq_lens=(64, 128),
        partition_sizes=(16, 32),
    )
    checkpoint = [p for p in points if p.method == "checkpoint"]
    streambp = [p for p in points if p.method == "streambp"]
    assert len(checkpoint) == 2 and {row_partition(p) for p in checkpoint} == {None}
    assert len(streambp) == 4 and {p.stream.partition_size for p in streambp} == {16, 32}


def row_partition(point: StepSpec) -> int | None:
    """The partition_size cell of a row about `point`."""
    from streambp_bench.results import spec_fields

    return spec_fields(point)["partition_size"]


def test_simulated_point_row_has_peak_and_breakdown() -> None:
    where = resolve_target("sim", 1.0)
    point = StepSpec.of(
        method="streambp", model="tiny/llama", seq_len_tokens=128, partition_size=32, head_partition_size=16
    )
    (row,) = grid.run_point(point, where)
    assert row.source == "simulated" and row.status == "ok" and row.metric == "peak_memory"
    parts = [
        row.weights_gib,
        row.grads_gib,
        row.optimizer_gib,
        row.checkpoints_gib,
        row.kv_gib,
        row.logits_gib,
        row.temporaries_gib,
        row.kernel_workspace_gib,
    ]
    assert row.value == pytest.approx(sum(parts))
    assert row.key() in grid.point_keys(point, where)


def test_a_simulated_row_is_the_full_depth_peak_where_extrapolation_is_not_exact() -> None:
    """12 Qwen3.5 layers (3 linear, 1 full) under streambp at 64 tokens: extrapolated from 4 and 8 layers
    the peak is 1 KiB over the full depth's; the row reports the full depth's."""
    from streambp_core.models import tiny_config
    from streambp_core.step.parts.resolved import ResolvedModel
    from streambp_core.step.simulation.simulate import simulate

    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * 3
    model = ResolvedModel(tiny_config("qwen3.5", num_hidden_layers=12, layer_types=layer_types))
    point = StepSpec.of(method="streambp", model="tiny/qwen3.5", seq_len_tokens=64, partition_size=32,
                        head_partition_size=16)
    full = simulate(point, model, depth="full")
    assert simulate(point, model).peak_bytes != full.peak_bytes
    (row,) = grid.run_point(point, resolve_target("sim", 1.0), model)
    assert row.status == "ok" and row.value * 2**30 == pytest.approx(full.peak_bytes, abs=1)


def test_simulated_point_over_budget_is_oom() -> None:
    where = resolve_target("sim", 1e-6)
    (row,) = grid.run_point(
        StepSpec.of(
            method="checkpoint",
            model="tiny/llama",
            seq_len_tokens=256,
        ),
        where,
    )
    assert row.status == "oom" and row.value is None and row.peak_allocated_gib > 1e-6


def test_training_step_with_optimizer_counts_optimizer_state() -> None:
    where = resolve_target("sim")
    point = StepSpec.of(method="streambp", model="tiny/llama", seq_len_tokens=128, partition_size=32,
                        head_partition_size=16, objective="grpo", batch_size=2, lora_rank=4,
                        optimizer="adamw")
    (row,) = grid.run_point(point, where)
    assert row.status == "ok" and row.optimizer_gib > 0 and row.lora_rank == 4
    assert (row.grads, row.protocol, row.attn) == ("fresh", "default", "auto")


def test_a_rerun_point_replaces_its_schema_1_row(tmp_path) -> None:
    """A point written before the attn/protocol/grads columns is the same point when run again."""
    where = resolve_target("sim")
    sizes = {"partition_size": 32, "head_partition_size": 16}
    points = [StepSpec.of(method="streambp", model="tiny/llama", seq_len_tokens=128, optimizer=name, **sizes)
              for name in ("none", "adamw")]  # fmt: skip
    rows = [row for point in points for row in grid.run_point(point, where)]
    path = tmp_path / "old.csv"
    lines = [",".join(r.to_record()[c] for c in SCHEMA_1_COLUMNS) for r in rows]
    path.write_text("\n".join([",".join(SCHEMA_1_COLUMNS), *lines]) + "\n")
    results = ResultsFile(path)
    assert all(grid.point_keys(point, where) <= {row.key() for row in results.rows()} for point in points)
    assert grid.run_points(points, where, results) == []  # both already done


def test_cpu_point_measures_step_time() -> None:
    where = resolve_target("cpu", cpu_budget=False)
    point = StepSpec.of(method="streambp", model="tiny/llama", seq_len_tokens=64, partition_size=16,
                        head_partition_size=16, dtype="float32")
    memory, time = grid.run_point(point, where)
    assert memory.source == time.source == "measured-cpu"
    assert time.metric == "step_time" and time.value == memory.step_time_ms > 0
    assert memory.step_time_p20_ms <= memory.step_time_ms <= memory.step_time_p80_ms


@pytest.mark.parametrize("device", ["sim", "cpu"])
def test_an_offloaded_point_carries_its_host_figures_and_a_lower_device_peak(device: str) -> None:
    """Offloaded checkpoints leave the device peak and appear in the host columns, moved out and back."""
    where = resolve_target(device, 1.0)
    point = StepSpec.of(method="streambp", model="tiny/llama", seq_len_tokens=128, partition_size=32,
                        head_partition_size=16, dtype="float32")
    (kept,) = grid.run_point(point, where)[:1]
    (moved,) = grid.run_point(point.replaced(offload="checkpoints"), where)[:1]
    assert (kept.offload, moved.offload) == ("none", "checkpoints")
    assert (kept.host_peak_gib, kept.to_host_gib, kept.to_device_gib) == (0.0, 0.0, 0.0)
    assert moved.host_peak_gib > 0 and moved.to_host_gib == moved.to_device_gib >= moved.host_peak_gib
    assert moved.peak_allocated_gib < kept.peak_allocated_gib
    assert moved.checkpoints_gib < kept.checkpoints_gib
