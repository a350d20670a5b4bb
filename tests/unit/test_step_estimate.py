"""The op record of a meta step, the roofline step-time estimate and the automatic partition choice."""

from __future__ import annotations

import pytest
import torch

from streambp_core.config import ConfigError
from streambp_core.models.load import tiny_config
from streambp_core.step.estimate.ops import OpRecord, OpRecorder, meta_step_ops, prefix_attention_flops
from streambp_core.step.estimate.roofline import (
    GPU_MODELS,
    LAUNCH_S,
    estimate_by_depth,
    estimate_ops,
    gpu_model,
    op_time_s,
)
from streambp_core.step.search.partitions import (
    auto_partitions,
    head_candidates,
    largest_fitting,
    layer_candidates,
)


def test_bytes_moved_count_each_tensor_once_wherever_it_is_nested():
    """An op's bytes: every distinct tensor of its arguments, keyword arguments and outputs, nested in
    lists, tuples, dicts and torch's return types, as torch's `tree_flatten` finds them."""
    from torch.utils._pytree import tree_flatten

    from streambp_core.step.estimate.ops import _tensor_bytes

    a, b = torch.ones(3, 5, device="meta"), torch.ones(2, dtype=torch.float64, device="meta")
    out = torch.max(torch.ones(4, 6, dtype=torch.bfloat16, device="meta"), dim=1)  # (values, indices)
    args = (a, [a, (b, 2.0)], {"x": [b]}, None)
    kwargs = {"weight": a, "scale": 1.5, "extra": (torch.ones(7, device="meta"),)}
    leaves = {id(t): t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)}
    assert _tensor_bytes(args, kwargs, out) == sum(t.numel() * t.element_size() for t in leaves.values())
    assert _tensor_bytes(args, kwargs, out) == 3 * 5 * 4 + 2 * 8 + 4 * 2 + 4 * 8 + 7 * 4


def test_recorder_counts_matmul_flops_in_place_ones_included():
    a, b = torch.ones(4, 8, device="meta"), torch.ones(8, 16, device="meta")
    out = torch.zeros(4, 16, device="meta")
    with OpRecorder() as recorder:
        out.addmm_(a, b)
        (a @ b).t()
    assert recorder.matmul_flops() == 2 * (2 * 4 * 8 * 16)
    assert recorder.dispatched() == 3 and recorder.launches() == 2  # the transpose moves nothing


def test_prefix_attention_flops_count_allowed_pairs():
    q, k = torch.empty(1, 2, 3, 4, device="meta"), torch.empty(1, 1, 5, 4, device="meta")
    pairs = 3 + 4 + 5  # queries are the last 3 of 5 positions, lower-right causal
    assert prefix_attention_flops(q, k, backward=False) == 4 * 2 * pairs * 4


def test_roofline_of_one_op():
    gpu = gpu_model("H100")
    matmul = OpRecord("aten.mm", flops=int(1e12), bytes=0)
    copy = OpRecord("aten.copy_", flops=0, bytes=int(1e9))
    assert op_time_s(matmul, gpu) == pytest.approx(1e12 / (0.7 * gpu.peak_bf16_flops))
    assert op_time_s(copy, gpu) == pytest.approx(1e9 / (0.8 * gpu.hbm_bytes_per_s))
    assert op_time_s(OpRecord("aten.view", 0, 10**9), gpu) == 0.0
    estimate = estimate_ops([matmul, copy, OpRecord("aten.view", 0, 0)], gpu)
    assert estimate.launches == 2 and estimate.launch_s == pytest.approx(2 * LAUNCH_S)
    assert estimate.source == "estimated"


def test_unknown_gpu_is_refused_by_name():
    with pytest.raises(ConfigError, match="h100, h200, a100, a800"):
        gpu_model("v100")
    assert set(GPU_MODELS) == {"h100", "h200", "a100", "a800"}


def test_depth_extrapolation_equals_the_full_model():
    config = tiny_config("qwen3", num_hidden_layers=3)

    def record(depth):
        return meta_step_ops(config, "streambp", 40, num_layers=depth, partition_size=16,
                             head_partition_size=8)

    gpu = gpu_model("a100")
    extrapolated = estimate_by_depth(record, config, gpu)
    full = estimate_ops(record(3), gpu)
    assert extrapolated.launches == full.launches
    assert extrapolated.step_time_ms == pytest.approx(full.step_time_ms, rel=1e-9)
    assert full.step_time_ms > estimate_ops(record(2), gpu).step_time_ms > 0


def test_partition_candidates():
    assert layer_candidates(12000)[-3:] == [4000, 6000, 12000]  # T/3, T/2, T
    assert layer_candidates(50) == [50]
    assert head_candidates(1000) == [64, 128, 256, 512, 1000]


def test_largest_fitting_bisects():
    calls = []

    def fits(size):
        calls.append(size)
        return size <= 40

    assert largest_fitting(list(range(1, 101)), fits) == 40
    assert len(calls) <= 9
    assert largest_fitting([50, 60], fits) is None


def test_auto_partitions_take_the_largest_that_fit():
    def fits(partition, head):  # a budget both sizes draw on
        return partition + 10 * head <= 9000

    layer, head = auto_partitions(16384, fits)
    assert fits(layer, head) and layer == 8192
    assert not fits(layer, head * 2)
    assert auto_partitions(16384, fits, partition_size=1000) == (1000, 512)
    with pytest.raises(ConfigError, match="no partition fits"):
        auto_partitions(16384, lambda p, h: False)


def _flops_rows(ops_ratio: float, auto_ratios: tuple[float, ...] = ()):
    import pandas as pd

    common = {"head_mode": "fused", "matmul_tflop": 43.0, "flops_vs_checkpoint": 1.0, "launches": 90,
              "launches_vs_checkpoint": 1.8, "auto_budget_gib": float("nan")}
    rows = [{**common, "method": "checkpoint", "partition_size": 5462, "head_partition_size": float("nan"),
             "head_mode": float("nan"), "dispatched_ops": 100, "dispatched_vs_checkpoint": 1.0},
            {**common, "method": "streambp", "partition_size": 5462, "head_partition_size": 1024.0,
             "dispatched_ops": int(100 * ops_ratio), "dispatched_vs_checkpoint": ops_ratio}]
    rows += [{**common, "method": "streambp", "partition_size": 16384, "head_partition_size": 16384.0,
              "dispatched_ops": int(100 * ratio), "dispatched_vs_checkpoint": ratio, "auto_budget_gib": 80.0}
             for ratio in auto_ratios]
    return pd.DataFrame(rows)


@pytest.mark.parametrize(("ops_ratio", "verdict"), [(3.1, "not met: 3.10x"), (1.9, "met: 1.90x")])
def test_results_readme_states_the_ops_ratio_of_the_rows(ops_ratio, verdict):
    from streambp_bench.paper.step_time import flops_section

    text = " ".join(flops_section(_flops_rows(ops_ratio))).replace("\n", " ")
    assert f"({verdict} there)" in text and "(met: 1.000x with the fused head at partition 1024)" in text
    assert "automatic choice" not in text


def test_results_readme_gives_the_automatic_partitions_their_own_ratio():
    from streambp_bench.paper.step_time import flops_section

    lines = flops_section(_flops_rows(3.1, (0.96, 1.06)))
    text = " ".join(lines).replace("\n", " ")
    assert "(not met: 3.10x there)" in text and "dispatches 0.96x to 1.06x checkpoint's ops" in text
    assert sum("| auto, 80 GiB |" in line for line in lines) == 2
