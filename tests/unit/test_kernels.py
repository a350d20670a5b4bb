"""Kernel classes of a profiled step, from kernel names as CUDA profiles show them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from streambp_core.measure.kernels import OTHER, kernel_class, kernel_time_by_class


@pytest.mark.parametrize(("name", "expected"), [
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_traits>", "attention_bwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3", "attention_bwd"),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "attention_bwd"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention_fwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention_fwd"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT", "gemm"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<OpaqueType<2u>, unsigned int, 3>", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", OTHER),
])  # fmt: skip
def test_kernel_names_fall_in_their_class(name, expected):
    assert kernel_class(name) == expected


def event(key, device_type, self_us, count):
    cpu = device_type.endswith("CPU")
    return SimpleNamespace(key=key, device_type=device_type, count=count, self_cpu_time_total=self_us * cpu,
                           self_device_time_total=self_us * (not cpu))


EVENTS = [
    event("aten::mm", "DeviceType.CPU", 300, 10),  # on CUDA its kernels are listed on their own
    event("streambp::prefix_attn_bwd", "DeviceType.CPU", 900, 2),
    event("sm90_xmma_gemm_bf16bf16", "DeviceType.CUDA", 1500, 6),
    event("nvjet_tst_128x256", "DeviceType.CUDA", 500, 4),
    event("flash_bwd_dq_dk_dv_loop_kernel", "DeviceType.CUDA", 2000, 2),
    event("vectorized_elementwise_kernel", "DeviceType.CUDA", 250, 40),
]


def test_device_events_summed_per_class_cpu_ops_skipped():
    got = {t.kernel_class: (t.self_time_ms, t.launches) for t in kernel_time_by_class(EVENTS)}
    assert got == {"attention_bwd": (2.0, 2), "gemm": (2.0, 10), OTHER: (0.25, 40)}


def test_a_cpu_run_sums_the_ops_self_time():
    got = {t.kernel_class: (t.self_time_ms, t.launches) for t in kernel_time_by_class(EVENTS, "cpu")}
    assert got == {"attention_bwd": (0.9, 2), "gemm": (0.3, 10)}


def test_profiling_a_cpu_step_finds_its_matmuls():
    import torch

    from streambp_core.measure.kernels import profile_kernel_time

    a = torch.randn(64, 64)
    classes = {t.kernel_class: t for t in profile_kernel_time(lambda: (a @ a).relu(), "cpu")}
    assert classes["gemm"].launches == 2 and classes["gemm"].self_time_ms > 0  # aten::matmul, aten::mm
    assert classes[OTHER].launches >= 1  # relu
