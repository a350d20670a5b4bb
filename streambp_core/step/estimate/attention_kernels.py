"""What fraction of a GPU's dense bf16 peak an attention kernel reaches, by kernel, pass and the key
length of the call: the published speed curves, not fitted to this project's step-time table.

Hopper (H100, H200; the same SM90 die): FlashAttention-3 paper (Shah et al., arXiv 2407.08608), Fig.
"Attention forward speed, head dim 128 (H100 80GB SXM5)" and Fig. "Attention backward speed, head dim
128 (H100 80GB SXM5)", TFLOP/s at sequence lengths 512 ... 16k (batch x length = 16k tokens, 2,048 model
dimensions):

    forward   FlashAttention-2 309 350 362 368 370 370   cuDNN 497 574 617 609 600 595
              FlashAttention-3 467 565 625 638 646 648
    backward  FlashAttention-2 214 260 291 310 318 322   cuDNN 305 408 465 499 518 516
              FlashAttention-3 316 424 501 542 559 561

Each figure is divided by the H100 SXM5 datasheet peak (989.4 TFLOP/s) and interpolated in log2 of the
call's key length; beyond 16k keys the 16k figure holds (each curve is flat from 8k on), below 512 the 512
one. Which kernel runs (`attention_kernel`): torch's SDPA prefers cuDNN on Hopper (TRL PR #6846: "PyTorch
already prefers cuDNN on Hopper by itself"; with the cuDNN bundled with torch shadowed it falls back to
FlashAttention-2 and the step runs ~1.7x slower, transformers PR #48163), the flash-attn package runs
FlashAttention-2, and torch's context parallelism ran FlashAttention-2 before it supported cuDNN
(torchtitan PR #1000, March 2025).

Ampere (A100, A800): FlashAttention-2 paper (Dao, arXiv 2307.08691): up to 73 % of peak forward and 63 %
backward (causal, head dim 128, 16k), whatever `attn` names (SDPA's cuDNN is slower there, 0.82x on A100:
transformers PR #48163). No published step of the committed table runs on Ampere: these two figures are
the paper's, unchecked against a step.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from types import MappingProxyType

KERNELS = ("cudnn", "fa2", "fa3")
"""Attention kernels the curves cover."""
_LENGTHS = (512, 1_024, 2_048, 4_096, 8_192, 16_384)
_H100_PEAK_TFLOPS = 989.4
_HOPPER_TFLOPS: Mapping[tuple[str, bool], tuple[float, ...]] = MappingProxyType({
    ("fa2", False): (309, 350, 362, 368, 370, 370),
    ("cudnn", False): (497, 574, 617, 609, 600, 595),
    ("fa3", False): (467, 565, 625, 638, 646, 648),
    ("fa2", True): (214, 260, 291, 310, 318, 322),
    ("cudnn", True): (305, 408, 465, 499, 518, 516),
    ("fa3", True): (316, 424, 501, 542, 559, 561),
})
"""(kernel, backward) -> TFLOP/s at `_LENGTHS` on H100 SXM5 (FlashAttention-3 paper)."""
_AMPERE_FRACTION = MappingProxyType({False: 0.73, True: 0.63})
"""backward -> fraction of peak of FlashAttention-2 on A100 (FlashAttention-2 paper)."""


def attention_kernel(attn: str, gpu_name: str) -> str:
    """The kernel a step's attention runs: `attn` ('sdpa', 'flash' or 'auto', `config.ATTN_BACKENDS`)
    on the GPU named `gpu_name` (`estimate.GpuModel.name`). 'auto' picks flash-attn where it is
    installed: FlashAttention-2, as 'flash'; 'sdpa' is cuDNN on Hopper, FlashAttention-2 elsewhere."""
    if attn == "sdpa" and _hopper(gpu_name):
        return "cudnn"
    return "fa2"


def attention_efficiency(kernel: str, gpu_name: str, key_len: float, *, backward: bool) -> float:
    """Fraction of the dense bf16 peak `kernel` reaches on `gpu_name` in one call over `key_len` keys,
    forward or backward (module docstring)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose from {', '.join(KERNELS)}")
    if not _hopper(gpu_name):
        return _AMPERE_FRACTION[backward]
    curve = _HOPPER_TFLOPS[(kernel, backward)]
    return _interpolated(curve, key_len) / _H100_PEAK_TFLOPS


def _hopper(gpu_name: str) -> bool:
    return "H100" in gpu_name or "H200" in gpu_name


def _interpolated(curve: tuple[float, ...], key_len: float) -> float:
    """`curve` at `key_len`, linear in log2 of the length between the published points, flat outside."""
    if key_len <= _LENGTHS[0]:
        return curve[0]
    if key_len >= _LENGTHS[-1]:
        return curve[-1]
    i = bisect.bisect_right(_LENGTHS, key_len)
    lo, hi = math.log2(_LENGTHS[i - 1]), math.log2(_LENGTHS[i])
    weight = (math.log2(key_len) - lo) / (hi - lo)
    return curve[i - 1] + weight * (curve[i] - curve[i - 1])
