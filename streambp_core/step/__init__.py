"""One training step, from its spec to its figures: setup, one tracked step, the simulator, timing, probes.

    from streambp_core.config import StepSpec
    from streambp_core.step.simulate import simulate

    spec = StepSpec.of(model="Qwen/Qwen3-8B", method="streambp", seq_len_tokens=65536)
    simulate(spec).peak_gib

- `setup`: StepSpec -> model (random weights, LoRA), optimizer, inputs;
- `run`: one tracked step with phase cuts (forward, backward, embedding backward, optimizer step);
- `simulate`: the one simulator (meta tensors; depth extrapolation and chunk thinning as parameters);
- `timing`: warm-up, repeats, p20/p50/p80;
- `probe`: probes for the max-length search (simulated, measured on CPU, measured on CUDA in a child
  process) and `max_len`, the guided search over them;
- `simulation_mode` (memoised meta kernels and the logits category, a dispatch mode the tracked step
  enters), `protocol` (the paper's measurement script as reversible patches around a step), `shards`
  (one rank of N: how a shard stage lays out the model state), `batch` (random batches and objective
  inputs), `optim` (the step's optimizer), `estimate` (roofline step time), `partitions` (the largest
  partitions that fit), `target` (device and budget), `ops` (the aten ops a step dispatches).
"""
