"""Probes for the max-length search: one training step at a given length -> its peak, or OOM.

- `simulated_probe`: `simulate_step` on meta tensors (source "simulated").
- `cpu_probe`: a real step on CPU tensors measured by the tracker (source "measured-cpu"); it refuses a
  length whose simulated peak plus the CPU attention kernel's workspace exceeds the RAM available.
- `cuda_probe`: a real step on the GPU, each in a child process (`python -m streambp_core.measure.probe`)
  so that a failed probe cannot leave fragments or a broken context behind for the next; the child
  caps the caching allocator at the budget, and reports the allocator's peak after a reset (source
  "measured-cuda") or "oom".
Every measured step uses the same code as the simulated one (`baseline_attention="engine"`), with random
token ids, no padding, and the tracker's categories.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from streambp_core.config import (
    ATTN_BACKENDS,
    GRADS_MODES,
    check_method,
    require_choice,
    require_positive,
)
from streambp_core.measure.cuda import is_oom
from streambp_core.measure.fastmeta import SimulationMode, checkpoint_tags
from streambp_core.measure.protocol import check_protocol, step_protocol
from streambp_core.measure.result import TrackerResult
from streambp_core.measure.simulate import SimResult, _as_dtype, simulate_step
from streambp_core.measure.tracker import MemoryTracker
from streambp_core.methods import prepare
from streambp_core.models.load import build_model, load_config
from streambp_core.search import OK, OOM, REFUSED, ProbeResult, SearchResult, max_trainable_length

CPU_RAM_FRACTION = 0.8
"""A CPU probe may use at most this fraction of the RAM available when the search starts."""


@dataclass(frozen=True, kw_only=True)
class ProbeSpec:
    """Everything about a step except its length."""

    model: str
    method: str
    batch_size: int = 1
    dtype: str = "bfloat16"
    partition_size: int = 500
    head_partition_size: int = 100
    grads: str = "resident"
    protocol: str = "default"
    seed: int = 0
    attn: str = "auto"
    """Attention kernel on CUDA (auto, sdpa, flash); simulation always uses the flash-like fake kernel."""

    def __post_init__(self) -> None:
        check_method(self.method)
        require_choice("attn", self.attn, ATTN_BACKENDS)
        _as_dtype(self.dtype)
        check_protocol(self.protocol)
        require_choice("grads", self.grads, GRADS_MODES)
        for name in ("batch_size", "partition_size", "head_partition_size"):
            require_positive(name, getattr(self, name))

    def build(self, device: str) -> torch.nn.Module:
        """The model with random (seeded) weights on `device`."""
        return build_model(self.model, dtype=_as_dtype(self.dtype), device=device, seed=self.seed)

    def simulate(self, seq_len: int, cache: dict | None = None, depth: str = "extrapolate"):
        """`simulate_step` with these settings."""
        return simulate_step(
            self.model,
            self.method,
            seq_len,
            batch_size=self.batch_size,
            dtype=self.dtype,
            partition_size=self.partition_size,
            head_partition_size=self.head_partition_size,
            grads=self.grads,
            protocol=self.protocol,
            depth=depth,
            cache=cache,
        )


def simulated_probe(spec: ProbeSpec, depth: str = "extrapolate") -> Callable[[int], ProbeResult]:
    """probe(seq_len) -> the simulated peak (one memo shared by all of this probe's steps)."""
    return probe_from_simulation(lambda seq_len, cache: spec.simulate(seq_len, cache, depth))


def probe_from_simulation(simulate: Callable[[int, dict], SimResult]) -> Callable[[int], ProbeResult]:
    """probe(seq_len) from `simulate(seq_len, cache)`, with one memo shared by all of its steps."""
    cache: dict = {}

    def probe(seq_len: int) -> ProbeResult:
        sim = simulate(seq_len, cache)
        return ProbeResult(
            seq_len_tokens=seq_len,
            status=OK,
            peak_bytes=sim.peak_bytes,
            breakdown_bytes=sim.breakdown_bytes,
            source="simulated",
            message=sim.how,
        )

    return probe


def simulated_max_len(
    spec: ProbeSpec, budget_bytes: int, on_probe: Callable[[ProbeResult, int, int | None], None] | None = None
) -> SearchResult:
    """Max length by simulation, the fitting end of its bracket re-checked at full depth.

    Steps: search with depth-extrapolated probes (cheap: 2 and 3 layers); simulate the bracket's fitting
    end with every layer; if it fits, keep the bracket with that exact probe; if not, search again
    with full-depth probes from there. Why only that end: every phase's peak is affine in depth, so the
    step's peak (their maximum) is convex in depth and extrapolating it from 2 and 3 layers can only
    under-estimate (when the highest phase changes with depth); a length that fails extrapolated fails
    at full depth too, but a length that fits extrapolated must be checked. The result lists every probe.
    """
    guide = max_trainable_length(simulated_probe(spec), budget_bytes, on_probe=on_probe)
    if load_config(spec.model).num_hidden_layers <= 3 or guide.peak_at_max is None:
        return guide  # simulated at full depth already, or nothing fits even extrapolated
    full_probe = simulated_probe(spec, "full")
    check = full_probe(guide.max_len_tokens)
    if on_probe is not None:
        on_probe(check, guide.max_len_tokens if check.fits(budget_bytes) else 0, guide.bracket[1])
    if check.fits(budget_bytes):
        return replace(guide, peak_at_max=check, probes=[*guide.probes, check])
    full = max_trainable_length(full_probe, budget_bytes, start=guide.max_len_tokens, on_probe=on_probe)
    return replace(full, probes=[*guide.probes, check, *full.probes])


def cpu_probe(spec: ProbeSpec, available_bytes: int | None = None) -> Callable[[int], ProbeResult]:
    """probe(seq_len) -> the tracker's peak of a real step on CPU, or 'refused' when RAM is short."""
    ram = available_ram_bytes() if available_bytes is None else available_bytes
    state: dict = {}

    def probe(seq_len: int) -> ProbeResult:
        need = spec.simulate(seq_len).peak_bytes + cpu_attention_workspace_bytes(spec, seq_len)
        if need > CPU_RAM_FRACTION * ram:
            return ProbeResult(
                seq_len_tokens=seq_len,
                status=REFUSED,
                source="measured-cpu",
                message=f"needs ~{need / 2**30:.1f} GiB of RAM (simulated peak + attention workspace); "
                f"{ram / 2**30:.1f} GiB available, probes use at most {CPU_RAM_FRACTION:.0%}",
            )
        if "model" not in state:
            state["model"] = spec.build("cpu")
        return measure_step(state["model"], spec, seq_len, "cpu")

    return probe


def cuda_probe(spec: ProbeSpec, budget_bytes: int, timeout_s: float = 1800) -> Callable[[int], ProbeResult]:
    """probe(seq_len) -> a measured step in a fresh child process on the GPU (see module docstring)."""

    def probe(seq_len: int) -> ProbeResult:
        command = [
            sys.executable,
            "-m",
            "streambp_core.measure.probe",
            "--spec",
            json.dumps(asdict(spec)),
            "--seq-len",
            str(seq_len),
            "--device",
            "cuda",
            "--budget-bytes",
            str(budget_bytes),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        return parse_child_output(seq_len, done.returncode, done.stdout, done.stderr)

    return probe


def parse_child_output(seq_len: int, returncode: int, stdout: str, stderr: str) -> ProbeResult:
    """The child's JSON line as a ProbeResult; a child killed by OOM is 'oom'; other failures raise."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if lines:
        return ProbeResult(**json.loads(lines[-1]))
    tail = " ".join(stderr.split())[-300:]
    if "out of memory" in stderr.lower() or returncode in (-9, 137):
        return ProbeResult(seq_len_tokens=seq_len, status=OOM, source="measured-cuda", message=tail)
    raise RuntimeError(f"probe at {seq_len} tokens failed (exit {returncode}): {tail}")


def measure_step(model: torch.nn.Module, spec: ProbeSpec, seq_len: int, device: str) -> ProbeResult:
    """One tracked step of `spec.method` on a real `model`; an OOM becomes status 'oom'.

    The peak is the tracker's (CPU) or the caching allocator's (CUDA); on CUDA the allocator's reserved
    peak, alloc retries and OOM count over the step come with it, also for an OOM.
    """
    source = f"measured-{device}"
    for param in model.parameters():
        param.grad = torch.zeros_like(param) if spec.grads == "resident" and param.requires_grad else None
    generator = torch.Generator().manual_seed(spec.seed)
    input_ids = torch.randint(model.config.vocab_size, (spec.batch_size, seq_len), generator=generator)
    run = prepare(
        model,
        spec.method,
        partition_size=spec.partition_size,
        head_partition_size=spec.head_partition_size,
        baseline_attention="engine",
        attn=spec.attn,
    )
    tracker = MemoryTracker(model, device=device)
    try:
        with step_protocol(run, spec.protocol), tracker:
            _tracked_step(model, run, input_ids.to(device), tracker)
    except Exception as exc:
        if not is_oom(exc):
            raise
        message = str(exc).split("\n")[0]
        counters = _allocator_figures(tracker.result())
        return ProbeResult(seq_len_tokens=seq_len, status=OOM, source=source, message=message, **counters)
    finally:
        run.close()
        for param in model.parameters():
            param.grad = None
    result = tracker.result()
    return ProbeResult(
        seq_len_tokens=seq_len,
        status=OK,
        peak_bytes=result.cuda_peak_allocated_bytes if device == "cuda" else result.peak_bytes,
        breakdown_bytes=dict(result.peak_breakdown_bytes),
        source=source,
        **_allocator_figures(result),
    )


def _tracked_step(model: torch.nn.Module, run, input_ids: torch.Tensor, tracker: MemoryTracker) -> None:
    """Forward and backward inside an active `tracker`, checkpoints tagged, logits sized fast."""
    with SimulationMode(model.config.vocab_size, tracker=tracker), checkpoint_tags(model, tracker) as forward:
        loss = run.loss(input_ids)
        forward.done = True
        loss.backward()


def _allocator_figures(result: TrackerResult) -> dict[str, int | None]:
    """The CUDA allocator's reserved peak, alloc retries and OOM count (None each without CUDA)."""
    return {
        "peak_reserved_bytes": result.cuda_peak_reserved_bytes,
        "alloc_retries": result.cuda_num_alloc_retries,
        "num_ooms": result.cuda_num_ooms,
    }


def cpu_attention_workspace_bytes(spec: ProbeSpec, seq_len: int) -> int:
    """RAM the engine's exact CPU attention kernel uses inside itself (the tracker sees only its outputs):
    float32 scores, probabilities and their gradient, (batch, heads, query chunk, seq_len) each."""
    config = load_config(spec.model)
    queries = spec.partition_size if spec.method == "streambp" else seq_len
    return 3 * 4 * spec.batch_size * config.num_attention_heads * min(queries, seq_len) * seq_len


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo, else physical pages available (sysconf)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _child_main(argv: list[str] | None = None) -> int:
    """Child-process entry: measure one step and print its ProbeResult as one JSON line."""
    parser = argparse.ArgumentParser(description="One measured max-length probe (used by cuda_probe).")
    parser.add_argument("--spec", required=True, help="ProbeSpec as JSON")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budget-bytes", type=int, default=0, help="cap the CUDA caching allocator here")
    args = parser.parse_args(argv)
    spec = ProbeSpec(**json.loads(args.spec))
    if args.device == "cuda" and args.budget_bytes:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_bytes / total))
    try:
        model = spec.build(args.device)
        result = measure_step(model, spec, args.seq_len, args.device)
    except Exception as exc:
        if not is_oom(exc):
            raise
        result = ProbeResult(
            seq_len_tokens=args.seq_len,
            status=OOM,
            source=f"measured-{args.device}",
            message=str(exc).split("\n")[0],
        )
    print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
