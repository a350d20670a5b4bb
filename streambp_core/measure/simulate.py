"""Predict a training step's peak GPU memory on a CPU: run the real step on meta tensors, tracked.

`simulate_step` builds the model on the meta device (weights are never materialised), prepares it with
`streambp_core.prepare` exactly as a GPU run would, runs `run.loss(...)` and `loss.backward()` under a
`MemoryTracker`, and returns the peak bytes and the breakdown by category at the peak.

Protocol (the paper's Fig. 3): weights and gradients in `dtype` (bfloat16), batch 1, gradients already
allocated (`grads="resident"`: a zero `.grad` for every trainable parameter exists before the step, as in
a gradient-accumulation micro-step); `grads="fresh"` starts without them. No optimizer state. Attention
allocates what flash attention allocates (output and float32 log-sum-exp: the engine's custom op).

Categories at the peak: weights, grads, optimizer (always 0 here), checkpoints (layer inputs kept from
forward for backward: StreamBP's `H_in`, and for the baselines the embedding and decoder-layer outputs,
which transformers' checkpointing keeps), kv (StreamBP's per-layer K/V and their gradients), logits (any
tensor whose last dimension is the vocabulary and that has a token dimension: lm_head output, its
float32 copy, log-softmax, their gradients), temporaries (everything else; for `plain` that includes
every activation autograd saves, K/V included, since transformers does not tag them).

Speed (what makes `streambp-bench max-len` run in seconds):
- Depth: decoder layers are identical, so by default the step is simulated with 2 and 3 layers and each
  phase's figures are extrapolated linearly, f(L) = f(2) + (L - 2) * (f(3) - f(2)) (see `_extrapolate`);
  exact to the byte against a full-depth simulation in the tests (`depth="full"` simulates every
  layer). `probe.simulated_max_len` re-checks a max-length bracket at full depth.
- Chunk loops: every engine chunk loop (`engine.chunks.chunk_bounds`) runs only its first and last
  `KEEP_CHUNKS` (4) chunks: chunks differ only in position, what outlives a chunk is preallocated, and
  a chunk's memory grows with its prefix. 4 because a chunk can peak while what the previous one left
  is still held and the backward's first chunk is partial (when the backward still concatenated each
  chunk's K/V prefix, 2 missed Qwen3-8B at 40k tokens by 3.1 MiB and 3 was the least that did not).
  Equal to all chunks to the byte in the tests (`thin_chunks=False`). Passed to the run as
  `StreamConfig.keep_chunks` (meta device only), so nothing outside this step is thinned.
- Meta kernels: `fastmeta.SimulationMode` memoises their output metadata.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from streambp_core.config import GRADS_MODES, ConfigError, check_method, require_choice
from streambp_core.measure.breakdown import Breakdown
from streambp_core.measure.fastmeta import SimulationMode, checkpoint_tags
from streambp_core.measure.protocol import check_protocol, step_protocol
from streambp_core.measure.tags import CATEGORIES
from streambp_core.measure.tracker import MemoryTracker
from streambp_core.measure.units import bytes_to_gib
from streambp_core.methods import prepare
from streambp_core.models.adapters import decoder_parts
from streambp_core.models.load import build_model, load_config

KEEP_CHUNKS = 4
"""Chunks kept at each end of an engine chunk loop when thinning."""

@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Peak memory of one simulated training step (GiB = 2**30 bytes)."""

    model: str
    method: str
    seq_len_tokens: int
    batch_size: int
    dtype: str
    num_layers: int
    """Decoder layers of the model the figures are for."""
    layers_simulated: tuple[int, ...]
    """Depths actually simulated: (2, 3) when extrapolated, (num_layers,) otherwise."""
    peak_bytes: int
    breakdown_bytes: dict[str, int]
    """Bytes per category at the peak; they sum to `peak_bytes`."""
    protocol: str = "default"
    source: str = "simulated"

    @property
    def peak_gib(self) -> float:
        return bytes_to_gib(self.peak_bytes)

    @property
    def breakdown(self) -> Breakdown:
        return Breakdown.from_bytes(self.breakdown_bytes)

    @property
    def how(self) -> str:
        """How the figures were obtained, in words."""
        if len(self.layers_simulated) == 1:
            return f"simulated on meta tensors, all {self.num_layers} layers"
        a, b = self.layers_simulated
        return f"simulated on meta tensors with {a} and {b} layers, extrapolated to {self.num_layers}"


