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


def test_device_events_summed_per_class_cpu_ops_skipped():
    def event(key, device_type, us, count):
        return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=us, count=count)

    events = [
        event("aten::mm", "DeviceType.CPU", 0, 10),  # its kernels are listed on their own
        event("aten::_flash_attention_backward", "DeviceType.CPU", 900, 2),
        event("sm90_xmma_gemm_bf16bf16", "DeviceType.CUDA", 1500, 6),
        event("nvjet_tst_128x256", "DeviceType.CUDA", 500, 4),
        event("flash_bwd_dq_dk_dv_loop_kernel", "DeviceType.CUDA", 2000, 2),
        event("vectorized_elementwise_kernel", "DeviceType.CUDA", 250, 40),
    ]
    got = {t.kernel_class: (t.device_time_ms, t.launches) for t in kernel_time_by_class(events)}
    assert got == {"attention_bwd": (2.0, 2), "gemm": (2.0, 10), OTHER: (0.25, 40)}
