"""The step-time model's attention: each kernel at its published speed by pass and key length, the kernel
a step's `attn` runs on each GPU, and the estimate's regime, band, data-parallel steps and host optimizer
step."""

from __future__ import annotations

import pytest

from streambp_core.config import StepSpec
from streambp_core.step.estimate.attention_kernels import attention_efficiency, attention_kernel
from streambp_core.step.estimate.ops import OpRecord
from streambp_core.step.estimate.roofline import (
    STEP_BAND,
    StepEstimate,
    gpu_model,
    host_optimizer_s,
    op_time_s,
)

H100 = gpu_model("h100").name


def test_hopper_efficiency_is_the_published_curve_flat_beyond_its_ends():
    assert attention_efficiency("cudnn", H100, 16_384, backward=False) == pytest.approx(595 / 989.4)
    assert attention_efficiency("cudnn", H100, 1_048_576, backward=True) == pytest.approx(516 / 989.4)
    assert attention_efficiency("fa2", H100, 128, backward=True) == pytest.approx(214 / 989.4)
    between = attention_efficiency("fa3", H100, 2_048 * 2 ** 0.5, backward=False)  # half-way in log2
    assert between == pytest.approx((625 + 638) / 2 / 989.4)
    with pytest.raises(ValueError, match="cudnn, fa2, fa3"):
        attention_efficiency("xformers", H100, 4_096, backward=False)


def test_the_kernel_follows_attn_and_the_gpu():
    assert attention_kernel("sdpa", H100) == "cudnn"
    assert attention_kernel("sdpa", gpu_model("h200").name) == "cudnn"
    assert attention_kernel("flash", H100) == "fa2"
    assert attention_kernel("sdpa", gpu_model("a100").name) == "fa2"
    assert attention_efficiency("cudnn", gpu_model("a100").name, 65_536, backward=True) == 0.63


def test_an_attention_op_is_timed_at_its_pass_and_key_length():
    gpu = gpu_model("h100")
    forward = OpRecord("streambp.prefix_attn_fwd", flops=int(4e14), bytes=0, keys=65_536)
    backward = OpRecord("streambp.prefix_attn_bwd", flops=int(1e15), bytes=0, keys=65_536)
    assert op_time_s(forward, gpu, "cudnn") == pytest.approx(4e14 / 595e12)
    assert op_time_s(backward, gpu, "cudnn") == pytest.approx(1e15 / 516e12)
    assert op_time_s(backward, gpu, "fa2") == pytest.approx(1e15 / 322e12)
    short = OpRecord("streambp.prefix_attn_fwd", flops=int(4e14), bytes=0, keys=512)
    assert op_time_s(short, gpu, "cudnn") == pytest.approx(4e14 / 497e12)
    assert op_time_s(short, gpu, "cudnn", key_scale=32) == pytest.approx(4e14 / 595e12)


def test_regime_is_the_part_that_dominates_and_the_band_brackets_the_step():
    attention = StepEstimate("gpu", matmul_s=1.0, attention_s=3.0, other_s=0.5, launch_s=0.1, launches=1)
    assert attention.regime == "attention-bound"
    gemm = StepEstimate("gpu", matmul_s=3.0, attention_s=1.0, other_s=0.5, launch_s=0.1, launches=1)
    assert gemm.regime == "GEMM-bound"
    pcie = StepEstimate("gpu", 1.0, 1.0, 0.0, 0.0, 1, to_host_bytes=64 * 10**9, to_device_bytes=64 * 10**9,
                        pcie_bytes_per_s=32e9, transfer_s=2.0)  # 4 s of copies against 2 s of compute
    assert pcie.regime == "PCIe-bound"
    low, high = attention.band_s
    step_s = attention.step_time_ms / 1e3
    assert (step_s / low, step_s / high) == pytest.approx(STEP_BAND[::-1])


def _tiny(**changes) -> StepSpec:
    return StepSpec.of(model="tiny/llama", method="checkpoint", seq_len_tokens=256, optimizer="adamw",
                       attn="sdpa", **changes)


def test_a_data_parallel_step_is_estimated_with_its_collectives():
    from streambp_core.step.estimate.step_estimate import estimate_step

    gpu = gpu_model("h100")
    single = estimate_step(_tiny(), gpu)
    sharded = estimate_step(_tiny(gpus=2, shard="zero2"), gpu)
    assert sharded.source == "estimated" and sharded.all_to_all_s == 0.0
    assert sharded.interconnect  # timed over the node's links
    assert sharded.step_time_ms == pytest.approx(single.step_time_ms + 1e3 * sharded.zero_s, rel=1e-6)


def test_the_host_optimizer_step_is_added_with_the_optimizer_tier():
    from streambp_core.step.estimate.step_estimate import estimate_step
    from streambp_core.step.parts.resolved import resolved
    from streambp_core.step.simulation.simulate import shard_layout

    gpu = gpu_model("h100")
    spec = _tiny(offload="optimizer")
    estimate = estimate_step(spec, gpu)
    params = shard_layout(spec, resolved(spec.model, None).config).total("trainable_full") // 2
    assert estimate.host_optimizer_s > 0
    assert estimate.host_optimizer_s == pytest.approx(host_optimizer_s(params, gpu))
    assert estimate_step(_tiny(), gpu).host_optimizer_s == 0.0
