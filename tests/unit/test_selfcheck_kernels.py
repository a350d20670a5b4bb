"""The yardstick of the self-check's `kernels` item: attention written out as a model file writes it
(`families._written_out`) is the engine's attention, in float64 on CPU, for every case the item checks on
CUDA (windows, sinks, the soft cap), so a GPU row's ratio compares a path with the right attention."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from streambp_bench.selfcheck import families
from streambp_core.engine.attention.prefix import prefix_attention


@pytest.mark.parametrize("case", families.KERNEL_CASES, ids=lambda case: case.name)
def test_the_written_out_attention_is_the_engines(case: families.KernelCase) -> None:
    small = replace(case, queries=7, keys=40, window=None if case.window is None else min(case.window, 9))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, 16, generator=gen, dtype=torch.float64)
               for heads, n in ((4, small.queries), (2, small.keys), (2, small.keys)))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64) if small.sinks else None
    got = families._written_out(small, q, k, v, sinks)
    want = prefix_attention(q, k, v, None, 16 ** -0.5, "auto", small.window, sinks=sinks,
                            softcap=small.softcap)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_every_kernel_case_differs_from_plain_causal_attention() -> None:
    """Each case's option changes the attention (a window narrower than the keys, a soft cap that bites),
    so a case cannot pass by checking plain attention twice."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) * 4 for n in (5, 30, 30))
    plain = families._written_out(families.KernelCase("plain", 5, 30), q, k, v)
    for case in families.KERNEL_CASES:
        if case.name == "blocked":
            continue
        small = replace(case, queries=5, keys=30, window=None if case.window is None else 6,
                        softcap=None if case.softcap is None else 2.0)
        sinks = torch.full((2,), 1.0, dtype=torch.float64) if small.sinks else None
        assert not torch.allclose(families._written_out(small, q, k, v, sinks), plain), case.name
