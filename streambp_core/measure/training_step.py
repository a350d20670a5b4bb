"""A full training step (objective, LoRA, optimizer), simulated on meta tensors or measured for real.

`simulate_step` sizes backprop only (SFT, full parameters, no optimizer: the paper's Fig. 3). The
paper's Table 3 sizes a training step: an SFT, GRPO or DPO loss, full parameters or LoRA, and an AdamW
step. `TrainSpec` describes such a step and:

- `simulate_training_step(spec, seq_len)` runs it on the meta device under a `MemoryTracker` (with the
  optimizer, so its state and `step()` count as "optimizer"), at 2 and 3 decoder layers, extrapolated
  linearly to the model's depth exactly as `simulate_step` does;
- `measure_training_step(spec, seq_len, device)` runs it on real CPU/CUDA tensors: one tracked step for
  the peak (tracker on CPU, the allocator on CUDA), then untimed warm-up steps and timed repeats whose
  median is the step time.

Protocol of a step (same for both):
1. Model in `dtype` (bfloat16: pure-bf16 AdamW for full parameters); LoRA (`lora_rank` > 0) via peft on
   every linear layer, alpha 4 x rank; peft keeps the adapters in fp32 over the bf16 base.
2. Optimizer state exists before the step (a steady-state step: AdamW's two moments per trainable
   parameter); gradients do not (`zero_grad(set_to_none=True)` after every step). With optimizer "none"
   the gradients are resident before the step instead (a gradient-accumulation micro-step, like
   `simulate_step`).
3. Inputs: `sequences(spec)` rows of `seq_len` random tokens without padding; objective inputs from
   `streambp_core.batch.objective_inputs` (the first quarter of each row is the prompt for GRPO/DPO).
   GRPO: `batch_size` rows = one group of completions; DPO: `batch_size` pairs = 2 x batch_size rows
   (chosen rows, then rejected rows); reference log-probs are inputs (precomputed, no reference model).
4. `loss = run.loss(...)`, `loss.backward()`, `optimizer.step()`, `optimizer.zero_grad()`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from streambp_core.batch import objective_inputs, random_batch
from streambp_core.config import (
    ATTN_BACKENDS,
    OBJECTIVES,
    ConfigError,
    check_method,
    require_choice,
    require_positive,
)
from streambp_core.measure.fastmeta import SimulationMode, checkpoint_tags
from streambp_core.measure.probe import ProbeSpec, probe_from_simulation, simulated_probe
from streambp_core.measure.simulate import (
    KEEP_CHUNKS,
    SimResult,
    _as_dtype,
    _extrapolate,
    _largest,
    _phase_cuts,
    _with_depth,
)
from streambp_core.measure.tracker import MemoryTracker
from streambp_core.methods import prepare
from streambp_core.models.load import build_model, load_config
from streambp_core.models.lora import apply_lora
from streambp_core.optim import OPTIMIZERS, make_optimizer
from streambp_core.search import ProbeResult


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """Everything about a training step except its length."""

    model: str
    method: str
    objective: str = "sft"
    lora_rank: int = 0
    """0: full-parameter training; R > 0: LoRA adapters of rank R."""
    optimizer: str = "none"
    batch_size: int = 1
    """Sequences (sft), completions in the group (grpo) or chosen/rejected pairs (dpo)."""
    dtype: str = "bfloat16"
    partition_size: int = 500
    head_partition_size: int = 100
    seed: int = 0
    attn: str = "auto"
    """Attention kernel on CUDA (auto, sdpa, flash); simulation always uses the flash-like fake kernel."""

    def __post_init__(self) -> None:
        check_method(self.method)
        _as_dtype(self.dtype)
        require_choice("attn", self.attn, ATTN_BACKENDS)
        require_choice("objective", self.objective, OBJECTIVES)
        require_choice("optimizer", self.optimizer, OPTIMIZERS)
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ConfigError(f"lora rank must be 0 (off) or a positive integer, got {self.lora_rank!r}")
        for name in ("batch_size", "partition_size", "head_partition_size"):
            require_positive(name, getattr(self, name))

    @property
    def sequences(self) -> int:
        """Rows of the step's batch: 2 x batch_size for DPO (chosen + rejected), else batch_size."""
        return 2 * self.batch_size if self.objective == "dpo" else self.batch_size

    @property
    def grads(self) -> str:
        """'fresh' with an optimizer (its step sets the gradients to None), else 'resident' (protocol 2)."""
        return "resident" if self.optimizer == "none" else "fresh"