def simulate_step(
    model: str | PretrainedConfig,
    method: str,
    seq_len: int,
    *,
    batch_size: int = 1,
    dtype: torch.dtype | str = torch.bfloat16,
    partition_size: int = 500,
    head_partition_size: int = 100,
    grads: str = "resident",
    depth: str = "extrapolate",
    protocol: str = "default",
    thin_chunks: bool = True,
    cache: dict | None = None,
) -> SimResult:
    """Simulate one training step of `method` on `model` (preset name, directory or config).

    Steps: load the config; check the arguments; simulate at 2 and 3 layers (or at full depth when
    `depth="full"` or the model has at most 3 layers); extrapolate each category linearly in depth.
    `protocol`: "default" (this project's step) or "paper" (the paper's script; see `protocol.py`).
    `cache` is a `SimulationMode` memo to reuse across calls (e.g. one per max-length search).
    Raises ConfigError on bad input.
    """
    config = load_config(model) if isinstance(model, str) else model
    name = model if isinstance(model, str) else str(getattr(config, "_name_or_path", "") or config.model_type)
    torch_dtype = _as_dtype(dtype)
    _check(method, seq_len, batch_size, grads, depth)
    check_protocol(protocol)
    total = config.num_hidden_layers
    depths = (total,) if depth == "full" or total <= 3 else (2, 3)
    cache = {} if cache is None else cache
    step = dict(
        method=method,
        seq_len=seq_len,
        batch_size=batch_size,
        dtype=torch_dtype,
        grads=grads,
        protocol=protocol,
        thin=thin_chunks,
        cache=cache,
        partition_size=partition_size,
        head_partition_size=head_partition_size,
    )
    measured = [_peak_at_depth(_with_depth(config, n), **step) for n in depths]
    if len(depths) == 1:
        peak, by_category = _largest(measured[0])
    else:
        peak, by_category = _extrapolate(measured[0], measured[1], total)
        if min(by_category.values()) < 0:  # the peak moved between sub-phases: simulate every layer
            peak, by_category = _largest(_peak_at_depth(config, **step))
            depths = (total,)
    return SimResult(
        model=name,
        method=method,
        seq_len_tokens=seq_len,
        batch_size=batch_size,
        dtype=str(torch_dtype).removeprefix("torch."),
        num_layers=total,
        layers_simulated=depths,
        peak_bytes=peak,
        breakdown_bytes=by_category,
        protocol=protocol,
    )


def weights_and_grads_bytes(model: str | PretrainedConfig, dtype: torch.dtype | str = torch.bfloat16) -> int:
    """Bytes of the weights plus one gradient per trainable parameter, counted on the meta device."""
    config = load_config(model) if isinstance(model, str) else model
    meta_model = build_model(config, dtype=_as_dtype(dtype), device="meta")
    params = list(meta_model.parameters())
    return sum(p.nbytes for p in params) + sum(p.nbytes for p in params if p.requires_grad)


def _largest(phases: list[tuple[int, dict[str, int]]]) -> tuple[int, dict[str, int]]:
    """The phase with the highest peak."""
    return max(phases, key=lambda phase: phase[0])


def _extrapolate(two: list, three: list, total: int) -> tuple[int, dict[str, int]]:
    """Each phase's peak and breakdown extrapolated linearly from 2 and 3 layers; the highest wins.

    Phases (see `_peak_at_depth`) keep the same shape at every depth, so within a phase the peak is
    affine in depth; across phases it is not (a shallow model may peak in the embedding's backward, a
    deep one while its checkpoints are alive), which is why phases are extrapolated separately.
    """
    phases = []
    for (p2, c2), (p3, c3) in zip(two, three, strict=True):
        grown = {k: c2[k] + (total - 2) * (c3[k] - c2[k]) for k in CATEGORIES}
        phases.append((p2 + (total - 2) * (p3 - p2), grown))
    return _largest(phases)


def _peak_at_depth(config, *, method, seq_len, batch_size, dtype, grads, protocol, thin, cache, **options):
    """Per phase, (peak bytes, bytes by category at that peak) of one simulated step of `config`.

    Phases: the forward; the backward down to the embedding's output gradient; the rest (the embedding's
    backward, whose dense vocab x hidden gradient does not grow with depth).
    """
    model = build_model(config, dtype=dtype, device="meta")
    if grads == "resident":
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    input_ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    run = prepare(model, method, keep_chunks=KEEP_CHUNKS if thin else None, **options)
    try:
        with step_protocol(run, protocol):
            with MemoryTracker(model, device="meta") as tracker:
                with (
                    SimulationMode(config.vocab_size, cache, tracker),
                    checkpoint_tags(model, tracker) as forward,
                    _phase_cuts(model, tracker) as phases,
                ):
                    loss = run.loss(input_ids)
                    forward.done = True
                    phases.cut()
                    loss.backward()
                    phases.cut()
    finally:
        run.close()
    return phases.peaks


class _Phases:
    """Peaks of consecutive phases of a tracked step: `cut()` closes one and starts the next."""

    def __init__(self, tracker: MemoryTracker) -> None:
        self.tracker = tracker
        self.peaks: list[tuple[int, dict[str, int]]] = []

    def cut(self, *_args) -> None:
        result = self.tracker.result()
        self.peaks.append((result.peak_bytes, dict(result.peak_breakdown_bytes)))
        self.tracker.reset_peak()


@contextmanager
def _phase_cuts(model, tracker: MemoryTracker) -> Iterator[_Phases]:
    """Cut a phase when the gradient of the embedding's output arrives (see `_peak_at_depth`)."""
    phases = _Phases(tracker)

    def on_embedding(module, inputs, output) -> None:
        if output.requires_grad:
            output.register_hook(phases.cut)

    handle = decoder_parts(model).embed.register_forward_hook(on_embedding)
    try:
        yield phases
    finally:
        handle.remove()


def _with_depth(config: PretrainedConfig, num_layers: int) -> PretrainedConfig:
    """A copy of `config` with `num_layers` decoder layers (per-layer lists truncated to match)."""
    if num_layers == config.num_hidden_layers:
        return config
    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = num_layers
    if isinstance(getattr(shallow, "layer_types", None), list):
        shallow.layer_types = shallow.layer_types[:num_layers]
    return shallow


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(f"unknown dtype {dtype!r}; use bfloat16, float16, float32 or float64")
    return value


def _check(method: str, seq_len: int, batch_size: int, grads: str, depth: str) -> None:
    check_method(method)
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ConfigError(f"seq_len must be an integer >= 2, got {seq_len!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    require_choice("grads", grads, GRADS_MODES)
    if depth not in ("extrapolate", "full"):
        raise ConfigError(f"depth must be 'extrapolate' or 'full', got {depth!r}")
