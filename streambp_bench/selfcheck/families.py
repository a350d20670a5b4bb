"""The self-check's rows for what the first H200 rows predate: the model families whose layers run their
own attention or state (sinks, soft-capped scores, chunked local attention, latent attention, Gated
DeltaNet) and the attention kernels they reach on CUDA.

- `family_rows`: every method's gradients on each family's tiny preset, in the plan's precision, by the
  rule of the plan's verification (bf16: at most 2x plain bf16's error against float32 plain).
- `kernel_rows`: each CUDA attention path's input gradients in bf16 against float32, by the
  flash-attention rule: the path's error is at most 2x that of the same attention written out in bf16
  (scores, soft cap, mask, sinks, softmax in at least float32, values). Metric grad_err_ratio: the path's
  error over the written-out one's (ok at most 2).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from streambp_bench.results import ResultRow, provenance
from streambp_bench.selfcheck.gradients import grad_rows
from streambp_core.dtypes import at_least_float32
from streambp_core.verify.methods import VerifySpec

FAMILY_MODELS = ("tiny/gpt-oss", "tiny/gemma2", "tiny/llama4", "tiny/deepseek-v3", "tiny/qwen3.5",
                 "tiny/qwen3-next")
"""One tiny preset per layer kind added since the first H200 rows: sinks and alternating sliding layers,
soft-capped scores, chunked local attention with NoPE layers, latent attention, and the two Gated
DeltaNet hybrids (dense and MoE)."""
RULE_FACTOR = 2.0
"""The flash-attention rule: a bf16 path's error at most this times the written-out bf16 attention's."""


def family_rows(plan, where: str) -> Iterator[ResultRow]:
    """Every method of each of `plan.family_models` against plain (`selfcheck.gradients.grad_rows`) at
    `plan.family_seq_len` tokens, two right-padded rows, four layer chunks and three head chunks."""
    for model in plan.family_models:
        spec = VerifySpec.of(model=model, seq_len_tokens=plan.family_seq_len, batch_size=2,
                             dtype=plan.verify_dtype, padding="right", device=plan.device,
                             partition_size=-(-plan.family_seq_len // 4),
                             head_partition_size=-(-plan.family_seq_len // 3))
        yield from grad_rows(spec, where)


@dataclass(frozen=True)
class KernelCase:
    """One attention path: a chunk of `queries` against `keys` keys (the chunk last), its options."""

    name: str
    queries: int
    keys: int
    window: int | None = None
    sinks: bool = False
    softcap: float | None = None
    blocked: bool = True
    """Through `BlockedFlashAttention` with `BLOCK_TOKENS_CHECKED`-key tiles; False: `prefix_attention`."""


BLOCK_TOKENS_CHECKED = 4096
"""Key tiles of the checked blocked paths, so a prefix of 20,000 keys spans five of them."""
KERNEL_CASES = (
    KernelCase("blocked", 500, 20_000),
    KernelCase("blocked-window", 500, 20_000, window=4096),
    KernelCase("blocked-sinks", 500, 20_000, sinks=True),
    KernelCase("blocked-sinks-window", 500, 20_000, window=128, sinks=True),
    KernelCase("softcap", 500, 8_000, softcap=50.0, blocked=False),
    KernelCase("sinks-softcap", 500, 8_000, sinks=True, softcap=50.0, blocked=False),
)
"""gpt-oss's sinks with and without its 128-token window, Gemma 2's 50.0 soft cap, the plain blocked path."""


def kernel_rows(plan, where: str) -> Iterator[ResultRow]:
    """One row per `KERNEL_CASES` path on CUDA (module docstring), 16 query heads on 8 KV heads of 128."""
    for case in KERNEL_CASES:
        ratio = kernel_error_ratio(case)
        ok = ratio <= RULE_FACTOR
        yield ResultRow(method="streambp", model=f"attention {case.name}", seq_len_tokens=case.keys,
                        partition_size=case.queries, dtype="bfloat16", metric="grad_err_ratio", value=ratio,
                        status="ok" if ok else "error",
                        error="" if ok else f"{ratio:.3g}x the written-out bf16 error > {RULE_FACTOR:g}x",
                        **provenance(f"measured-{plan.device}", where))


def kernel_error_ratio(case: KernelCase, heads: int = 16, kv_heads: int = 8, dim: int = 128) -> float:
    """The largest over q, k, v (and the sinks) of the path's bf16 gradient error against float32
    written-out attention, over the written-out bf16 attention's."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1, heads, case.queries, dim), (1, kv_heads, case.keys, dim), (1, kv_heads, case.keys, dim)]
    inputs = [torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16) for shape in shapes]
    if case.sinks:
        inputs.append(torch.randn(heads, generator=gen, device="cuda", dtype=torch.bfloat16))
    grad_out = torch.randn(*shapes[0], generator=gen, device="cuda", dtype=torch.bfloat16)
    reference = _grads(_written_out, case, [x.float() for x in inputs], grad_out.float())
    plain = _grads(_written_out, case, inputs, grad_out)
    path = _grads(_path, case, inputs, grad_out)
    ratios = [(got.float() - ref).abs().max() / (base.float() - ref).abs().max().clamp_min(1e-30)
              for ref, base, got in zip(reference, plain, path, strict=True)]
    return float(max(ratios))


def _grads(attention, case: KernelCase, inputs: list[Tensor], grad_out: Tensor) -> tuple[Tensor, ...]:
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = attention(case, *leaves)
    return torch.autograd.grad(out, leaves, grad_out)


def _path(case: KernelCase, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None) -> Tensor:
    """The engine's path for `case`: the blocked kernel with its tiles, or whatever `prefix_attention`
    takes."""
    from streambp_core.engine.attention import blocked
    from streambp_core.engine.attention.prefix import prefix_attention

    scale = q.shape[-1] ** -0.5
    if case.blocked:
        return blocked.BlockedFlashAttention.apply(q, k, v, scale, case.window, BLOCK_TOKENS_CHECKED, sinks)
    return prefix_attention(q, k, v, None, scale, "auto", case.window, sinks=sinks, softcap=case.softcap)


def _written_out(case: KernelCase, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None) -> Tensor:
    """Attention as a model file writes it: the chunk's queries are the last of the keys' positions, a
    causal (and windowed) mask, the soft cap on the scaled scores, the sinks as one more column of the
    softmax (in at least float32), dropped after it."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if case.softcap is not None:
        scores = case.softcap * torch.tanh(scores / case.softcap)
    query_at = torch.arange(case.keys - case.queries, case.keys, device=q.device)[:, None]
    key_at = torch.arange(case.keys, device=q.device)[None]
    allowed = key_at <= query_at
    if case.window is not None:
        allowed &= key_at > query_at - case.window
    scores = scores.to(at_least_float32(scores.dtype)).masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_column = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : case.keys].to(v.dtype)
    return probs @ v
