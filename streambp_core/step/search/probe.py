"""Probes for the max-length search, and the search itself: one step at a length -> its peak, or OOM.

- `simulated_probe`: `simulate` on meta tensors (source "simulated"), at extrapolated or full depth.
- `cpu_probe`: a real step on CPU tensors measured by the tracker (source "measured-cpu"); it refuses a
  length whose simulated peak plus the CPU attention kernel's workspace exceeds the RAM available.
- `cuda_probe`: a real step on the GPU, each in a child process (`python -m streambp_core.step.search.probe`)
  so that a failed probe cannot leave fragments or a broken context behind for the next; the child caps
  the caching allocator at the budget and reports the allocator's peak (source "measured-cuda") or "oom".
- `max_len(spec, budget_bytes, device)`: `search.guided_max_len` over them: guided by the extrapolated
  simulation, then refined by measurement (cpu, cuda) or confirmed at full depth (sim).
Every measured step is the simulated one (`run.tracked_step`) on real tensors, random ids, no padding.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict

import torch
from transformers import PretrainedConfig

from streambp_core.config import SOURCES, ConfigError, StepSpec, simulated_ranks_problem
from streambp_core.measure import host_ram
from streambp_core.measure.cuda import is_oom, oom_pool
from streambp_core.registry import method_class
from streambp_core.search import (
    HOST_PINNED_POOL,
    OK,
    OOM,
    REFUSED,
    ProbeResult,
    SearchResult,
    guided_max_len,
)
from streambp_core.step.parts.resolved import ResolvedModel, resolved
from streambp_core.step.run.setup import Setup, build_setup, build_training_model
from streambp_core.step.run.tracked import StepOutOfMemory, tracked_step
from streambp_core.step.simulation.simulate import simulate

CPU_RAM_FRACTION = 0.8
"""A CPU probe may use at most this fraction of the RAM available when the search starts."""

Probe = Callable[[int], ProbeResult]


def simulated_probe(spec: StepSpec, model: ResolvedModel, *, depth: str = "extrapolate") -> Probe:
    """probe(seq_len) -> the simulated peak of `spec` at that length (`model`'s memo shared by its steps)."""

    def probe(seq_len: int) -> ProbeResult:
        sim = simulate(spec.at(seq_len), model, depth=depth)
        return ProbeResult(seq_len_tokens=seq_len, status=OK, peak_bytes=sim.peak_bytes,
                           breakdown_bytes=sim.breakdown_bytes, source="simulated", message=sim.how,
                           host_peak_bytes=sim.host_peak_bytes, to_host_bytes=sim.to_host_bytes,
                           to_device_bytes=sim.to_device_bytes)

    return probe


def measure_setup(setup: Setup, device: str) -> ProbeResult:
    """One tracked step of `setup` on real tensors; an OOM becomes status 'oom' naming its pool (with the
    allocator's figures on CUDA when the step had begun; before it, e.g. pinning the params tier's weights
    while preparing, without), any other failure propagates."""
    source = SOURCES[device]
    try:
        record = tracked_step(setup, device)
    except StepOutOfMemory as exc:
        return ProbeResult(seq_len_tokens=setup.spec.seq_len_tokens, status=OOM, source=source,
                           message=str(exc), oom_pool=oom_pool(exc.__cause__ or exc),
                           **exc.record.cuda_figures())
    except Exception as exc:
        if not is_oom(exc):
            raise
        return ProbeResult(seq_len_tokens=setup.spec.seq_len_tokens, status=OOM, source=source,
                           message=str(exc).split("\n")[0], oom_pool=oom_pool(exc))
    finally:
        for param in setup.model.parameters():
            param.grad = None
    return ProbeResult(seq_len_tokens=setup.spec.seq_len_tokens, status=OK, peak_bytes=record.peak_bytes,
                       breakdown_bytes=record.breakdown_bytes, source=source, **record.cuda_figures(),
                       **record.host_figures())


def cpu_probe(spec: StepSpec, model: ResolvedModel, available_bytes: int | None = None) -> Probe:
    """probe(seq_len) -> the tracker's peak of a real step on CPU, or 'refused' when RAM is short (the
    model is built once, on the first probe that runs)."""
    ram = host_ram.available_ram_bytes() if available_bytes is None else available_bytes
    built: list = []

    def probe(seq_len: int) -> ProbeResult:
        refusal = cpu_ram_refusal(spec.at(seq_len), model, ram)
        if refusal is not None:
            return ProbeResult(seq_len_tokens=seq_len, status=REFUSED, source="measured-cpu", message=refusal)
        if not built:
            built.extend(build_training_model(spec, model.config, "cpu"))
        network, optimizer = built
        return measure_setup(build_setup(spec.at(seq_len), model.config, "cpu", model=network,
                                         optimizer=optimizer), "cpu")

    return probe


def cpu_ram_refusal(spec: StepSpec, model: ResolvedModel, available_bytes: int | None = None
                    ) -> str | None:
    """Why a real CPU step of `spec` must not run (its simulated peak plus the attention workspace is over
    CPU_RAM_FRACTION of the RAM available: it would allocate until the machine dies), or None."""
    ram = host_ram.available_ram_bytes() if available_bytes is None else available_bytes
    need = simulate(spec, model).peak_bytes + cpu_attention_workspace_bytes(spec, model.config)
    if need <= CPU_RAM_FRACTION * ram:
        return None
    return (f"needs ~{need / 2**30:.1f} GiB of RAM (simulated peak + attention workspace); "
            f"{ram / 2**30:.1f} GiB available, a CPU step uses at most {CPU_RAM_FRACTION:.0%}")


def cuda_probe(spec: StepSpec, budget_bytes: int, timeout_s: float = 1800) -> Probe:
    """probe(seq_len) -> a measured step in a fresh child process on the GPU (see module docstring)."""

    def probe(seq_len: int) -> ProbeResult:
        command = [sys.executable, "-m", "streambp_core.step.search.probe", "--spec",
                   json.dumps(spec.at(seq_len).to_dict()), "--device", "cuda",
                   "--budget-bytes", str(budget_bytes)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        return parse_child_output(seq_len, done.returncode, done.stdout, done.stderr)

    return probe


def max_len(
    spec: StepSpec,
    budget_bytes: int,
    device: str,
    model: ResolvedModel | None = None,
    *,
    on_probe: Callable[[ProbeResult, int, int | None], None] | None = None,
    host_budget_bytes: int | None = None,
) -> SearchResult:
    """The longest `spec.seq_len_tokens` whose step fits in `budget_bytes` (and its host pool in
    `host_budget_bytes`, when given) on `device` ('sim', 'cpu' or 'cuda'): guided by the extrapolated
    simulation, confirmed at full depth (sim) or refined by measurement (cpu, cuda); the result says at
    what depth the answer was confirmed. `model`: the spec's model resolved once (None: resolved here)."""
    problem = simulated_ranks_problem(device, gpus=spec.gpus, sp=spec.sp, shard=spec.shard)
    if problem is not None:
        raise ConfigError(problem)
    model = resolved(spec.model, model)
    guide = simulated_probe(spec, model)
    layers = model.num_layers
    if device == "sim":
        confirm = None if layers <= 3 else simulated_probe(spec, model, depth="full")
        return guided_max_len(guide, budget_bytes, confirm=confirm, confirmed_layers=layers,
                              on_probe=on_probe, host_budget_bytes=host_budget_bytes,
                              confirm_both_ends=spec.shard != "none", oom_pool=oom_pool)
    refine = cuda_probe(spec, budget_bytes) if device == "cuda" else cpu_probe(spec, model)
    return guided_max_len(guide, budget_bytes, refine=refine, confirmed_layers=layers, on_probe=on_probe,
                          host_budget_bytes=host_budget_bytes, oom_pool=oom_pool)


def parse_child_output(seq_len: int, returncode: int, stdout: str, stderr: str) -> ProbeResult:
    """The child's JSON line as a ProbeResult; a child that died out of memory is 'oom': killed by the
    kernel (out of host memory), out of pinned host memory ('host pinned', `PinnedHostOutOfMemory`'s
    message), out of device memory; other failures raise."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if lines:
        return ProbeResult(**json.loads(lines[-1]))
    tail = " ".join(stderr.split())[-300:]
    if "out of memory" in stderr.lower() or returncode in (-9, 137):
        return ProbeResult(seq_len_tokens=seq_len, status=OOM, source="measured-cuda", message=tail,
                           oom_pool=_child_oom_pool(returncode, stderr))
    raise RuntimeError(f"probe at {seq_len} tokens failed (exit {returncode}): {tail}")


def _child_oom_pool(returncode: int, stderr: str) -> str:
    """The pool a child that died out of memory ran out of, from how it died and what it wrote."""
    if returncode in (-9, 137):  # killed by the kernel's OOM killer
        return "host"
    if f"pool '{HOST_PINNED_POOL}'" in stderr:
        return HOST_PINNED_POOL
    return "device" if "CUDA out of memory" in stderr else "host"


def cpu_attention_workspace_bytes(spec: StepSpec, config: PretrainedConfig) -> int:
    """RAM the engine's exact CPU attention kernel uses inside itself (the tracker sees only its outputs):
    float32 scores, probabilities and their gradient, (rows, heads, query chunk, seq_len) each."""
    seq_len = spec.seq_len_tokens
    queries = spec.stream.partition_size if method_class(spec.method).streams_layers else seq_len
    return 3 * 4 * spec.sequences * config.num_attention_heads * min(queries, seq_len) * seq_len


def _child_main(argv: list[str] | None = None) -> int:
    """Child-process entry: measure one step and print its ProbeResult as one JSON line."""
    parser = argparse.ArgumentParser(description="One measured max-length probe (used by cuda_probe).")
    parser.add_argument("--spec", required=True, help="StepSpec as JSON")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budget-bytes", type=int, default=0, help="cap the CUDA caching allocator here")
    args = parser.parse_args(argv)
    spec = StepSpec.of(**json.loads(args.spec))
    if args.device == "cuda" and args.budget_bytes:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_bytes / total))
    try:
        result = measure_setup(build_setup(spec, ResolvedModel(spec.model).config, args.device), args.device)
    except Exception as exc:
        if not is_oom(exc):
            raise
        result = ProbeResult(seq_len_tokens=spec.seq_len_tokens, status=OOM, source=SOURCES[args.device],
                             message=str(exc).split("\n")[0], oom_pool=oom_pool(exc))
    print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