@dataclass(frozen=True, kw_only=True)
class MeasuredStep:
    """A real step: its peak (bytes), the breakdown at the peak, and the timed repeats (ms)."""

    peak_bytes: int
    peak_reserved_bytes: int | None
    breakdown_bytes: dict[str, int]
    step_times_ms: tuple[float, ...]
    alloc_retries: int | None = None
    """The CUDA allocator's `num_alloc_retries` over the tracked step; None off CUDA."""
    num_ooms: int | None = None
    """The CUDA allocator's `num_ooms` over the tracked step; None off CUDA."""

    @property
    def step_time_ms(self) -> float:
        """Median of the timed repeats."""
        return statistics.median(self.step_times_ms)


def build_training_model(
    spec: TrainSpec, device: str, config: PretrainedConfig | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
    """The (LoRA-wrapped) model and its optimizer with state initialised, or with resident grads."""
    config = load_config(spec.model) if config is None else config
    model = build_model(config, dtype=_as_dtype(spec.dtype), device=device, seed=spec.seed)
    if spec.lora_rank:
        model = apply_lora(model, spec.lora_rank)
    optimizer = make_optimizer(model, spec.optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for param in trainable:
        param.grad = torch.zeros_like(param)
    if optimizer is not None:
        optimizer.step()  # creates the AdamW moments (zero grads: the weights stay as they are)
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def step_inputs(spec: TrainSpec, vocab_size: int, seq_len: int, device: str) -> dict:
    """Keyword arguments of `run.loss` for one step of `spec` (random tokens, no padding)."""
    batch = random_batch(
        vocab_size=vocab_size, seq_len=seq_len, batch_size=spec.sequences, seed=spec.seed + 1, device="cpu"
    )
    labels, extra = objective_inputs(spec.objective, batch, spec.seed)
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in extra.items()}
    return {"input_ids": batch.input_ids.to(device), "labels": labels.to(device), **moved}


def training_step(run, optimizer: torch.optim.Optimizer | None, inputs: dict) -> torch.Tensor:
    """Forward, backward and (if any) optimizer step; returns the detached loss."""
    loss = run.loss(**inputs)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _run_options(spec: TrainSpec) -> dict:
    return {
        "objective": spec.objective,
        "partition_size": spec.partition_size,
        "head_partition_size": spec.head_partition_size,
        "baseline_attention": "engine",
        "attn": spec.attn,
    }


def _tracked_step(model, optimizer, spec, inputs, device, vocab_size, cache=None, fast=False):
    """One step under the tracker; returns the tracker's result (peak over the whole step)."""
    run = prepare(model, spec.method, **_run_options(spec))
    try:
        with MemoryTracker(model, optimizer, device=device) as tracker:
            fast_mode = SimulationMode(vocab_size, cache, tracker) if fast else nullcontext()
            with fast_mode, checkpoint_tags(model, tracker) as forward:
                loss = run.loss(**inputs)
                forward.done = True
                loss.backward()
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
    finally:
        run.close()
    return tracker.result()


def _peaks_at_depth(spec: TrainSpec, config: PretrainedConfig, seq_len: int, cache: dict) -> list:
    """Per phase, (peak bytes, bytes by category) of one simulated step of `config`.

    Phases as `simulate_step`'s (forward; backward to the embedding's output gradient; the rest of the
    backward), plus the optimizer step, so each is extrapolated in depth on its own.
    """
    model, optimizer = build_training_model(spec, "meta", config)
    inputs = step_inputs(spec, config.vocab_size, seq_len, "meta")
    run = prepare(model, spec.method, keep_chunks=KEEP_CHUNKS, **_run_options(spec))
    try:
        with MemoryTracker(model, optimizer, device="meta") as tracker:
            with (
                SimulationMode(config.vocab_size, cache, tracker),
                checkpoint_tags(model, tracker) as forward,
                _phase_cuts(model, tracker) as phases,
            ):
                loss = run.loss(**inputs)
                forward.done = True
                phases.cut()
                loss.backward()
                phases.cut()
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    phases.cut()
    finally:
        run.close()
    return phases.peaks


def simulate_training_step(spec: TrainSpec, seq_len: int, cache: dict | None = None) -> SimResult:
    """Peak memory of one training step of `spec` at `seq_len` tokens, simulated on meta tensors.

    Steps: load the config; simulate at 2 and 3 decoder layers (full depth for models of <= 3 layers),
    cutting the step into phases; extrapolate each phase's peak and categories linearly in depth; the
    highest phase is the step's peak (as `simulate_step` does).
    """
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ConfigError(f"seq_len must be an integer >= 2, got {seq_len!r}")
    config = load_config(spec.model)
    total = config.num_hidden_layers
    depths = (total,) if total <= 3 else (2, 3)
    cache = {} if cache is None else cache
    measured = [_peaks_at_depth(spec, _with_depth(config, n), seq_len, cache) for n in depths]
    if len(depths) == 1:
        peak, by_category = _largest(measured[0])
    else:
        peak, by_category = _extrapolate(measured[0], measured[1], total)
    return SimResult(
        model=spec.model,
        method=spec.method,
        seq_len_tokens=seq_len,
        batch_size=spec.sequences,
        dtype=spec.dtype,
        num_layers=total,
        layers_simulated=depths,
        peak_bytes=peak,
        breakdown_bytes=by_category,
    )


def measure_training_step(
    spec: TrainSpec, seq_len: int, device: str, *, warmup: int = 1, repeats: int = 3
) -> MeasuredStep:
    """A real step on `device` ('cpu' or 'cuda'): tracked peak, then `repeats` timed steps (median).

    The timed steps run without the tracker, after `warmup` untimed ones; CUDA is synchronised around
    each. On CUDA the peak is the allocator's after a reset (`max_memory_allocated`, read by the tracker),
    with its reserved peak, alloc retries and OOM count over the tracked step.
    """
    config = load_config(spec.model)
    model, optimizer = build_training_model(spec, device, config)
    inputs = step_inputs(spec, config.vocab_size, seq_len, device)
    result = _tracked_step(model, optimizer, spec, inputs, device, config.vocab_size)
    peak = result.peak_bytes if result.cuda_peak_allocated_bytes is None else result.cuda_peak_allocated_bytes
    times = []
    with prepare(model, spec.method, **_run_options(spec)) as run:
        for index in range(warmup + repeats):
            _sync(device)
            start = time.perf_counter()
            training_step(run, optimizer, inputs)
            _sync(device)
            if index >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
            for param in model.parameters():
                param.grad = None
    return MeasuredStep(
        peak_bytes=peak,
        peak_reserved_bytes=result.cuda_peak_reserved_bytes,
        breakdown_bytes=dict(result.peak_breakdown_bytes),
        step_times_ms=tuple(times),
        alloc_retries=result.cuda_num_alloc_retries,
        num_ooms=result.cuda_num_ooms,
    )


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def simulated_training_probe(spec: TrainSpec) -> Callable[[int], ProbeResult]:
    """probe(seq_len) -> ProbeResult for `max_trainable_length`: the simulated peak of one step of
    `spec` (plain SFT backprop goes through `simulate_step`, as `simulated_probe` does)."""
    if (spec.objective, spec.lora_rank, spec.optimizer) == ("sft", 0, "none"):
        sizes = {"partition_size": spec.partition_size, "head_partition_size": spec.head_partition_size}
        return simulated_probe(
            ProbeSpec(
                model=spec.model, method=spec.method, batch_size=spec.batch_size, dtype=spec.dtype, **sizes
            )
        )
    return probe_from_simulation(lambda seq_len, cache: simulate_training_step(spec, seq_len, cache))
