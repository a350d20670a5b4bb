"""What packing changes in a step's figures, for max-len and sweep to report beside an unpacked step's.

Peak memory: nothing, to a chunk's document mask. Every method keeps the same tensors per token for a
packed row as for an unpacked row of the same length (checkpoints, K/V, the head's chunks); what a packed
row adds is each chunk's (B, c, e) boolean document mask, built and dropped chunk by chunk.
Attention work: causal attention costs the sum of its documents' squared lengths instead of T^2 (per
row), so a kernel that skips other documents' keys (flash-attn's varlen kernel) does that fraction of the
unpacked row's attention FLOPs; the estimated time saved is the roofline's attention time of the unpacked
step (`step.estimate.roofline`) times 1 - fraction. Every figure here is labelled estimated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from streambp_core.engine.packing import attention_flops_fraction


@dataclass(frozen=True)
class PackedAttention:
    """Attention work of packed rows against an unpacked step of the same length."""

    seq_len_tokens: int
    documents: tuple[tuple[int, ...], ...]
    """Each row's document lengths."""
    attention_flops_fraction: float
    """Sum of the documents' squared lengths over rows x seq_len^2."""
    attention_ms: float | None = None
    """Estimated attention time of the unpacked step on the GPU model (None: no GPU model given)."""
    source: str = "estimated"

    @property
    def saved_ms(self) -> float | None:
        """Estimated attention time the packing saves (None without a GPU model)."""
        if self.attention_ms is None:
            return None
        return self.attention_ms * (1.0 - self.attention_flops_fraction)

    def to_dict(self) -> dict:
        """JSON entry, the saving included."""
        return {**asdict(self), "saved_ms": self.saved_ms}


def packed_attention(spec, documents: list[list[int]], gpu=None, model=None) -> PackedAttention:
    """`PackedAttention` of `spec` (a `StepSpec`) with rows packed from `documents`; with `gpu` (a
    `step.estimate.roofline.GpuModel`), the unpacked step's estimated attention time too. `model`: the spec's
    model resolved once (`step.parts.resolved.ResolvedModel`; None: resolved here)."""
    fraction = attention_flops_fraction(documents, spec.seq_len_tokens)
    attention_ms = None
    if gpu is not None:
        from streambp_core.step.estimate.step_estimate import estimate_step

        attention_ms = 1e3 * estimate_step(spec, gpu, model).attention_s
    return PackedAttention(spec.seq_len_tokens, tuple(map(tuple, documents)), fraction, attention_ms)
